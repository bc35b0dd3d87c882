"""Birth and death of an edge's MQTT session.

Both carry the session counter (Sparkplug's ``bdSeq``, widened): the edge increments and
persists it at every CONNECT, so the manager can drop a last will that arrives after the
edge already came back with a newer birth (the will-overtakes-rebirth race).
"""

from dataclasses import dataclass, field
from enum import StrEnum

from fedge.protocols import validate
from fedge.protocols.viewing import check_address


class EdgeState(StrEnum):
    ONLINE = "online"
    OFFLINE = "offline"  # clean shutdown
    LOST = "lost"  # last will: the broker saw the connection die


@dataclass(frozen=True)
class Liveness:
    edge: str
    session: int
    state: EdgeState
    agent_version: str = ""
    serving: str = ""
    applied_config_version: int = 0
    at: float = 0.0
    # Where the station serves its images to the manager over mutual TLS, host:port
    # (protocols/viewing.py); absent where it serves none.
    images_at: str | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)

    def __post_init__(self) -> None:
        validate.identifier(self.edge, "edge")
        validate.u64(self.session, "session")
        validate.bounded_text(self.agent_version, "agent_version", 64)
        validate.bounded_text(self.serving, "serving", 200)
        validate.u64(self.applied_config_version, "applied_config_version")
        if self.images_at is not None:
            check_address(self.images_at)
