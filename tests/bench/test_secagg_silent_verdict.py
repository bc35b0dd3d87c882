"""The silent-dropout round's verdict and bound (pure; the round itself runs in
tests/aggregator/privacy/test_secagg_silent_dropout.py)."""

from __future__ import annotations

from typing import Any

import pytest

from fedge.bench.secagg_silent import (
    DROPPED,
    KEY_STAGE_MARGIN,
    KEY_STAGE_SLACK_S,
    SilentSettings,
    round_bound_s,
    silent_verdict,
)

SETTINGS = SilentSettings(parties=4, params=100, collect_timeout_s=30.0)
CLEAN_STAGES = {"setup": 3.0, "share_keys": 3.0, "collect_masked_vectors": 4.0, "unmask": 2.0}


def _result(**changes: Any) -> dict[str, Any]:
    result: dict[str, Any] = {
        "clean_round_s": 12.0,
        "silent_round_s": 39.0,
        "clean_stages_s": CLEAN_STAGES,
        "silent_stages_s": {**CLEAN_STAGES, "collect_masked_vectors": 30.2},
        "max_abs_error": 1e-6,
        "error_bound": 1e-5,
        "on_time": [0, 2, 3],
        "late": [],
        "failed": [DROPPED],
        "failures": {
            str(DROPPED): "SecAgg+ collect_masked_vectors stage: no answer within 30.0 s "
            "(waited 30.2 s)"
        },
        "killed": True,
    }
    result.update(changes)
    return result


def test_the_bound_is_the_stage_limit_plus_the_other_stages_with_a_margin() -> None:
    expected = 30.0 + KEY_STAGE_MARGIN * (3.0 + 3.0 + 2.0) + KEY_STAGE_SLACK_S
    assert round_bound_s(CLEAN_STAGES, 30.0) == pytest.approx(expected)


def test_a_round_that_ended_on_our_timeout_survived() -> None:
    figures = silent_verdict(_result(), SETTINGS)
    assert figures["silent_dropouts_survived"] == 1
    assert figures["silent_ratio"] == pytest.approx(39.0 / 12.0, abs=1e-3)
    assert figures["silent_collect_waited_s"] == pytest.approx(30.2)
    assert figures["silent_round_bound_s"] == pytest.approx(round_bound_s(CLEAN_STAGES, 30.0))


@pytest.mark.parametrize(
    "changes",
    [
        # Flower's heartbeat expiry, not our clock, ended the wait.
        {"failures": {str(DROPPED): "SecAgg+ collect_masked_vectors stage: node_unavail"}},
        {"killed": False},
        {"failed": [], "on_time": [0, 1, 2, 3]},
        {"on_time": [0, 2]},
        {"max_abs_error": 1e-4},
        {"silent_round_s": 1000.0},
    ],
)
def test_anything_else_did_not_survive(changes: dict[str, Any]) -> None:
    assert silent_verdict(_result(**changes), SETTINGS)["silent_dropouts_survived"] == 0


def test_settings_refuse_a_round_that_cannot_lose_a_node() -> None:
    with pytest.raises(ValueError, match=">= 4"):
        SilentSettings(parties=3)
    with pytest.raises(ValueError, match="collect_timeout_s"):
        SilentSettings(collect_timeout_s=90.0, key_stage_timeout_s=60.0)
