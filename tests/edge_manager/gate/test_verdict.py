"""The gate's verdict (pure): per-station and overall accuracy, blessing, thresholds."""

import json

import pytest

from fedge.edge_manager.gate.verdict import (
    GatePolicy,
    GatePolicyError,
    Scored,
    StationReport,
    Verdict,
    judge,
    recommend_thresholds,
    top_class,
)

CAND, SERV = "inspect:4", "inspect:3"
POLICY = GatePolicy(max_station_drop=0.02, min_overall_gain=0.0, min_examples=10)


def _scores(predicted: str) -> dict[str, float]:
    return (
        {"clean": 0.9, "scratch": 0.1} if predicted == "clean" else {"clean": 0.2, "scratch": 0.8}
    )


def station(
    edge: str, n: int, cand_right: int, serv_right: int, serving: str | None = SERV
) -> tuple[StationReport, dict[str, str]]:
    """``n`` images labelled alternately clean/scratch; the candidate gets the first
    ``cand_right`` right, the serving model the first ``serv_right``."""
    items, labels = [], {}
    for i in range(n):
        pid = f"p-{edge}-{i:03d}"
        label = "clean" if i % 2 == 0 else "scratch"
        wrong = "scratch" if label == "clean" else "clean"
        labels[pid] = label
        items.append(Scored(pid, CAND, label, _scores(label if i < cand_right else wrong)))
        if serving is not None:
            items.append(Scored(pid, serving, label, _scores(label if i < serv_right else wrong)))
    return StationReport(edge, serving, "done", holdout=n, items=tuple(items)), labels


def gate(*reports: tuple[StationReport, dict[str, str]], policy: GatePolicy = POLICY) -> Verdict:
    labels = {k: v for _, lab in reports for k, v in lab.items()}
    return judge(CAND, [r for r, _ in reports], labels, policy, ("scratch",))


def test_a_candidate_better_everywhere_is_blessed() -> None:
    verdict = gate(station("st-01", 20, 19, 16), station("st-02", 20, 18, 17))
    assert verdict.blessed, verdict.reason
    assert verdict.overall.examples == 40
    assert verdict.overall.candidate_accuracy == pytest.approx(37 / 40)
    assert verdict.overall.serving_accuracy == pytest.approx(33 / 40)
    assert verdict.overall.gain == pytest.approx(4 / 40)
    assert [s.passed for s in verdict.stations] == [True, True]
    assert verdict.reason.startswith("better overall")


def test_re_lit_copies_never_judge_a_model() -> None:
    """A station's re-lit copies (augmented items, same prediction id) train MPP only:
    here the candidate gets every copy wrong and the serving model every copy right,
    which would fail the candidate if they counted."""
    report, labels = station("st-01", 20, 19, 16)
    copies = []
    for item in report.items:
        wrong = "scratch" if item.label == "clean" else "clean"
        predicted = wrong if item.model == CAND else item.label
        for copy in (1, 2):
            copies.append(
                Scored(item.prediction_id, item.model, item.label, _scores(predicted), copy)
            )
    with_copies = StationReport(
        "st-01", SERV, "done", holdout=20, items=report.items + tuple(copies)
    )
    verdict = judge(CAND, [with_copies], labels, POLICY, ("scratch",))
    assert verdict.blessed, verdict.reason
    (evidence,) = verdict.stations
    assert evidence.examples == 20 and evidence.candidate_accuracy == pytest.approx(19 / 20)
    assert verdict == judge(CAND, [report], labels, POLICY, ("scratch",))


def test_a_candidate_worse_on_one_station_is_not_blessed_and_the_evidence_names_it() -> None:
    # Much better on st-01, 10 points worse on st-02: better overall, but not blessed.
    verdict = gate(station("st-01", 20, 20, 10), station("st-02", 20, 16, 18))
    assert verdict.overall.gain is not None and verdict.overall.gain > 0
    assert not verdict.blessed
    assert verdict.failed_stations == ("st-02",)
    assert "st-02" in verdict.reason
    evidence = json.loads(json.dumps(verdict.evidence()))  # JSON-ready as stored
    assert evidence["failed_stations"] == ["st-02"]
    by_edge = {s["edge"]: s for s in evidence["stations"]}
    assert by_edge["st-02"]["passed"] is False
    assert by_edge["st-02"]["delta"] == pytest.approx(-0.1)
    assert "worse by 0.100" in by_edge["st-02"]["reason"]
    assert by_edge["st-01"]["passed"] is True


def test_a_drop_within_the_margin_passes_and_the_margin_is_configurable() -> None:
    reports = (station("st-01", 50, 50, 40), station("st-02", 50, 49, 50))  # -0.02 on st-02
    assert gate(*reports).blessed
    strict = GatePolicy(max_station_drop=0.0, min_examples=10)
    verdict = gate(*reports, policy=strict)
    assert not verdict.blessed and verdict.failed_stations == ("st-02",)


def test_equal_overall_is_not_better_and_a_min_gain_is_at_least() -> None:
    verdict = gate(station("st-01", 20, 18, 18), station("st-02", 20, 18, 18))
    assert not verdict.blessed
    assert verdict.reason.startswith("not better overall")
    reports = (station("st-01", 20, 20, 18), station("st-02", 20, 18, 18))  # gain 0.05
    assert gate(*reports, policy=GatePolicy(min_overall_gain=0.05, min_examples=10)).blessed
    assert not gate(*reports, policy=GatePolicy(min_overall_gain=0.06, min_examples=10)).blessed


