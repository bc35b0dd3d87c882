"""Whether the manager asks a station for an image: a pure decision over plain facts.

The manager's side of issue 30's rule: ask only when the station's *desired* signed config
allows operator viewing, the prediction is the station's, and the station has said where
it serves images. The station applies the same rule again from its own signed copy
(edge_agent/viewing/policy.py): the manager's check saves a round trip and says why in
words; the station's is the one that keeps the bytes home.
"""

from dataclasses import dataclass
from enum import StrEnum

from fedge.protocols.config import EdgeConfig


class NotAsked(StrEnum):
    UNKNOWN_EDGE = "unknown_edge"
    UNKNOWN_PREDICTION = "unknown_prediction"  # never reached the manager, or another's
    POLICY_OFF = "policy_off"
    NO_ENDPOINT = "no_endpoint"  # the station states no image address


@dataclass(frozen=True)
class ViewFacts:
    edge_enrolled: bool
    scored_by: str | None  # the station the prediction came from, per the manager's store
    edge: str  # the station asked about
    desired: EdgeConfig | None  # its newest desired config
    images_at: str  # '' : none stated


def allows_viewing(desired: EdgeConfig | None) -> bool:
    return desired is not None and desired.operator_viewing is True


def decide(facts: ViewFacts) -> NotAsked | None:
    """None: ask the station; else why the manager does not."""
    if not facts.edge_enrolled:
        return NotAsked.UNKNOWN_EDGE
    if facts.scored_by != facts.edge:
        return NotAsked.UNKNOWN_PREDICTION
    if not allows_viewing(facts.desired):
        return NotAsked.POLICY_OFF
    if not facts.images_at:
        return NotAsked.NO_ENDPOINT
    return None


EXPLAIN = {
    NotAsked.UNKNOWN_EDGE: "no such station is enrolled",
    NotAsked.UNKNOWN_PREDICTION: "no such prediction of this station has reached the manager",
    NotAsked.POLICY_OFF: (
        "this station's policy keeps its images on it (operator viewing is off); an admin "
        "can allow it on the edge page, or label at the station"
    ),
    NotAsked.NO_ENDPOINT: (
        "this station states no image address: set image_port (and image_address) in its "
        "agent.toml and restart the agent"
    ),
}
