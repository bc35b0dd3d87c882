"""The demo's errors."""

from fedge.errors import FedgeError


class DemoError(FedgeError):
    """The demo could not run, or did not show what it is meant to show."""


class StoryCheckFailed(DemoError):
    """A chapter's figures missed what the README says it shows (issue 34)."""
