"""Aggregator errors (a :class:`fedge.errors.FedgeError` branch).

Each subclass stays in the module of the concept it guards (``checkpoint.CheckpointError``,
``factory.StrategyConfigError``, ``job_dir.JobError``, ``job_spec.ManifestError``); this
module holds only their common base, so a caller can catch the whole package at once.
"""

from fedge.errors import FedgeError


class AggregatorError(FedgeError):
    """The aggregator cannot build a strategy, run a job, or read or write its state."""
