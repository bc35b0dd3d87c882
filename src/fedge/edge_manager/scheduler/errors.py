"""The scheduler's errors: ``SchedulerError`` (a job, station or window is malformed;
nothing was queued) and its ``WindowError`` branch, under the manager's ``ManagerError``."""

from fedge.edge_manager.errors import ManagerError


class SchedulerError(ManagerError):
    """A job or station given to the scheduler is malformed; nothing was queued."""


class WindowError(SchedulerError):
    """A training window is malformed (times outside the day, a negative idle time)."""
