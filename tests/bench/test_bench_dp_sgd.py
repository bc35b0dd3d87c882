"""``fedge bench dp-sgd`` at small size: both federations run and the JSON says what it measured."""

import pytest

from fedge.bench.dp_sgd import run_dp_sgd

pytestmark = pytest.mark.integration  # trains the inspection CNN for a few seconds


def test_the_bench_trains_both_sides_and_reports_the_ratio_and_the_drop() -> None:
    lines: list[str] = []
    result = run_dp_sgd(stations=2, images=32, rounds=2, epsilon=8.0, progress=lines.append)
    assert result["clipping_engine"] == "book-keeping"
    for side in ("no_dp", "dp_sgd"):
        assert len(result[side]["accuracy_per_round"]) == 2
        assert 0.0 <= result[side]["final_accuracy"] <= 1.0
        assert result[side]["round_s"] > 0
    assert result["no_dp"]["epsilon_spent_max_station"] == 0.0
    # Planned for the job's 2 rounds: every station spends its target, never more.
    assert 7.0 < result["dp_sgd"]["epsilon_spent_max_station"] <= 8.0 + 1e-6
    drop = (result["no_dp"]["final_accuracy"] - result["dp_sgd"]["final_accuracy"]) * 100
    assert result["final_accuracy_drop_points"] == pytest.approx(drop)
    ratio = result["dp_sgd"]["round_s"] / result["no_dp"]["round_s"]
    assert result["round_time_ratio"] == pytest.approx(ratio)
    assert result["met_target"] == (drop <= 3.0 and ratio <= 2.0)
    assert result["machine"]["cpu_count"] >= 1
    assert len(lines) == 4  # one progress line a round and side
