"""Console errors (a :class:`fedge.errors.FedgeError` branch; see the package docstring)."""

from fedge.errors import FedgeError


class ConsoleError(FedgeError):
    """The console could not do something; the message says how to fix it."""


class BadInput(ConsoleError):
    """A form field is malformed or was tampered with: the page says which, nothing changes."""
