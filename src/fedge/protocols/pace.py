"""How often a station should send its telemetry, when the manager asks it to slow down.

A manager whose store runs low on space (issue 33) keeps every prediction and label, but
the stations' telemetry -- metric records every report interval, the bulk of what a
healthy fleet sends -- can wait: the manager asks each station to send it ``factor``
times less often until space returns, and then asks for the normal pace again. It is a
signed, versioned, retained desired document per edge (``down/pace``), like a config:
a forged or replayed one is refused, so nobody on the plant network can silence a
station's metrics. Predictions, labels, statuses and the liveness heartbeat never slow.
"""

from dataclasses import dataclass

from fedge.protocols import validate
from fedge.protocols.errors import ValidationError

# The slowest a document may ask for: 60x the report interval (5 s -> 5 min by default);
# slower, an operator would not see a station's counters move for too long.
MAX_FACTOR = 60.0


@dataclass(frozen=True)
class TelemetryPace:
    fleet: str
    edge: str
    version: int
    factor: float  # 1: the normal pace; 6: a metric record every 6th report interval
    reason: str = ""  # what the station logs and shows, e.g. the manager's low-space line
    issued_at: float = 0.0

    def __post_init__(self) -> None:
        validate.identifier(self.fleet, "fleet")
        validate.identifier(self.edge, "edge")
        validate.positive(self.version, "version")
        validate.finite(self.factor, "factor", minimum=1.0)
        if self.factor > MAX_FACTOR:
            raise ValidationError(f"factor {self.factor:g} above the limit of {MAX_FACTOR:g}")
        validate.bounded_text(self.reason, "reason", 512)
        validate.finite(self.issued_at, "issued_at", minimum=0.0)

    @property
    def slowed(self) -> bool:
        return self.factor > 1.0
