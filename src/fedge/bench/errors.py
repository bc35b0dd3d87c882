"""The benchmarks' error base (light: worker processes import it without the testbed)."""

from fedge.errors import FedgeError


class BenchError(FedgeError):
    """A benchmark could not set up, or a helper process failed."""
