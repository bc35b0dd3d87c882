"""Edge agent errors (a :class:`fedge.errors.FedgeError` branch)."""

from fedge.errors import FedgeError


class AgentError(FedgeError):
    """Something on the device failed; the message says what and what to do."""


class SettingsError(AgentError):
    """agent.toml is missing, unreadable, or has a bad field (named in the message)."""


class DeployError(AgentError):
    """A deployment step failed; ``reason`` is reported up, the old model keeps serving."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class InferenceError(AgentError):
    """An image could not be scored (no model yet, bad image, runtime failure)."""


class StorageError(AgentError):
    """The agent's own file refused a write (most often a full disk); nothing was recorded."""


class NotServingError(InferenceError):
    """No model is serving yet (none deployed, or the last one failed its check at start)."""
