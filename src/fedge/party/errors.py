"""Party errors (a :class:`fedge.errors.FedgeError` branch)."""

from fedge.errors import FedgeError


class PartyError(FedgeError):
    """A party cannot train or evaluate: the message says what and what to do."""


class StationDataError(PartyError):
    """The station's kept images or labels are missing, unsafe or unreadable."""


class FamilyError(PartyError):
    """A model family is unknown, or cannot build or load the weights it was given."""
