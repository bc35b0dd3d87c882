"""Labels an operator gave at the manager, on their way down to the station that scored.

A station trains on the labels of the images it kept; an operator may label at the
station (``fedge agent label``, its local API) or at the manager (``fedge labels add``).
The manager's labels reach the station as a desired document like its config: a full,
versioned, signed, retained document per edge holding the newest labels given at the
manager for that edge's predictions (at most :data:`MAX_LABELS`). An edge that was
offline gets the latest on reconnect; it applies every label it has not seen (by label
id), so a label is applied once however often the document arrives.

An operator's undo withdraws a label (issue 30): the document then also lists the newest
withdrawals (:class:`Withdrawal`), and the station drops that prediction's label if it is
no newer than the one withdrawn (a label given after stands), as often as it is told.
"""

from dataclasses import dataclass, field

from fedge.protocols import validate
from fedge.protocols.errors import ValidationError
from fedge.protocols.records import LabelRecord

MAX_LABELS = 500
MAX_WITHDRAWALS = 200


@dataclass(frozen=True)
class Withdrawal:
    """An operator withdrew label ``label_id`` (given at ``at``) of ``prediction_id``."""

    label_id: str
    prediction_id: str
    at: float

    def __post_init__(self) -> None:
        validate.identifier(self.label_id, "label_id")
        validate.identifier(self.prediction_id, "prediction_id")
        validate.finite(self.at, "at", minimum=0.0)


@dataclass(frozen=True)
class StationLabels:
    fleet: str
    edge: str
    version: int
    labels: tuple[LabelRecord, ...]
    issued_at: float = 0.0
    # Optional extension (absent while None): the newest withdrawals of the edge's labels.
    withdrawn: tuple[Withdrawal, ...] | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)

    def __post_init__(self) -> None:
        validate.identifier(self.fleet, "fleet")
        validate.identifier(self.edge, "edge")
        validate.positive(self.version, "version")
        if len(self.labels) > MAX_LABELS:
            raise ValidationError(f"{len(self.labels)} labels, limit {MAX_LABELS}")
        if self.withdrawn is not None and len(self.withdrawn) > MAX_WITHDRAWALS:
            raise ValidationError(f"{len(self.withdrawn)} withdrawals, limit {MAX_WITHDRAWALS}")
        validate.finite(self.issued_at, "issued_at", minimum=0.0)
