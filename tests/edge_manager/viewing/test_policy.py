"""The manager's decision to ask a station for an image, and the desired config's switch."""

import pytest

from fedge.edge_manager.desired.decide import next_config
from fedge.edge_manager.viewing.policy import NotAsked, ViewFacts, allows_viewing, decide
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig

ON = EdgeConfig(fleet="f", edge="st-01", version=2, operator_viewing=True)
ASK = ViewFacts(
    edge_enrolled=True, scored_by="st-01", edge="st-01", desired=ON, images_at="10.0.0.21:8471"
)


def facts(**change: object) -> ViewFacts:
    return ViewFacts(**{**ASK.__dict__, **change})


def test_asks_when_the_stations_policy_allows_and_it_states_an_address() -> None:
    assert decide(ASK) is None


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"edge_enrolled": False}, NotAsked.UNKNOWN_EDGE),
        ({"scored_by": None}, NotAsked.UNKNOWN_PREDICTION),
        ({"scored_by": "st-02"}, NotAsked.UNKNOWN_PREDICTION),  # another station's
        ({"desired": None}, NotAsked.POLICY_OFF),
        ({"desired": EdgeConfig(fleet="f", edge="st-01", version=3)}, NotAsked.POLICY_OFF),
        ({"images_at": ""}, NotAsked.NO_ENDPOINT),
    ],
)
def test_does_not_ask_otherwise(change: dict[str, object], why: NotAsked) -> None:
    assert decide(facts(**change)) is why


def test_the_switch_is_a_new_signed_version_off_by_default() -> None:
    first = next_config(None, fleet="f", edge="st-01", now=1.0, threshold=0.7)
    assert not allows_viewing(first)
    assert b"operator_viewing" not in codec.encode(first)  # off: the field left out
    allowed = next_config(first, fleet="f", edge="st-01", now=2.0, viewing=True)
    assert allowed.version == 2 and allows_viewing(allowed)
    assert allowed.default_threshold == 0.7
    kept = next_config(allowed, fleet="f", edge="st-01", now=3.0, threshold=0.6)
    assert allows_viewing(kept)  # another change keeps the choice
    denied = next_config(kept, fleet="f", edge="st-01", now=4.0, viewing=False)
    assert not allows_viewing(denied) and denied.operator_viewing is None
    assert codec.decode(codec.encode(allowed), EdgeConfig) == allowed
