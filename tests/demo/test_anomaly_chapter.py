"""The demo's anomaly chapter, its pure parts: a station's record read as a scored part,
the per-station tallies and plot data, and the summary the self-checks read."""

from pathlib import Path
from typing import Any

from fedge.demo import anomaly
from fedge.demo.anomaly import DENT, GOOD, SCRATCH, AnomalyChapter, ScoredPart
from fedge.demo.checks import story_checks


def record(pid: str, decision: str, score: float | None, threshold: float | None) -> dict[str, Any]:
    """A station's prediction record as its local API answers it."""
    body: dict[str, Any] = {"prediction_id": pid, "decision": decision, "model": "inspect:2"}
    if score is not None:
        body["anomaly"] = {"model": "inspect-anomaly:1", "score": score}
        if threshold is not None:
            body["anomaly"]["threshold"] = threshold
    return body


def test_a_part_is_novel_only_when_passed_and_over_its_stations_threshold() -> None:
    assert anomaly.part_of("st-02", DENT, record("p1", "accept", 30.0, 19.0)).novel
    assert not anomaly.part_of("st-02", DENT, record("p2", "reject", 30.0, 19.0)).novel
    assert not anomaly.part_of("st-02", GOOD, record("p3", "accept", 19.0, 19.0)).novel
    unset = anomaly.part_of("st-02", DENT, record("p4", "accept", 30.0, None))
    assert not unset.novel and unset.threshold is None and unset.anomaly_score == 30.0
    bare = anomaly.part_of("st-01", GOOD, record("p5", "accept", None, None))
    assert bare == ScoredPart("st-01", "p5", GOOD, "accept", None, None, False)
    # A reject without confidence is not a known defect: novel, as the manager calls it.
    unsure = record("p6", "reject", 30.0, 19.0)
    unsure["scores"] = {"clean": 0.3, "scratch": 0.7}
    assert anomaly.part_of("st-02", DENT, unsure).novel
    unsure["scores"] = {"clean": 0.01, "scratch": 0.99}
    assert not anomaly.part_of("st-02", DENT, unsure).novel


PARTS = [
    anomaly.part_of("st-01", GOOD, record("a1", "accept", 12.0, 21.5)),
    anomaly.part_of("st-01", SCRATCH, record("a2", "reject", 40.0, 21.5)),
    anomaly.part_of("st-02", GOOD, record("b1", "accept", 25.0, 19.0)),
    anomaly.part_of("st-02", DENT, record("b2", "accept", 30.0, 19.0)),
    anomaly.part_of("st-02", DENT, record("b3", "accept", 15.0, 19.0)),
    anomaly.part_of("st-02", DENT, record("b4", "reject", 35.0, 19.0)),
    anomaly.part_of("st-02", DENT, record("b5", "accept", None, None)),  # no score
]


def test_each_station_is_tallied_and_plotted_by_what_the_part_was() -> None:
    assert anomaly.tally(PARTS, "st-02") == {
        "dents": 4, "dents_passed": 3, "dents_novel": 1, "good": 1, "good_novel": 1,
    }  # fmt: skip
    data = anomaly.plot_data(PARTS)
    assert list(data) == ["st-01", "st-02"]
    assert data["st-01"] == anomaly.StationPlot(21.5, [12.0], [], [], [], [40.0])
    # A part without an anomaly score is left out of the plot, not drawn at 0.
    assert data["st-02"] == anomaly.StationPlot(19.0, [25.0], [30.0], [15.0], [35.0], [])


def chapter() -> AnomalyChapter:
    result = AnomalyChapter(Path("/demo/anomaly-job"), "inspect-anomaly:1", "inspect:2", 42.0)
    result.counted = {"st-01": 30, "st-02": 28, "st-03": 31}
    result.fit_count = 89
    result.thresholds = {"st-01": 21.5, "st-02": 19.0, "st-03": 22.0}
    result.parts = [
        *PARTS[:5],
        anomaly.part_of("st-03", DENT, record("c1", "accept", 60.0, 22.0)),
        anomaly.part_of("st-03", GOOD, record("c2", "accept", 10.0, 22.0)),
    ]
    novel = [p for p in result.parts if p.novel]
    result.queue = [
        {"prediction_id": p.prediction_id, "novel": True, "edge": p.edge} for p in novel
    ] + [{"prediction_id": "b3", "novel": False, "edge": "st-02"}]
    result.queue_after = result.queue[-1:]
    result.labelled = {"b1": "clean", "b2": "scratch", "c1": "scratch"}
    return result


def test_the_chapters_summary_passes_its_checks_and_its_report_names_the_figures() -> None:
    summary = {"edges": [{"edge": e} for e in ("st-01", "st-02", "st-03")]}
    summary["anomaly"] = anomaly.summary(chapter())  # type: ignore[assignment]
    results = [r for r in story_checks(summary) if r.chapter == "what normal looks like"]
    assert len(results) == 7 and all(r.ok for r in results), [r.line for r in results]
    lines = anomaly.report_lines(chapter())
    assert lines[0] == "## What normal looks like"
    assert "| st-02 | 19.0 | 2 | 2 | 1 | 1 | 1 |" in lines
    assert any("(3 on its first page of 4)" in line for line in lines)
    assert "![anomaly scores per station](anomaly-scores.png)" in lines


def test_a_summary_without_the_labels_fails_its_check() -> None:
    unlabelled = chapter()
    unlabelled.labelled = {}
    summary = {"edges": [{"edge": e} for e in ("st-01", "st-02", "st-03")]}
    summary["anomaly"] = anomaly.summary(unlabelled)  # type: ignore[assignment]
    failed = [
        r for r in story_checks(summary) if r.chapter == "what normal looks like" and not r.ok
    ]
    assert [r.figure for r in failed] == ["0 of 3 labelled; 0 novel left in the queue"]


def test_the_plot_is_written(tmp_path: Path) -> None:
    path = tmp_path / "anomaly-scores.png"
    anomaly.plot(chapter(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
