"""Which architecture a party trains and serves: its TiFL tier's (issue 32, item 7)."""

import pytest

from fedge.aggregator.tiers.architectures import (
    TierArchitectureError,
    architecture_of,
    assign,
    check_tier_archs,
    stations_by_architecture,
    tier_architecture,
)
from fedge.aggregator.tiers.groups import Tiers

ARCHS = ("cnn-large", "cnn-small")


def test_each_tier_gets_its_architecture_fastest_first() -> None:
    assert [tier_architecture(t, 2, ARCHS) for t in (0, 1)] == ["cnn-large", "cnn-small"]
    # Fewer tiers formed than planned (few parties): mapped proportionally.
    three = ("a", "b", "c")
    assert [tier_architecture(t, 2, three) for t in (0, 1)] == ["a", "b"]
    assert tier_architecture(0, 1, three) == "a"
    with pytest.raises(TierArchitectureError, match="tier 2 is not one of 2"):
        tier_architecture(2, 2, ARCHS)


def test_parties_follow_their_tier_and_dropouts_get_the_smallest() -> None:
    tiers = Tiers(members=((1000, 1001), (1002,)), dropouts=(1003,))
    assert architecture_of(1001, tiers, ARCHS, "cnn-large") == "cnn-large"
    assert architecture_of(1002, tiers, ARCHS, "cnn-large") == "cnn-small"
    assert architecture_of(1003, tiers, ARCHS, "cnn-large") == "cnn-small"
    assert architecture_of(1099, tiers, ARCHS, "cnn-large") == "cnn-large"  # joined since
    # Before tiers exist (profiling): everyone the largest.
    assert architecture_of(1002, None, ARCHS, "cnn-large") == "cnn-large"


def test_stations_are_grouped_by_architecture() -> None:
    tiers = Tiers(members=((1000, 1002), (1001,)))
    parties = {"st-01": 1000, "st-02": 1001, "st-03": 1002}
    assignment = assign(parties, tiers, ARCHS, "cnn-large")
    assert assignment == {"st-01": "cnn-large", "st-02": "cnn-small", "st-03": "cnn-large"}
    assert stations_by_architecture(assignment, ARCHS) == {
        "cnn-large": ("st-01", "st-03"),
        "cnn-small": ("st-02",),
    }


def test_a_tier_with_no_stations_is_an_error() -> None:
    assignment = {"st-01": "cnn-large", "st-02": "cnn-large"}
    with pytest.raises(TierArchitectureError, match="no station is in the tier of cnn-small"):
        stations_by_architecture(assignment, ARCHS)
    with pytest.raises(TierArchitectureError, match="not one of tier_archs"):
        stations_by_architecture({"st-01": "mlp"}, ARCHS)


@pytest.mark.parametrize(
    ("value", "tiers", "message"),
    [
        (None, 2, "needs one architecture per tier"),
        ([], 2, "non-empty list"),
        (["a", 3], 2, "non-empty list"),
        (["a", ""], 2, "non-empty list"),
        (["a"], 2, "2 tier\\(s\\), 1 architecture"),
    ],
)
def test_tier_archs_are_checked(value: object, tiers: int, message: str) -> None:
    with pytest.raises(TierArchitectureError, match=message):
        check_tier_archs(value, tiers)
    assert check_tier_archs(["a", "b"], 2) == ("a", "b")
