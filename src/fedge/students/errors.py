"""Student errors (a :class:`fedge.errors.FedgeError` branch)."""

from fedge.errors import FedgeError


class StudentError(FedgeError):
    """A student cannot be built from its teacher, distilled or published."""
