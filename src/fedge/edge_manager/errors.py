"""Edge manager errors (a :class:`fedge.errors.FedgeError` branch)."""

from fedge.errors import FedgeError


class ManagerError(FedgeError):
    """A control-plane operation could not be done; the message says how to fix it."""


class UnknownEdgeError(ManagerError):
    pass


class UnknownModelError(ManagerError):
    pass


class RegistryError(ManagerError):
    """A model could not be published (unreadable ONNX, version taken, missing classes)."""
