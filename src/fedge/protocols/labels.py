"""Labels an operator gave at the manager, on their way down to the station that scored.

A station trains on the labels of the images it kept; an operator may label at the
station (``fedge agent label``, its local API) or at the manager (``fedge labels add``).
The manager's labels reach the station as a desired document like its config: a full,
versioned, signed, retained document per edge holding the newest labels given at the
manager for that edge's predictions (at most :data:`MAX_LABELS`). An edge that was
offline gets the latest on reconnect; it applies every label it has not seen (by label
id), so a label is applied once however often the document arrives.
"""

from dataclasses import dataclass

from fedge.protocols import validate
from fedge.protocols.errors import ValidationError
from fedge.protocols.records import LabelRecord

MAX_LABELS = 500


@dataclass(frozen=True)
class StationLabels:
    fleet: str
    edge: str
    version: int
    labels: tuple[LabelRecord, ...]
    issued_at: float = 0.0

    def __post_init__(self) -> None:
        validate.identifier(self.fleet, "fleet")
        validate.identifier(self.edge, "edge")
        validate.positive(self.version, "version")
        if len(self.labels) > MAX_LABELS:
            raise ValidationError(f"{len(self.labels)} labels, limit {MAX_LABELS}")
        validate.finite(self.issued_at, "issued_at", minimum=0.0)
