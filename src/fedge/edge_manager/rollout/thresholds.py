"""The thresholds that travel with a model in a staged rollout (pure).

Moving an edge ties its config to the rollout's model with that model's recommended
thresholds; sending it back restores the thresholds it had before, tied to its previous
model again (issue "The closed loop": a rollout moves model and threshold together).
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
) -> EdgeConfig:
    """The edge's next config when it moves to ``model``: tied to it, with the model's
    recommended thresholds (the gate's, else the manifest's), else the ones in force."""
    config = next_config(current, fleet=fleet, edge=edge, now=now, model=model)
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
    (the defaults if it had no config), tied to its previous model again."""
    config = next_config(current, fleet=fleet, edge=edge, now=now, model=previous_model)
    before = previous or EdgeConfig(fleet=fleet, edge=edge, version=1)
    return dataclasses.replace(
        config,
        default_threshold=before.default_threshold,
        class_thresholds=dict(before.class_thresholds),
    )
