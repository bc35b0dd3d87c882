"""A station's anomaly threshold travels in its signed config like its other thresholds."""

from pathlib import Path

import pytest
from conftest import make_fleet_home

from fedge.edge_manager.desired.decide import next_config
from fedge.edge_manager.errors import ManagerError
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ProtocolError, ValidationError


def test_next_config_sets_keeps_and_clears_the_anomaly_threshold() -> None:
    first = next_config(None, fleet="plant-a", edge="st-01", now=1.0, anomaly_threshold=14.2)
    assert first.anomaly_threshold == 14.2
    kept = next_config(first, fleet="plant-a", edge="st-01", now=2.0, threshold=0.7)
    assert kept.anomaly_threshold == 14.2 and kept.default_threshold == 0.7
    cleared = next_config(kept, fleet="plant-a", edge="st-01", now=3.0, clear_anomaly=True)
    assert cleared.anomaly_threshold is None and cleared.version == 3


def test_the_anomaly_threshold_is_a_positive_distance_and_absent_while_unset() -> None:
    config = EdgeConfig(fleet="plant-a", edge="st-01", version=1, anomaly_threshold=31.5)
    assert codec.decode(codec.encode(config), EdgeConfig) == config
    assert b"anomaly_threshold" not in codec.encode(
        EdgeConfig(fleet="plant-a", edge="st-01", version=1)
    )
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ProtocolError, match="anomaly_threshold"):
            EdgeConfig(fleet="plant-a", edge="st-01", version=1, anomaly_threshold=bad)


def test_the_manager_pushes_it_signed_per_edge(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path / "fleet", edges=("st-01", "st-02"))
    try:
        with fh.fleet() as fleet:
            (pushed,) = fleet.set_anomaly_threshold(["st-01"], 14.2)
            assert fleet.desired_config("st-01").anomaly_threshold == 14.2  # type: ignore[union-attr]
            assert fleet.desired_config("st-02") is None
            with pytest.raises(ManagerError, match="anomaly threshold for st-02"):
                fleet.set_anomaly_threshold(["st-02"], -3.0)
            assert fleet.desired_config("st-02") is None  # nothing changed
            fleet.set_anomaly_threshold(["st-01"], None)
            assert fleet.desired_config("st-01").anomaly_threshold is None  # type: ignore[union-attr]
            assert pushed.version == 1
    finally:
        fh.close()


def test_a_threshold_tied_to_an_anomaly_model_applies_to_that_model_only() -> None:
    tied = EdgeConfig("plant-a", "st-01", 3, anomaly_threshold=9.5, anomaly_threshold_model="a:2")
    assert tied.anomaly_threshold_for("a:2") == 9.5 and tied.anomaly_threshold_for("a:3") is None
    loose = EdgeConfig("plant-a", "st-01", 3, anomaly_threshold=9.5)
    assert loose.anomaly_threshold_for("a:3") == 9.5  # set before any model: whichever serves
    assert codec.decode(codec.encode(tied), EdgeConfig) == tied
    assert b"anomaly_threshold_model" not in codec.encode(loose)  # omitted while unset
    with pytest.raises(ValidationError, match="without an anomaly_threshold"):
        EdgeConfig("plant-a", "st-01", 3, anomaly_threshold_model="a:2")
    cleared = next_config(tied, fleet="plant-a", edge="st-01", now=1.0, clear_anomaly=True)
    assert (cleared.anomaly_threshold, cleared.anomaly_threshold_model) == (None, None)
    kept = next_config(tied, fleet="plant-a", edge="st-01", now=1.0, threshold=0.6)
    assert (kept.anomaly_threshold, kept.anomaly_threshold_model) == (9.5, "a:2")
