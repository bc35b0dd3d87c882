"""MQTT topic layout, split by direction so that broker ACLs can enforce who writes what.

    fedge/v1/{fleet}/{edge}/down/trust         retained TrustChain (manager key rotations)
    fedge/v1/{fleet}/{edge}/down/config        retained, signed EdgeConfig      (cloud writes)
    fedge/v1/{fleet}/{edge}/down/deploy        retained, signed DeploymentDesired
    fedge/v1/{fleet}/{edge}/down/evaluate      retained, signed EvaluationRequest (the gate)
    fedge/v1/{fleet}/{edge}/down/pace          retained, signed TelemetryPace (low space)
    fedge/v1/{fleet}/{edge}/up/state           retained Liveness (birth, will)  (edge writes)
    fedge/v1/{fleet}/{edge}/up/config          retained ConfigReport
    fedge/v1/{fleet}/{edge}/up/deploy          retained DeployStatus
    fedge/v1/{fleet}/{edge}/up/evaluate        retained EvaluationReport
    fedge/v1/{fleet}/{edge}/up/trust           retained TrustReport (the key the edge trusts)
    fedge/v1/{fleet}/{edge}/up/telemetry       RecordBatch, QoS 1
    fedge/v1/{fleet}/{edge}/up/predictions     RecordBatch, QoS 1
    fedge/v1/{fleet}/{edge}/up/labels          RecordBatch, QoS 1
    fedge/v1/{fleet}/{edge}/up/thumbnails      RecordBatch, QoS 1 (only when shared)
    fedge/v1/{fleet}/alerts                    Alert raised or cleared, QoS 1 (cloud writes)

The fleet level lets one broker serve several factories while ACLs keep them apart.
"""

from dataclasses import dataclass
from enum import StrEnum

from fedge.protocols import validate
from fedge.protocols.errors import DecodeError, ValidationError

ROOT = "fedge/v1"


class Direction(StrEnum):
    DOWN = "down"
    UP = "up"


class Down(StrEnum):
    # First: gRPC hands an edge its missing documents in this order, and the others may
    # be signed by a key the trust chain introduces.
    TRUST = "trust"
    CONFIG = "config"
    DEPLOY = "deploy"
    LABELS = "labels"
    EVALUATE = "evaluate"
    PACE = "pace"


class Up(StrEnum):
    STATE = "state"
    CONFIG = "config"
    DEPLOY = "deploy"
    TELEMETRY = "telemetry"
    PREDICTIONS = "predictions"
    LABELS = "labels"
    EVALUATE = "evaluate"
    TRUST = "trust"
    THUMBNAILS = "thumbnails"


# The retained up/ documents (statuses, not record streams); over gRPC they go through
# DesiredSync.Report rather than ReportUpload.
STATUS = (Up.STATE, Up.CONFIG, Up.DEPLOY, Up.EVALUATE, Up.TRUST)


@dataclass(frozen=True)
class EdgeTopic:
    fleet: str
    edge: str
    direction: Direction
    kind: str


def edge_root(fleet: str, edge: str) -> str:
    validate.identifier(fleet, "fleet")
    validate.identifier(edge, "edge")
    return f"{ROOT}/{fleet}/{edge}"


def down(fleet: str, edge: str, kind: Down) -> str:
    return f"{edge_root(fleet, edge)}/down/{kind.value}"


def up(fleet: str, edge: str, kind: Up) -> str:
    return f"{edge_root(fleet, edge)}/up/{kind.value}"


def alerts(fleet: str) -> str:
    """Where the manager publishes alerts (protocols.alerts): operators read it; no edge
    can write it (an edge's ACL covers only its own ``{edge}/up/`` subtree)."""
    validate.identifier(fleet, "fleet")
    return f"{ROOT}/{fleet}/alerts"


def edge_subscription(fleet: str, edge: str) -> str:
    """What an edge subscribes to: everything the cloud writes for it."""
    return f"{edge_root(fleet, edge)}/down/+"


def fleet_up_subscription(fleet: str) -> str:
    """What the manager subscribes to: everything every edge of the fleet writes."""
    validate.identifier(fleet, "fleet")
    return f"{ROOT}/{fleet}/+/up/+"


def parse(topic: str) -> EdgeTopic:
    parts = topic.split("/")
    if len(parts) != 6 or f"{parts[0]}/{parts[1]}" != ROOT:
        raise DecodeError(f"topic {topic!r:.120} is not in the fedge/v1 layout")
    _, _, fleet, edge, direction, kind = parts
    try:
        validate.identifier(fleet, "fleet")
        validate.identifier(edge, "edge")
        parsed_direction = Direction(direction)
        valid = Up if parsed_direction is Direction.UP else Down
        valid(kind)
    except (ValidationError, ValueError) as exc:
        raise DecodeError(f"topic {topic!r:.120}: {exc}") from None
    return EdgeTopic(fleet, edge, parsed_direction, kind)