def test_stations_with_too_few_examples_are_listed_not_used() -> None:
    # st-02 is terrible but has 5 examples: listed with its reason, not in the verdict.
    verdict = gate(station("st-01", 20, 20, 15), station("st-02", 5, 0, 5))
    assert verdict.blessed
    st02 = verdict.stations[1]
    assert (st02.edge, st02.passed, st02.examples) == ("st-02", None, 5)
    assert "too few examples (5 < 10)" in st02.reason
    assert verdict.overall.examples == 20
    # Every station too small: not blessed, each named.
    verdict = gate(station("st-01", 4, 4, 0), station("st-02", 5, 5, 0))
    assert not verdict.blessed
    assert "no station has enough" in verdict.reason and "st-01" in verdict.reason


def test_failed_and_missing_stations_are_listed_with_their_reason() -> None:
    failed = StationReport("st-02", SERV, "failed", "no_holdout: no held-out labelled images")
    missing = StationReport("st-03", SERV, "missing", "did not answer in time")
    ok = station("st-01", 20, 20, 15)
    verdict = judge(CAND, [ok[0], failed, missing], ok[1], POLICY, ("scratch",))
    assert verdict.blessed
    reasons = {s.edge: s.reason for s in verdict.stations}
    assert (
        reasons["st-02"] == "evaluation failed: no_holdout: no held-out labelled images: not used"
    )
    assert reasons["st-03"] == "did not answer in time: not used"


def test_the_managers_labels_decide_not_the_stations() -> None:
    report, labels = station("st-01", 20, 20, 10)
    # The manager relabelled two images: the candidate is now wrong on them.
    flipped = dict(labels)
    for pid in ("p-st-01-000", "p-st-01-002"):
        flipped[pid] = "scratch"
    del flipped["p-st-01-019"]  # and has no label for one: left out, counted
    verdict = judge(CAND, [report], flipped, POLICY, ("scratch",))
    (st01,) = verdict.stations
    assert st01.examples == 19
    assert st01.unlabelled == 1
    assert st01.label_disagreements == 2
    assert st01.candidate_accuracy == pytest.approx(17 / 19)


def test_with_no_serving_model_anywhere_the_candidate_must_beat_the_majority_class() -> None:
    # 10 clean + 10 scratch per station: the constant classifier gets 0.5.
    good = gate(
        station("st-01", 20, 18, 0, serving=None), station("st-02", 20, 17, 0, serving=None)
    )
    assert good.blessed, good.reason
    assert good.stations[0].reference == "majority class 'clean'"
    assert good.overall.serving_accuracy == pytest.approx(0.5)
    # A broken first model (always "clean") is only as good as the constant: refused.
    broken_items = []
    labels = {}
    for i in range(20):
        pid, label = f"p-{i}", "clean" if i % 2 == 0 else "scratch"
        labels[pid] = label
        broken_items.append(Scored(pid, CAND, label, _scores("clean")))
    broken = StationReport("st-01", None, "done", items=tuple(broken_items))
    verdict = judge(CAND, [broken], labels, POLICY, ("scratch",))
    assert not verdict.blessed and verdict.reason.startswith("not better overall")


def test_recommended_thresholds_reach_the_target_recall() -> None:
    scratch_scores = [0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
    examples = [({"clean": 1 - s, "scratch": s}, "scratch") for s in scratch_scores]
    examples += [({"clean": 0.99, "scratch": 0.01}, "clean")] * 5
    recommended, basis = recommend_thresholds(examples, ("scratch",), 0.8)
    assert recommended == {"default_threshold": 0.3, "class_thresholds": {"scratch": 0.3}}
    assert basis["positives"] == {"scratch": 10} and basis["recall"] == {"scratch": 0.8}
    recommended, _ = recommend_thresholds(examples, ("scratch",), 1.0)
    assert recommended is not None and recommended["default_threshold"] == 0.1
    # No positive label among the held-out images: nothing to recommend.
    assert recommend_thresholds(examples[-5:], ("scratch",), 0.95)[0] is None
    assert recommend_thresholds(examples, (), 0.95)[0] is None


def test_the_verdict_carries_recommended_thresholds_under_the_agreed_key() -> None:
    verdict = gate(station("st-01", 20, 20, 15), station("st-02", 20, 20, 15))
    evidence = verdict.evidence()
    assert evidence["recommended_thresholds"] == {
        "default_threshold": 0.8,
        "class_thresholds": {"scratch": 0.8},
    }
    assert evidence["threshold_basis"]["target_recall"] == 0.95


def test_ties_and_policy_bounds() -> None:
    assert top_class({"b": 0.5, "a": 0.5}) == "a"
    for bad in (
        {"max_station_drop": -0.1},
        {"min_overall_gain": 1.5},
        {"min_examples": 0},
        {"target_recall": 0.0},
        {"max_station_drop": float("nan")},
    ):
        with pytest.raises(GatePolicyError):
            GatePolicy(**bad)
