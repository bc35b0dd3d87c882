"""Transport errors (a :class:`fedge.errors.FedgeError` branch)."""

from fedge.errors import FedgeError


class TransportError(FedgeError):
    """The broker or the network failed in a way the caller must hear about."""


class BrokerError(TransportError):
    """The local Mosquitto we manage could not be configured or started."""
