"""``fedge bench fleet-round`` at a small size: both sides run, on the same polling.

Real processes: a broker, ``manager serve``, agents with their SuperNodes, the fleet's
SuperLink, then plain ``flower-supernode`` processes with Flower's ``FedAvg.start``.
"""

import pytest

from fedge.bench.fleet_round import TARGET_RATIO, run_fleet_round
from fedge.bench.fleet_round_apps import POLL_S


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_both_sides_run_a_round_on_the_same_polling() -> None:
    data = run_fleet_round(agents=2, rounds=1, images=40)
    assert data["seconds_per_round"] > 0 and data["flower_seconds_per_round"] > 0
    assert data["ratio"] == data["seconds_per_round"] / data["flower_seconds_per_round"]
    assert data["met_target"] is (data["ratio"] <= TARGET_RATIO)
    # Flower's side no longer sleeps 3 s between pulls: both poll at most every 10 ms.
    assert data["polling"]["flower_s"] == POLL_S == data["polling"]["fedge_s"] == 0.01
    assert 0.0 <= data["accuracy_after"] <= 1.0 and 0.0 <= data["flower_accuracy_after"] <= 1.0
    assert len(data["per_station"]) == 2  # every station reported its accuracy
