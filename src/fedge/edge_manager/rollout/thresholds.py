"""The thresholds that travel with a model in a staged rollout (pure).

Moving an edge ties its config to the rollout's model with that model's recommended
thresholds; sending it back restores the thresholds it had before, tied to its previous
model again (issue "The closed loop": a rollout moves model and threshold together).
A rollout carrying an anomaly model (issue 28) moves its anomaly threshold the same way:
the station's own threshold for that anomaly model (what the anomaly fleet job's
stations reported, kept with the model) tied to it; without one the station records
the new model's scores and calls nothing novel until an operator sets one. Going back
restores the anomaly threshold it had, tied to the anomaly model it had.
"""

import dataclasses

from fedge.edge_manager.desired.decide import next_config
from fedge.protocols.config import EdgeConfig
from fedge.protocols.manifest import Thresholds


def moved_config(
    current: EdgeConfig | None,
    *,
    fleet: str,
    edge: str,
    model: str,
    recommended: Thresholds | None,
    now: float,
    anomaly: str | None = None,
    anomaly_threshold: float | None = None,
) -> EdgeConfig:
    """The edge's next config when it moves to ``model``: tied to it, with the model's
    recommended thresholds (the gate's, else the manifest's), else the ones in force.
    With ``anomaly`` (the anomaly model moved beside it) and the station's own
    ``anomaly_threshold`` for it, that threshold tied to it."""
    config = next_config(current, fleet=fleet, edge=edge, now=now, model=model)
    if anomaly is not None and anomaly_threshold is not None:
        config = dataclasses.replace(
            config, anomaly_threshold=anomaly_threshold, anomaly_threshold_model=anomaly
        )
    if recommended is None:
        return config
    return dataclasses.replace(
        config,
        default_threshold=recommended.default_threshold,
        class_thresholds=dict(recommended.class_thresholds),
    )


def restored_config(
    current: EdgeConfig | None,
    previous: EdgeConfig | None,
    *,
    fleet: str,
    edge: str,
    previous_model: str | None,
    now: float,
) -> EdgeConfig:
    """The edge's next config when it goes back: the thresholds it had before it moved
    (the defaults if it had no config) -- its anomaly threshold and the anomaly model it
    was tied to included -- tied to its previous model again."""
    config = next_config(current, fleet=fleet, edge=edge, now=now, model=previous_model)
    before = previous or EdgeConfig(fleet=fleet, edge=edge, version=1)
    return dataclasses.replace(
        config,
        default_threshold=before.default_threshold,
        class_thresholds=dict(before.class_thresholds),
        anomaly_threshold=before.anomaly_threshold,
        anomaly_threshold_model=before.anomaly_threshold_model,
    )
