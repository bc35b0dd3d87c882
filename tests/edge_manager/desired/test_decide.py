"""Next desired documents: full copies with one change and the version bumped."""

import dataclasses

import pytest

from fedge.edge_manager.desired.decide import next_config, next_deployment
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ValidationError
from fedge.protocols.freshness import LIFETIME_S

CURRENT = EdgeConfig(
    fleet="plant-a",
    edge="st-01",
    version=3,
    default_threshold=0.5,
    class_thresholds={"scratch": 0.6},
    report_interval_s=2.0,
    batch_max_records=100,
    issued_at=10.0,
)


def test_first_config_is_version_one() -> None:
    config = next_config(None, fleet="plant-a", edge="st-01", now=5.0, threshold=0.7)
    assert config == EdgeConfig(
        "plant-a", "st-01", 1, default_threshold=0.7, issued_at=5.0, expires_at=5.0 + LIFETIME_S
    )


def test_first_config_without_a_change_is_the_default_document() -> None:
    config = next_config(None, fleet="plant-a", edge="st-01", now=5.0)
    assert config == EdgeConfig("plant-a", "st-01", 1, issued_at=5.0, expires_at=5.0 + LIFETIME_S)


def test_next_config_bumps_the_version_and_keeps_every_other_field() -> None:
    config = next_config(CURRENT, fleet="plant-a", edge="st-01", now=20.0, threshold=0.72)
    assert config == dataclasses.replace(
        CURRENT, version=4, default_threshold=0.72, issued_at=20.0, expires_at=20.0 + LIFETIME_S
    )


def test_next_config_without_a_change_still_bumps_the_version() -> None:
    config = next_config(CURRENT, fleet="plant-a", edge="st-01", now=20.0)
    # Signed with a whole lifetime ahead (freshness.py), whatever the current one had.
    assert config == dataclasses.replace(
        CURRENT, version=4, issued_at=20.0, expires_at=20.0 + LIFETIME_S
    )


def test_per_class_threshold_adds_that_class_only() -> None:
    config = next_config(
        CURRENT, fleet="plant-a", edge="st-01", now=20.0, threshold=0.9, class_name="dent"
    )
    assert config.class_thresholds == {"scratch": 0.6, "dent": 0.9}
    assert config.default_threshold == CURRENT.default_threshold
    assert config.version == 4
    assert (config.report_interval_s, config.batch_max_records) == (2.0, 100)


def test_per_class_threshold_replaces_that_class() -> None:
    config = next_config(
        CURRENT, fleet="plant-a", edge="st-01", now=20.0, threshold=0.3, class_name="scratch"
    )
    assert config.class_thresholds == {"scratch": 0.3}
    assert config.threshold_for("scratch") == 0.3
    assert config.threshold_for("dent") == 0.5


def test_next_config_does_not_touch_the_current_document() -> None:
    next_config(CURRENT, fleet="plant-a", edge="st-01", now=20.0, threshold=0.1, class_name="x")
    assert CURRENT.class_thresholds == {"scratch": 0.6}
    assert CURRENT.version == 3


@pytest.mark.parametrize("threshold", [-0.1, 1.5, float("nan")])
def test_out_of_range_threshold_is_refused(threshold: float) -> None:
    with pytest.raises(ValidationError):
        next_config(CURRENT, fleet="plant-a", edge="st-01", now=1.0, threshold=threshold)
    with pytest.raises(ValidationError):
        next_config(
            CURRENT,
            fleet="plant-a",
            edge="st-01",
            now=1.0,
            threshold=threshold,
            class_name="scratch",
        )


def test_bad_class_name_is_refused() -> None:
    with pytest.raises(ValidationError):
        next_config(
            CURRENT, fleet="plant-a", edge="st-01", now=1.0, threshold=0.5, class_name="a/b"
        )


@pytest.mark.parametrize(("current", "expected"), [(None, 1), (1, 2), (41, 42)])
def test_next_deployment_bumps_the_version(current: int | None, expected: int) -> None:
    desired = next_deployment(
        current,
        fleet="plant-a",
        edge="st-01",
        deployment_id="d-1",
        manifest_envelope="{}",
        grpc_target="127.0.0.1:1",
        now=3.0,
    )
    assert desired.version == expected
    assert (desired.fleet, desired.edge, desired.deployment_id) == ("plant-a", "st-01", "d-1")
    assert (desired.manifest_envelope, desired.grpc_target, desired.issued_at) == (
        "{}",
        "127.0.0.1:1",
        3.0,
    )
