"""``PredictionRecord.novel`` (issue 28): over the anomaly threshold, and not a known
defect to the classifier -- called clean, or rejected without confidence."""

import pytest

from fedge.protocols.records import NOVEL_CONFIDENCE, AnomalyScore, PredictionRecord


def record(
    decision: str, scratch: float, score: float | None, threshold: float | None = 10.0
) -> PredictionRecord:
    return PredictionRecord(
        prediction_id="p-1",
        at=1.0,
        model="inspect:1",
        scores={"clean": 1.0 - scratch, "scratch": scratch},
        decision=decision,
        threshold=0.5,
        config_version=1,
        latency_ms=0.5,
        anomaly=None if score is None else AnomalyScore("inspect-anomaly:1", score, threshold),
    )


@pytest.mark.parametrize(
    ("decision", "scratch", "score", "novel"),
    [
        ("accept", 0.1, 14.0, True),  # passed, yet unlike good parts: the escape to catch
        ("accept", 0.1, 6.0, False),  # passed and normal
        ("reject", 0.7, 14.0, True),  # rejected, but as no defect it knows well
        ("reject", 0.99, 14.0, False),  # a scratch it knows: a known defect, not novel
        ("reject", 0.7, 6.0, False),  # unsure, but not unlike good parts
    ],
)
def test_novel_is_anomalous_and_not_a_known_defect(
    decision: str, scratch: float, score: float, novel: bool
) -> None:
    assert record(decision, scratch, score).novel is novel


def test_the_confidence_level_is_strict_and_needs_a_verdict() -> None:
    assert not record("reject", NOVEL_CONFIDENCE, 14.0).novel  # at the level: confident
    assert record("reject", NOVEL_CONFIDENCE - 0.01, 14.0).novel
    assert not record("accept", 0.1, 10.0).novel  # at the threshold: not over it
    assert not record("accept", 0.1, 14.0, threshold=None).novel  # no threshold in force
    assert not record("accept", 0.1, None).novel  # no anomaly model served
