"""What the manager tells operators when a serving model looks unwell: an alert.

The manager's monitor (``edge_manager/monitor/tick.py``) raises one per (edge, model, kind)
while its condition holds and clears it when the condition stops holding or an operator
acknowledges it; each change is published on ``fedge/v1/{fleet}/alerts`` (see
:mod:`fedge.protocols.topics`), QoS 1, not retained: the store is the record, the topic
the notification.

Wire form: a codec message like every other (``codec.encode(alert)``,
``codec.decode(payload, Alert)``: ``{"schema": 1, "kind": "alert", <fields>}``).
"""

import json
from dataclasses import dataclass
from enum import StrEnum

from fedge.protocols import validate
from fedge.protocols.errors import ValidationError

MAX_DETAIL_CHARS = 8192


class AlertKind(StrEnum):
    INPUT_DRIFT = "input_drift"  # image statistics drifted from the reference window
    SCORE_DRIFT = "score_drift"  # score features (top, margin, entropy) drifted
    ACCURACY_ESTIMATE = "accuracy_estimate"  # label-free (MPP) accuracy below the minimum
    # Parts the classifier did not recognise as a known defect but the anomaly model
    # scored over the station's anomaly threshold (PredictionRecord.novel), arriving
    # faster than its false-alarm rate explains (issue 28).
    NOVEL_RATE = "novel_rate"
    # A station rolled a model back on its own after the rollout that moved it completed
    # (raised by the rollout driver, not the monitor; an operator acknowledges it).
    LOCAL_ROLLBACK = "local_rollback"


MONITOR_KINDS = frozenset(
    {
        AlertKind.INPUT_DRIFT,
        AlertKind.SCORE_DRIFT,
        AlertKind.ACCURACY_ESTIMATE,
        AlertKind.NOVEL_RATE,
    }
)
"""The kinds the monitor raises and clears itself (it leaves the others alone)."""


class AlertState(StrEnum):
    RAISED = "raised"
    CLEARED = "cleared"


@dataclass(frozen=True)
class Alert:
    alert_id: str
    fleet: str
    edge: str
    model: str  # "name:version"
    condition: AlertKind  # the alerts table's ``kind`` ("kind" on the wire is the message's)
    state: AlertState
    value: float  # the largest PSI of a drifted feature, or the estimated accuracy
    threshold: float
    detail: str  # a JSON object: which features drifted (PSI, p), the windows
    raised_at: float
    cleared_at: float | None = None
    cleared_by: str = ""  # "monitor" (the condition no longer holds) or the operator

    def __post_init__(self) -> None:
        validate.identifier(self.alert_id, "alert_id")
        validate.identifier(self.fleet, "fleet")
        validate.identifier(self.edge, "edge")
        validate.bounded_text(self.model, "model", 200)
        validate.finite(self.value, "value")
        validate.finite(self.threshold, "threshold")
        validate.finite(self.raised_at, "raised_at", minimum=0.0)
        validate.bounded_text(self.detail, "detail", MAX_DETAIL_CHARS)
        validate.bounded_text(self.cleared_by, "cleared_by", 128)
        try:
            parsed = json.loads(self.detail)
        except ValueError:
            raise ValidationError("detail must be a JSON object") from None
        if not isinstance(parsed, dict):
            raise ValidationError("detail must be a JSON object")
        if (self.state is AlertState.CLEARED) != (self.cleared_at is not None):
            raise ValidationError("cleared_at is set exactly when the state is 'cleared'")
        if self.cleared_at is not None:
            validate.finite(self.cleared_at, "cleared_at", minimum=self.raised_at)
