"""Simulator errors (a :class:`fedge.errors.FedgeError` branch).

Each subclass stays in the module of the concept it guards (``scenario.ScenarioError``,
``profiles.SimulatedFailure``, ``report.ReportExistsError``,
``server_app.ServerConfigError``); this module holds only their common base.
"""

from fedge.errors import FedgeError


class SimError(FedgeError):
    """A simulated federation cannot be set up, run or reported; the message says why."""
