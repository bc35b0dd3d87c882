"""The agent's own metrics, sent as telemetry records every report interval.

Cumulative counters (the manager takes differences: a staged rollout's ``error_rate`` is
``inference.errors`` over ``predictions`` since a move), the outbox backlog, and what the
station could train on.
"""

import time
from collections import Counter
from typing import Any

from fedge.edge_agent.settings import AgentSettings
from fedge.edge_agent.store import LocalStore
from fedge.party.privacy_status import FLOOR_JOB_METRIC, FLOOR_METRIC, SPENT_METRIC, read_spent
from fedge.party.station_store import StationData
from fedge.protocols.records import MetricRecord, Stream


def add_metric(store: LocalStore, name: str, value: float) -> None:
    store.add_record(Stream.TELEMETRY, MetricRecord(name, value, time.time()))


def emit_metrics(
    store: LocalStore,
    settings: AgentSettings,
    counters: Counter[str],
    station: StationData,
    training: dict[str, Any] | None,
    provider: str | None = None,
) -> None:
    backlog = store.backlog()
    if backlog["outbox_batches"] >= settings.telemetry_backlog_limit:
        # A long outage: metrics would grow the outbox by hundreds of batches a day and
        # say little once they arrive; the records that matter keep being kept.
        counters["telemetry.skipped"] += 1
        return
    for name, value in backlog.items():
        add_metric(store, name, float(value))
    add_metric(
        store, "predictions", float(counters["decision.accept"] + counters["decision.reject"])
    )
    add_metric(store, "inference.errors", float(counters["inference.errors"]))
    if provider is not None:  # 1: an accelerator serves (the provider is in the status)
        add_metric(store, "inference.accelerated", float(provider != "CPUExecutionProvider"))
    # What the station could train on, and whether it is ready to (the manager's
    # telemetry shows operators which stations a fleet job would find).
    for name, value in station.counts().items():
        add_metric(store, f"station.{name}", float(value))
    add_metric(store, "training.running", float(bool(training and training["running"])))
    # The epsilon the station's DP-SGD rounds spent over every job (its ClientApp's report).
    spent = read_spent(settings.data_dir)
    if spent is not None:
        add_metric(store, SPENT_METRIC, spent.epsilon)
    # The station's own privacy floor (0: its operator opted out), shown by `fedge edge show`.
    floor = settings.privacy_floor
    add_metric(store, FLOOR_METRIC, 0.0 if floor is None else floor.lifetime_epsilon)
    if floor is not None:
        add_metric(store, FLOOR_JOB_METRIC, floor.job_epsilon)
