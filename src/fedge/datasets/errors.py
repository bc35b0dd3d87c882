"""Data set errors (a :class:`fedge.errors.FedgeError` branch)."""

from fedge.errors import FedgeError


class DatasetError(FedgeError):
    """A data set cannot be made or split as asked; the message says why."""
