"""The agent's pure decisions: whether to apply a config, and what a score means."""

from typing import Any

import pytest

from fedge.edge_agent.config.decisions import ConfigAction, Decision, decide, decide_config
from fedge.protocols.config import EdgeConfig


def _config(version: int = 1, edge: str = "st-01", fleet: str = "plant-a", **kw: Any) -> EdgeConfig:
    return EdgeConfig(fleet, edge, version, **kw)


# ---------------------------------------------------------------- decide_config


def test_first_config_is_applied() -> None:
    decision = decide_config(None, _config(1), "plant-a", "st-01")
    assert decision.action is ConfigAction.APPLY
    assert decision.reason == ""


def test_newer_config_is_applied() -> None:
    assert decide_config(_config(3), _config(4), "plant-a", "st-01").action is ConfigAction.APPLY
    assert decide_config(_config(3), _config(9), "plant-a", "st-01").action is ConfigAction.APPLY


@pytest.mark.parametrize("offered", [1, 3])
def test_same_or_older_config_is_ignored(offered: int) -> None:
    decision = decide_config(_config(3), _config(offered), "plant-a", "st-01")
    assert decision.action is ConfigAction.IGNORE
    assert str(offered) in decision.reason


@pytest.mark.parametrize(
    "offered",
    [_config(5, edge="st-02"), _config(5, fleet="plant-b")],
    ids=["other-edge", "other-fleet"],
)
def test_config_for_someone_else_is_rejected(offered: EdgeConfig) -> None:
    decision = decide_config(_config(3), offered, "plant-a", "st-01")
    assert decision.action is ConfigAction.REJECT
    assert "plant-a/st-01" in decision.reason


def test_config_for_someone_else_is_rejected_even_before_any_config() -> None:
    decision = decide_config(None, _config(1, edge="st-02"), "plant-a", "st-01")
    assert decision.action is ConfigAction.REJECT


def test_stale_config_for_someone_else_is_rejected_not_ignored() -> None:
    decision = decide_config(_config(3), _config(1, edge="st-02"), "plant-a", "st-01")
    assert decision.action is ConfigAction.REJECT


# ---------------------------------------------------------------- decide


def test_without_config_the_default_threshold_decides() -> None:
    assert decide({"clean": 0.4, "scratch": 0.6}, ("scratch",), None) == Decision(
        "reject", 0.5, "scratch"
    )
    assert decide({"clean": 0.6, "scratch": 0.4}, ("scratch",), None) == Decision(
        "accept", 0.5, "scratch"
    )


def test_default_threshold_argument_is_used_without_config() -> None:
    assert decide({"clean": 0.4, "scratch": 0.6}, ("scratch",), None, 0.7).decision == "accept"


def test_config_default_threshold_decides() -> None:
    config = _config(default_threshold=0.72)
    assert decide({"clean": 0.3, "scratch": 0.7}, ("scratch",), config) == Decision(
        "accept", 0.72, "scratch"
    )
    assert decide({"clean": 0.2, "scratch": 0.8}, ("scratch",), config) == Decision(
        "reject", 0.72, "scratch"
    )


def test_score_equal_to_the_threshold_rejects() -> None:
    config = _config(default_threshold=0.25)
    assert decide({"clean": 0.75, "scratch": 0.25}, ("scratch",), config).decision == "reject"
    per_class = _config(class_thresholds={"scratch": 0.5})
    assert decide({"clean": 0.5, "scratch": 0.5}, ("scratch",), per_class).decision == "reject"


def test_per_class_threshold_overrides_the_default() -> None:
    config = _config(default_threshold=0.9, class_thresholds={"dent": 0.2})
    scores = {"clean": 0.5, "scratch": 0.25, "dent": 0.25}
    # scratch scores as high as dent but only dent's own threshold is low enough.
    assert decide(scores, ("scratch", "dent"), config) == Decision("reject", 0.2, "dent")


def test_first_defect_over_its_threshold_decides_even_if_not_the_highest() -> None:
    config = _config(class_thresholds={"scratch": 0.6, "dent": 0.25})
    scores = {"clean": 0.2, "scratch": 0.5, "dent": 0.3}
    assert decide(scores, ("scratch", "dent"), config) == Decision("reject", 0.25, "dent")


def test_accept_records_the_threshold_of_the_highest_scoring_defect() -> None:
    config = _config(default_threshold=0.5, class_thresholds={"scratch": 0.8, "dent": 0.4})
    scores = {"clean": 0.3, "scratch": 0.45, "dent": 0.25}
    assert decide(scores, ("scratch", "dent"), config) == Decision("accept", 0.8, "scratch")


def test_non_positive_classes_never_reject() -> None:
    config = _config(default_threshold=0.1)
    assert decide({"clean": 0.95, "scratch": 0.05}, ("scratch",), config) == Decision(
        "accept", 0.1, "scratch"
    )


def test_without_declared_positives_every_class_but_the_first_is_a_defect() -> None:
    scores = {"ok": 0.2, "scratch": 0.3, "dent": 0.5}
    assert decide(scores, (), None) == Decision("reject", 0.5, "dent")
    assert decide({"ok": 0.7, "scratch": 0.2, "dent": 0.1}, (), None) == Decision(
        "accept", 0.5, "scratch"
    )


def test_single_class_model_without_positives_always_accepts() -> None:
    config = _config(default_threshold=0.3)
    assert decide({"ok": 1.0}, (), config) == Decision("accept", 0.3, "")
    assert decide({"ok": 1.0}, (), None) == Decision("accept", 0.5, "")


def test_positive_classes_missing_from_the_scores_are_ignored() -> None:
    assert decide({"clean": 0.1, "scratch": 0.9}, ("crack",), None) == Decision("accept", 0.5, "")
    assert decide({"clean": 0.1, "scratch": 0.9}, ("crack", "scratch"), None).decision == "reject"


def test_a_config_a_local_rollback_replaced_is_not_applied_again() -> None:
    # The agent rolled back to v3's model and config; the retained v4 comes again.
    decision = decide_config(_config(3), _config(4), "plant-a", "st-01", done_version=4)
    assert decision.action is ConfigAction.IGNORE and "rolled back" in decision.reason
    assert decide_config(_config(3), _config(5), "plant-a", "st-01", 4).action is (
        ConfigAction.APPLY
    )
