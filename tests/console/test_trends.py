"""The edge page's trend series from monitor windows and labels (console/trends.py)."""

from fedge.console.trends import trends
from fedge.console.trends_store import LabelledAt, TrendWindow


def _window(model: str, start: float, end: float, rejects: int | None) -> TrendWindow:
    return TrendWindow(model, start, end, 100, rejects, 0.9, 0.1, None)


def test_one_point_per_window_with_agreement_from_the_labels_inside_it() -> None:
    windows = [
        _window("inspect:1", 0.0, 10.0, 10),
        _window("inspect:1", 11.0, 20.0, 40),
        _window("inspect:2", 21.0, 30.0, None),  # recorded before rejects were kept
    ]
    labelled = [
        LabelledAt("inspect:1", 5.0, "reject", "scratch"),  # agrees
        LabelledAt("inspect:1", 6.0, "accept", "scratch"),  # does not
        LabelledAt("inspect:1", 15.0, "accept", "clean"),  # agrees
        LabelledAt("inspect:2", 15.0, "accept", "scratch"),  # another model: not window 2's
    ]
    defects = {"inspect:1": frozenset({"scratch"}), "inspect:2": frozenset({"scratch"})}
    shown = trends("st-01", windows, labelled, defects, drift_alert=0.25)
    assert shown.at == (10.0, 20.0, 30.0)
    assert shown.reject_rate == (0.1, 0.4, None)
    assert shown.agreement == (0.5, 1.0, None)
    assert shown.labelled == (2, 1, 0)
    assert shown.estimated_accuracy == (0.9, 0.9, 0.9)
    assert shown.input_drift == (0.1, 0.1, 0.1) and shown.score_drift == (None, None, None)
    plain = shown.to_plain()
    assert len({len(v) for v in plain.values() if isinstance(v, list)}) == 1
    assert plain["drift_alert"] == 0.25 and not shown.empty


def test_no_window_is_an_empty_trend() -> None:
    shown = trends("st-01", [], [], {})
    assert shown.empty and shown.to_plain()["at"] == []
