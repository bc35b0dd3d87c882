"""The gate's wire messages: what they refuse, and that a full report fits the codec."""

import dataclasses
import uuid
from typing import Any

import pytest

from fedge.protocols import codec
from fedge.protocols.errors import DecodeError, ValidationError
from fedge.protocols.evaluation import (
    DEFAULT_AUGMENT,
    MAX_AUGMENT,
    MAX_IMAGES,
    MAX_ITEMS,
    EvaluationItem,
    EvaluationReport,
    EvaluationRequest,
    EvaluationStatus,
    check_model_ref,
)

REQUEST = EvaluationRequest("plant-a", "st-01", 3, "ev-1", ('{"a":1}', '{"b":2}'), "m:1", 50, 1.0)
ITEM = EvaluationItem(
    "p-1", "inspect:4", "scratch", {"clean": 0.25, "scratch": 0.75}, {"mean": 0.5}
)
REPORT = EvaluationReport("st-01", "ev-1", 3, EvaluationStatus.DONE, "", 10, (ITEM,), 1.0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"manifest_envelopes": ()}, "1 to 2 models"),
        ({"manifest_envelopes": ("a", "b", "c")}, "1 to 2 models"),
        ({"manifest_envelopes": ("a", "a")}, "named twice"),
        ({"manifest_envelopes": ("x" * 70_000,)}, "limit 65536"),
        ({"max_images": 0}, "max_images"),
        ({"max_images": MAX_IMAGES + 1}, "max_images"),
        ({"eval_id": "ev/1"}, "eval_id"),
        ({"edge": "+"}, "edge"),
        ({"version": 0}, "version"),
        ({"issued_at": float("inf")}, "issued_at"),
        ({"augment": -1}, "augment"),
        ({"augment": MAX_AUGMENT + 1}, "augment"),
    ],
)
def test_a_bad_request_is_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        dataclasses.replace(REQUEST, **changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": "inspect"}, "NAME:VERSION"),
        ({"model": "inspect:0"}, "version"),
        ({"model": "in/spect:1"}, "model name"),
        ({"label": "two words"}, "label"),
        ({"scores": {}}, "classes"),
        ({"scores": {"clean": 1.5}}, r"\[0, 1\]"),
        ({"stats": {f"s{i}": 0.0 for i in range(17)}}, "limit 16"),
        ({"stats": {"mean": float("nan")}}, "finite"),
        ({"augmented": 0}, "copy index"),
        ({"augmented": MAX_AUGMENT + 1}, "copy index"),
    ],
)
def test_a_bad_item_is_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        dataclasses.replace(ITEM, **changes)


def test_a_bad_report_is_refused() -> None:
    with pytest.raises(ValidationError, match="carries no items"):
        dataclasses.replace(REPORT, status=EvaluationStatus.FAILED)
    with pytest.raises(ValidationError, match="scored twice"):
        dataclasses.replace(REPORT, items=(ITEM, ITEM))
    three = tuple(dataclasses.replace(ITEM, model=f"inspect:{v}") for v in (1, 2, 3))
    with pytest.raises(ValidationError, match="more than 2 models"):
        dataclasses.replace(REPORT, items=three)
    too_many = tuple(
        dataclasses.replace(ITEM, prediction_id=f"p-{i}") for i in range(MAX_ITEMS + 1)
    )
    with pytest.raises(ValidationError, match=f"limit {MAX_ITEMS}"):
        dataclasses.replace(REPORT, items=too_many)
    with pytest.raises(ValidationError, match="reason"):
        dataclasses.replace(REPORT, reason="x" * 2000)


def test_strict_decoding_of_a_report() -> None:
    wire = codec.encode(REPORT)
    assert codec.decode(wire, EvaluationReport) == REPORT
    with pytest.raises(DecodeError, match="unknown field"):
        codec.decode(wire.replace(b'"holdout"', b'"held"'), EvaluationReport)
    with pytest.raises(DecodeError, match="expected one of"):
        codec.decode(wire.replace(b'"done"', b'"maybe"'), EvaluationReport)
    with pytest.raises(DecodeError, match="expected kind"):
        codec.decode(wire, EvaluationRequest)


def test_a_full_report_of_two_models_fits_the_codec_limit() -> None:
    stats = dict.fromkeys(("mean", "std", "p05", "p95", "edges"), 0.123456)
    items = tuple(
        EvaluationItem(
            f"p-{uuid.uuid4().hex}", model, "scratch", {"clean": 0.1, "scratch": 0.9}, stats
        )
        for _ in range(MAX_IMAGES)
        for model in ("inspect:3", "inspect:4")
    )
    report = dataclasses.replace(REPORT, items=items, holdout=5000)
    assert len(codec.encode(report)) < codec.DEFAULT_MAX_BYTES // 2


def test_re_lit_copies_are_items_of_their_own_and_optional_on_the_wire() -> None:
    copy = dataclasses.replace(ITEM, augmented=1)
    report = dataclasses.replace(REPORT, items=(ITEM, copy))  # same image and model
    assert codec.decode(codec.encode(report), EvaluationReport) == report
    assert b'"augmented":1' in codec.encode(report)
    with pytest.raises(ValidationError, match="scored twice"):
        dataclasses.replace(REPORT, items=(ITEM, copy, copy))
    # Unset, neither field is on the wire: an older manager or station decodes the rest.
    assert b"augment" not in codec.encode(REPORT)
    assert b"augment" not in codec.encode(REQUEST)
    assert REQUEST.augment is None and REQUEST.copies == DEFAULT_AUGMENT
    none = dataclasses.replace(REQUEST, augment=0)
    assert none.copies == 0 and codec.decode(codec.encode(none), EvaluationRequest) == none


def test_a_report_from_before_re_lit_copies_decodes() -> None:
    """Bytes as a station sent them before the ``augmented`` field existed."""
    old = (
        b'{"edge":"st-01","eval_id":"ev-1","holdout":10,"items":[{"label":"scratch",'
        b'"model":"inspect:4","prediction_id":"p-1","scores":{"clean":0.25,"scratch":0.75},'
        b'"stats":{"mean":0.5}}],"kind":"evaluation_report","reason":"","reported_at":1.0,'
        b'"schema":1,"status":"done","version":3}'
    )
    decoded = codec.decode(old, EvaluationReport)
    assert decoded == REPORT and decoded.items[0].augmented is None
    assert codec.encode(REPORT) == old  # and what it decodes to encodes the same bytes
    old_request = codec.encode(REQUEST)
    assert codec.decode(old_request, EvaluationRequest).copies == DEFAULT_AUGMENT


def test_model_refs() -> None:
    assert check_model_ref("inspect:12") == ("inspect", 12)
    with pytest.raises(ValidationError):
        check_model_ref("inspect:" + "9" * 30)
