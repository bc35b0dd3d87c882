"""Continuous-training errors (a :class:`fedge.errors.FedgeError` branch)."""

from fedge.errors import FedgeError


class LoopError(FedgeError):
    """The training loop cannot do what was asked; the message says what to change."""
