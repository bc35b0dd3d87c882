"""MQTT topic layout: builders, parse, subscriptions, and the topics parse must refuse."""

import pytest

from fedge.protocols import topics
from fedge.protocols.errors import DecodeError, ValidationError
from fedge.protocols.topics import Direction, Down, EdgeTopic, Up

FLEET = "plant-a"
EDGE = "edge-01"


def test_root() -> None:
    assert topics.ROOT == "fedge/v1"
    assert topics.edge_root(FLEET, EDGE) == "fedge/v1/plant-a/edge-01"


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (Down.CONFIG, "fedge/v1/plant-a/edge-01/down/config"),
        (Down.DEPLOY, "fedge/v1/plant-a/edge-01/down/deploy"),
        (Down.EVALUATE, "fedge/v1/plant-a/edge-01/down/evaluate"),
    ],
)
def test_down_layout(kind: Down, expected: str) -> None:
    assert topics.down(FLEET, EDGE, kind) == expected


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (Up.STATE, "fedge/v1/plant-a/edge-01/up/state"),
        (Up.CONFIG, "fedge/v1/plant-a/edge-01/up/config"),
        (Up.DEPLOY, "fedge/v1/plant-a/edge-01/up/deploy"),
        (Up.TELEMETRY, "fedge/v1/plant-a/edge-01/up/telemetry"),
        (Up.PREDICTIONS, "fedge/v1/plant-a/edge-01/up/predictions"),
        (Up.LABELS, "fedge/v1/plant-a/edge-01/up/labels"),
        (Up.EVALUATE, "fedge/v1/plant-a/edge-01/up/evaluate"),
        (Up.TRUST, "fedge/v1/plant-a/edge-01/up/trust"),
    ],
)
def test_up_layout(kind: Up, expected: str) -> None:
    assert topics.up(FLEET, EDGE, kind) == expected


def test_documented_kinds_are_exactly_these() -> None:
    assert {k.value for k in Down} == {
        "trust",
        "config",
        "deploy",
        "labels",
        "evaluate",
        "pace",
    }
    assert {k.value for k in Up} == {
        "state",
        "config",
        "deploy",
        "telemetry",
        "predictions",
        "labels",
        "evaluate",
        "trust",
        "thumbnails",
    }
    assert {d.value for d in Direction} == {"down", "up"}


@pytest.mark.parametrize("kind", list(Down))
def test_parse_round_trips_down(kind: Down) -> None:
    parsed = topics.parse(topics.down(FLEET, EDGE, kind))
    assert parsed == EdgeTopic(FLEET, EDGE, Direction.DOWN, kind.value)
    assert parsed.direction is Direction.DOWN
    assert topics.down(parsed.fleet, parsed.edge, Down(parsed.kind)) == topics.down(
        FLEET, EDGE, kind
    )


@pytest.mark.parametrize("kind", list(Up))
def test_parse_round_trips_up(kind: Up) -> None:
    parsed = topics.parse(topics.up(FLEET, EDGE, kind))
    assert parsed == EdgeTopic(FLEET, EDGE, Direction.UP, kind.value)
    assert parsed.direction is Direction.UP
    assert topics.up(parsed.fleet, parsed.edge, Up(parsed.kind)) == topics.up(FLEET, EDGE, kind)


@pytest.mark.parametrize(
    ("fleet", "edge"),
    [("a", "b"), ("F1", "e_1.x-y"), ("0" * 64, "z" * 64)],
)
def test_parse_accepts_every_valid_identifier_shape(fleet: str, edge: str) -> None:
    parsed = topics.parse(topics.up(fleet, edge, Up.TELEMETRY))
    assert (parsed.fleet, parsed.edge) == (fleet, edge)


