"""The alert message and the image statistics of a prediction record, on the wire."""

import json

import pytest

from fedge.protocols import codec, topics
from fedge.protocols.alerts import Alert, AlertKind, AlertState
from fedge.protocols.errors import DecodeError, ValidationError
from fedge.protocols.records import PredictionRecord, RecordBatch, Stream

RAISED = Alert(
    alert_id="a-1",
    fleet="plant-a",
    edge="st-01",
    model="inspect:1",
    condition=AlertKind.INPUT_DRIFT,
    state=AlertState.RAISED,
    value=1.5,
    threshold=0.25,
    detail='{"drifted":["mean"]}',
    raised_at=1700000000.0,
)
GOLDEN = (
    b'{"alert_id":"a-1","cleared_at":null,"cleared_by":"","condition":"input_drift",'
    b'"detail":"{\\"drifted\\":[\\"mean\\"]}","edge":"st-01","fleet":"plant-a",'
    b'"kind":"alert","model":"inspect:1","raised_at":1700000000.0,"schema":1,'
    b'"state":"raised","threshold":0.25,"value":1.5}'
)


def test_alert_golden_bytes_and_round_trip() -> None:
    assert codec.encode(RAISED) == GOLDEN
    assert codec.decode(GOLDEN, Alert) == RAISED
    cleared = Alert(
        **{
            **RAISED.__dict__,
            "state": AlertState.CLEARED,
            "cleared_at": 1700000010.0,
            "cleared_by": "alice",
        }
    )
    assert codec.decode(codec.encode(cleared), Alert) == cleared


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (GOLDEN.replace(b'"kind":"alert"', b'"kind":"liveness"'), DecodeError),
        (GOLDEN.replace(b'"schema":1', b'"schema":2'), DecodeError),
        (GOLDEN.replace(b'"input_drift"', b'"sunspots"'), DecodeError),
        (GOLDEN.replace(b'"value":1.5', b'"value":"1.5"'), DecodeError),
        (GOLDEN.replace(b'"value":1.5', b'"value":NaN'), DecodeError),
        (GOLDEN.replace(b'"state":"raised"', b'"state":"cleared"'), ValidationError),
        (GOLDEN.replace(b'"edge":"st-01"', b'"edge":"st/+"'), ValidationError),
        (GOLDEN.replace(b'"detail":"{', b'"detail":"[1,'), ValidationError),
        (GOLDEN[:-1] + b',"extra":1}', DecodeError),
        (b"[]", DecodeError),
        (b"\xff", DecodeError),
    ],
)
def test_bad_alerts_are_refused(payload: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        codec.decode(payload, Alert)


def test_the_alerts_topic_is_the_fleets_not_an_edges() -> None:
    assert topics.alerts("plant-a") == "fedge/v1/plant-a/alerts"
    with pytest.raises(DecodeError):
        topics.parse(topics.alerts("plant-a"))  # never taken for an edge's up/ topic
    with pytest.raises(ValidationError):
        topics.alerts("plant/#")


def _record(stats: dict[str, float] | None) -> PredictionRecord:
    return PredictionRecord(
        "p-1",
        1.0,
        "inspect:1",
        {"clean": 0.9, "scratch": 0.1},
        "accept",
        0.5,
        1,
        1.0,
        "file:a.png",
        stats,
    )


def test_stats_travel_in_a_prediction_and_are_left_out_when_absent() -> None:
    stats = {"mean": 0.5, "std": 0.25, "p05": 0.0, "p95": 1.0, "edges": 0.125}
    batch = RecordBatch("st-01", Stream.PREDICTIONS, 1, 0, (_record(stats), _record(None)))
    wire = json.loads(codec.encode(batch))
    assert wire["records"][0]["stats"] == stats
    assert "stats" not in wire["records"][1]  # an older manager decodes it as before
    assert codec.decode(codec.encode(batch), RecordBatch) == batch


@pytest.mark.parametrize(
    "stats",
    [
        {f"s{i}": 0.0 for i in range(17)},
        {"mean": float("nan")},
        {"mean": float("inf")},
        {"bad key": 1.0},
        {"": 1.0},
    ],
)
def test_malformed_stats_are_refused(stats: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        _record(stats)


def test_malformed_stats_on_the_wire_are_refused() -> None:
    good = codec.encode(RecordBatch("st-01", Stream.PREDICTIONS, 1, 0, (_record({"mean": 0.5}),)))
    for bad, error in (
        (b'"stats":{"mean":"bright"}', DecodeError),
        (b'"stats":[0.5]', DecodeError),
        (b'"stats":{"mean":1e999}', DecodeError),
        (b'"stats":{"me/an":0.5}', ValidationError),
    ):
        with pytest.raises(error):
            codec.decode(good.replace(b'"stats":{"mean":0.5}', bad), RecordBatch)
