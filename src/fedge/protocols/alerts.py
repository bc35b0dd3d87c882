"""What the manager tells operators when a serving model looks unwell: an alert.

The manager's monitor (``edge_manager/monitor.py``) raises one per (edge, model, kind)
while its condition holds and clears it when the condition stops holding or an operator
acknowledges it; each change is published on ``fedge/v1/{fleet}/alerts`` (see
:mod:`fedge.protocols.topics`), QoS 1, not retained: the store is the record, the topic
the notification.

Wire form: the codec's (``{"schema": 1, "kind": "alert", <fields>}``, key-sorted compact
JSON, strict decoding) through :func:`encode` and :func:`decode`.
"""

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from fedge.protocols import codec, validate
from fedge.protocols.errors import DecodeError, ValidationError

WIRE_KIND = "alert"
MAX_DETAIL_CHARS = 8192


class AlertKind(StrEnum):
    INPUT_DRIFT = "input_drift"  # image statistics drifted from the reference window
    SCORE_DRIFT = "score_drift"  # score features (top, margin, entropy) drifted
    ACCURACY_ESTIMATE = "accuracy_estimate"  # label-free (MPP) accuracy below the minimum


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


def to_wire_obj(alert: Alert) -> dict[str, Any]:
    return {"schema": codec.SCHEMA_VERSION, "kind": WIRE_KIND, **codec.to_plain(alert)}


def encode(alert: Alert) -> bytes:
    """Compact, key-sorted JSON, as :func:`fedge.protocols.codec.encode` writes messages."""
    return json.dumps(
        to_wire_obj(alert), separators=(",", ":"), sort_keys=True, allow_nan=False
    ).encode()


def decode(payload: bytes, *, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> Alert:
    """Decode one alert; raises only :class:`fedge.protocols.errors.ProtocolError`."""
    obj = codec.loads(payload, max_bytes=max_bytes)
    if type(obj) is not dict:
        raise DecodeError("message: expected object")
    schema = obj.get("schema")
    if type(schema) is not int or schema != codec.SCHEMA_VERSION:
        raise DecodeError(
            f"unsupported schema {schema!r} (this side speaks {codec.SCHEMA_VERSION})"
        )
    if obj.get("kind") != WIRE_KIND:
        raise DecodeError(f"expected kind {WIRE_KIND!r}, got {obj.get('kind')!r:.40}")
    body = {k: v for k, v in obj.items() if k not in ("schema", "kind")}
    try:
        return codec.decoder_for(Alert)(body, "")
    except (TypeError, ValueError) as exc:  # a rule we did not foresee must still be typed
        raise DecodeError(f"Alert: {exc}") from None