@pytest.mark.parametrize(
    "topic",
    [
        pytest.param("fedge/v2/plant-a/edge-01/up/state", id="wrong_version"),
        pytest.param("other/v1/plant-a/edge-01/up/state", id="wrong_root"),
        pytest.param("Fedge/v1/plant-a/edge-01/up/state", id="root_case"),
        pytest.param("/fedge/v1/plant-a/edge-01/up/state", id="leading_slash"),
        pytest.param("fedge/v1/plant-a/edge-01/up/state/", id="trailing_slash"),
        pytest.param("fedge/v1/plant-a/edge-01/up", id="too_short"),
        pytest.param("fedge/v1/plant-a/edge-01/up/state/extra", id="too_long"),
        pytest.param("fedge/v1/plant-a/up/state", id="missing_edge"),
        pytest.param("fedge/v1", id="root_only"),
        pytest.param("", id="empty"),
        pytest.param("fedge/v1/plant-a/edge-01/up/weather", id="unknown_up_kind"),
        pytest.param("fedge/v1/plant-a/edge-01/down/state", id="up_kind_on_down"),
        pytest.param("fedge/v1/plant-a/edge-01/down/telemetry", id="stream_on_down"),
        pytest.param("fedge/v1/plant-a/edge-01/up/State", id="kind_case"),
        pytest.param("fedge/v1/plant-a/edge-01/up/+", id="wildcard_kind"),
        pytest.param("fedge/v1/plant-a/+/up/state", id="plus_in_edge"),
        pytest.param("fedge/v1/plant-a/#/up/state", id="hash_in_edge"),
        pytest.param("fedge/v1/+/edge-01/up/state", id="plus_in_fleet"),
        pytest.param("fedge/v1/plant-a//up/state", id="empty_edge"),
        pytest.param("fedge/v1/plant-a/$SYS/up/state", id="dollar_edge"),
        pytest.param("fedge/v1/plant-a/edge-01/sideways/state", id="direction_sideways"),
        pytest.param("fedge/v1/plant-a/edge-01/UP/state", id="direction_case"),
        pytest.param("fedge/v1/plant-a/edge-01//state", id="empty_direction"),
    ],
)
def test_parse_rejects(topic: str) -> None:
    with pytest.raises(DecodeError) as excinfo:
        topics.parse(topic)
    assert type(excinfo.value) is DecodeError
    assert "topic" in str(excinfo.value)


def test_parse_error_names_the_bad_part() -> None:
    with pytest.raises(DecodeError, match="edge"):
        topics.parse("fedge/v1/plant-a/e+1/up/state")
    with pytest.raises(DecodeError, match="sideways"):
        topics.parse("fedge/v1/plant-a/edge-01/sideways/state")
    with pytest.raises(DecodeError, match="weather"):
        topics.parse("fedge/v1/plant-a/edge-01/up/weather")


def test_parse_error_truncates_a_huge_topic() -> None:
    with pytest.raises(DecodeError) as excinfo:
        topics.parse("x" * 100_000)
    assert len(str(excinfo.value)) < 300


def test_edge_subscription() -> None:
    assert topics.edge_subscription(FLEET, EDGE) == "fedge/v1/plant-a/edge-01/down/+"


def test_fleet_up_subscription() -> None:
    assert topics.fleet_up_subscription(FLEET) == "fedge/v1/plant-a/+/up/+"


def _matches(subscription: str, topic: str) -> bool:
    """MQTT matching for '+' (enough for these subscriptions, which use no '#')."""
    sub, top = subscription.split("/"), topic.split("/")
    return len(sub) == len(top) and all(s in ("+", t) for s, t in zip(sub, top, strict=True))


def test_subscriptions_cover_exactly_their_direction() -> None:
    edge_sub = topics.edge_subscription(FLEET, EDGE)
    fleet_sub = topics.fleet_up_subscription(FLEET)
    for kind in Down:
        topic = topics.down(FLEET, EDGE, kind)
        assert _matches(edge_sub, topic)
        assert not _matches(fleet_sub, topic)
        assert not _matches(topics.edge_subscription(FLEET, "edge-02"), topic)
        assert not _matches(topics.edge_subscription("plant-b", EDGE), topic)
    for up_kind in Up:
        topic = topics.up(FLEET, EDGE, up_kind)
        assert _matches(fleet_sub, topic)
        assert _matches(fleet_sub, topics.up(FLEET, "edge-99", up_kind))
        assert not _matches(edge_sub, topic)
        assert not _matches(topics.fleet_up_subscription("plant-b"), topic)


@pytest.mark.parametrize("bad", ["a/b", "+", "#", "", "$SYS", "e 1", "x" * 65, ".e"])
def test_builders_refuse_bad_identifiers(bad: str) -> None:
    with pytest.raises(ValidationError):
        topics.edge_root(FLEET, bad)
    with pytest.raises(ValidationError):
        topics.edge_root(bad, EDGE)
    with pytest.raises(ValidationError):
        topics.up(FLEET, bad, Up.STATE)
    with pytest.raises(ValidationError):
        topics.down(bad, EDGE, Down.CONFIG)
    with pytest.raises(ValidationError):
        topics.edge_subscription(FLEET, bad)
    with pytest.raises(ValidationError):
        topics.fleet_up_subscription(bad)


def test_bug_parse_accepts_edge_with_trailing_newline() -> None:
    with pytest.raises(DecodeError):
        topics.parse("fedge/v1/plant-a/edge-01\n/up/state")
