"""The DesiredPoller's decisions with a fake clock and an in-memory DesiredSync twin,
and the agent.toml settings that drive it."""

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fedge.edge_agent.errors import SettingsError
from fedge.edge_agent.settings import load_settings
from fedge.edge_agent.uplink.poller import (
    HEARTBEAT_S,
    MAX_PENDING,
    DesiredPoller,
    grpc_mode,
    queue_status,
)
from fedge.protocols.signing import SigningKey
from fedge.protocols.topics import Up
from fedge.transport.grpc.client import SyncError
from fedge.transport.grpc.contract import DesiredDocument, SinkResult, newer_than

BIRTH = b'{"birth": 1}'
REPORT = b'{"config report": 1}'


@dataclass
class Twin:
    """DesiredSync in memory: the manager's newest documents and the statuses it got."""

    latest: list[DesiredDocument] = field(default_factory=list)
    reports: list[tuple[str, bytes]] = field(default_factory=list)
    fetches: list[dict[str, int]] = field(default_factory=list)
    down: bool = False
    refuse: bool = False
    closed: bool = False

    def fetch(self, known: Mapping[str, int], timeout_s: float = 5.0) -> list[DesiredDocument]:
        if self.down:
            raise SyncError("manager down", "UNAVAILABLE")
        self.fetches.append(dict(known))
        return newer_than(self.latest, known)

    def report(self, kind: str, payload: bytes, timeout_s: float = 5.0) -> SinkResult:
        if self.down:
            raise SyncError("manager down", "UNAVAILABLE")
        if self.refuse:
            raise SyncError("too large", "INVALID_ARGUMENT")
        self.reports.append((kind, payload))
        return SinkResult(accepted=True)

    def close(self) -> None:
        self.closed = True


@dataclass
class Station:
    """The agent side: its MQTT link, what it has applied, what its handlers saw."""

    connected: bool = True
    known: dict[str, int] = field(default_factory=lambda: {"config": 0, "deploy": 0, "labels": 0})
    handled: list[tuple[str, bytes]] = field(default_factory=list)
    now: float = 1000.0
    # Runs while the statements are read: another thread of the agent, racing them.
    meanwhile: Callable[[], None] | None = None

    def statements(self) -> list[tuple[Up, bytes]]:
        if self.meanwhile is not None:
            self.meanwhile()
        return [(Up.STATE, BIRTH), (Up.CONFIG, REPORT)]

    def handler(self, kind: str) -> "Handler":
        return Handler(self, kind)


@dataclass
class Handler:
    station: Station
    kind: str

    def __call__(self, envelope: bytes) -> None:
        self.station.handled.append((self.kind, envelope))


def _poller(
    station: Station,
    twin: Twin,
    *,
    via_grpc: bool = False,
    fallback_after_s: float = 10.0,
    heartbeat_s: float = 30.0,
    poll_interval_s: float = 2.0,
) -> DesiredPoller:
    """A poller whose heartbeat (30 s here unless given) stays out of the way of the
    other statuses these tests follow."""
    return DesiredPoller(
        report_via_grpc=via_grpc,
        fallback_after_s=fallback_after_s,
        poll_interval_s=poll_interval_s,
        heartbeat_s=heartbeat_s,
        connect=lambda: twin,
        mqtt_connected=lambda: station.connected,
        known_versions=lambda: dict(station.known),
        handlers={kind: station.handler(kind) for kind in ("config", "deploy", "labels")},
        statements=station.statements,
        counters=Counter(),
        clock=lambda: station.now,
    )


def test_grpc_mode_decision() -> None:
    def mode(via: bool, connected: bool, down_for: float, after: float) -> bool:
        return grpc_mode(
            report_via_grpc=via, connected=connected, down_for_s=down_for, fallback_after_s=after
        )

    assert mode(True, True, 0, 60)  # report_via = "grpc": always
    assert not mode(False, True, 0, 60)
    assert not mode(False, False, 59.9, 60)
    assert mode(False, False, 60, 60)
    assert not mode(False, False, 1e9, 0)  # 0 = never fall back


def test_a_retained_status_replaces_its_pending_predecessor() -> None:
    pending = queue_status((), (Up.CONFIG, b"v1", True))
    pending = queue_status(pending, (Up.DEPLOY, b"refused", False))
    pending = queue_status(pending, (Up.CONFIG, b"v2", True))
    assert pending == ((Up.DEPLOY, b"refused", False), (Up.CONFIG, b"v2", True))


def test_the_pending_queue_is_bounded_by_dropping_old_unretained_reports() -> None:
    pending = queue_status((), (Up.CONFIG, b"kept", True))
    for i in range(MAX_PENDING + 5):
        pending = queue_status(pending, (Up.DEPLOY, str(i).encode(), False))
    assert len(pending) == MAX_PENDING
    assert pending[0] == (Up.CONFIG, b"kept", True)
    assert pending[-1] == (Up.DEPLOY, str(MAX_PENDING + 4).encode(), False)


def test_nothing_goes_over_grpc_while_mqtt_works() -> None:
    station, twin = Station(), Twin(latest=[DesiredDocument("config", 1, b"c1")])
    poller = _poller(station, twin)
    for _ in range(5):
        station.now += 30
        poller.tick()
    assert not poller.active and twin.fetches == [] and twin.reports == []


def test_mqtt_down_long_enough_polls_applies_and_restates() -> None:
    station = Station(connected=False)
    twin = Twin(latest=[DesiredDocument("config", 2, b"c2"), DesiredDocument("deploy", 1, b"d1")])
    poller = _poller(station, twin)
    station.now += 9.9
    poller.tick()
    assert not poller.active and twin.fetches == []
    station.now += 0.1
    poller.tick()
    assert poller.active
    assert station.handled == [("config", b"c2"), ("deploy", b"d1")]
    # Like a birth: the liveness and what is in force, before anything else.
    assert twin.reports == [("state", BIRTH), ("config", REPORT)]
    assert poller.counters["desired.grpc.config"] == 1


def test_polls_wait_for_the_interval_and_ask_with_what_the_agent_has() -> None:
    station, twin = Station(), Twin(latest=[DesiredDocument("config", 2, b"c2")])
    poller = _poller(station, twin, via_grpc=True)
    poller.tick()
    station.known["config"] = 2  # the handler applied it
    station.now += 1.0
    poller.tick()  # not due yet
    station.now += 1.0
    poller.tick()
    assert twin.fetches == [
        {"config": 0, "deploy": 0, "labels": 0},
        {"config": 2, "deploy": 0, "labels": 0},
    ]
    assert station.handled == [("config", b"c2")]
    # report_via = "grpc" with MQTT up: statuses stay on MQTT.
    assert twin.reports == []


def test_an_envelope_not_applied_is_handed_over_once() -> None:
    # A refused config (or a deployment still downloading) stays newer than what the agent
    # has, so every poll brings it back: the handler sees those bytes once.
    station, twin = Station(), Twin(latest=[DesiredDocument("config", 5, b"forged")])
    poller = _poller(station, twin, via_grpc=True)
    for _ in range(4):
        poller.tick()
        station.now += 2.0
    assert station.handled == [("config", b"forged")]
    twin.latest = [DesiredDocument("config", 6, b"real")]
    poller.tick()
    assert station.handled == [("config", b"forged"), ("config", b"real")]


def test_statuses_offered_while_mqtt_is_down_go_up_and_survive_a_manager_outage() -> None:
    station, twin = Station(connected=False), Twin()
    poller = _poller(station, twin, via_grpc=True)
    poller.tick()
    twin.reports.clear()
    twin.down = True
    poller.offer_status(Up.CONFIG, b"applied v3")
    poller.offer_status(Up.DEPLOY, b"refused", retained=False)
    station.now += 2.0
    poller.tick()
    assert poller.counters["desired.poll_failed"] == 1
    twin.down = False
    poller.offer_status(Up.CONFIG, b"applied v4")  # replaces v3, never sent
    station.now += 2.0
    poller.tick()
    assert twin.reports == [("deploy", b"refused"), ("config", b"applied v4")]


def test_a_restatement_never_replaces_a_status_offered_meanwhile() -> None:
    station, twin = Station(connected=False), Twin()
    poller = _poller(station, twin, via_grpc=True)
    # A config applied on another thread while the statements are read: the agent offers
    # its new report right after, racing the restatement.
    station.meanwhile = lambda: poller.offer_status(Up.CONFIG, b"applied v2")
    poller.tick()
    assert twin.reports == [("config", b"applied v2"), ("state", BIRTH)]


def test_a_refused_status_is_dropped_not_retried() -> None:
    station, twin = Station(connected=False), Twin(refuse=True)
    poller = _poller(station, twin, via_grpc=True)
    poller.tick()
    assert poller.counters["status.grpc_refused"] == 2  # the birth and the config report
    twin.refuse = False
    station.now += 2.0
    poller.tick()
    assert twin.reports == []


def test_liveness_is_repeated_as_a_heartbeat() -> None:
    station, twin = Station(connected=False), Twin()
    poller = _poller(station, twin, via_grpc=True, heartbeat_s=HEARTBEAT_S)
    poller.tick()
    twin.reports.clear()
    station.now += HEARTBEAT_S - 2.0
    poller.tick()
    assert twin.reports == []
    station.now += 2.0
    poller.tick()
    assert twin.reports == [("state", BIRTH)]


def test_mqtt_back_ends_the_fallback_and_its_pending_statuses() -> None:
    station, twin = Station(connected=False), Twin(down=True)
    poller = _poller(station, twin, fallback_after_s=1.0)
    station.now += 1.0
    poller.tick()
    assert poller.active
    station.connected = True
    poller.offer_status(Up.CONFIG, b"while reconnecting")
    station.now += 2.0
    twin.down = False
    poller.tick()
    assert not poller.active and twin.reports == []
    # Once back, MQTT must fail for the whole fallback time again.
    station.connected = False
    station.now += 0.5
    poller.tick()
    assert not poller.active


def test_farewell_goes_over_grpc_only_where_statuses_do() -> None:
    station, twin = Station(connected=False), Twin()
    poller = _poller(station, twin, via_grpc=True)
    poller.tick()
    poller.farewell(b"bye")
    assert twin.reports[-1] == ("state", b"bye")
    poller.close()
    assert twin.closed

    up_station, up_twin = Station(connected=True), Twin()
    up_poller = _poller(up_station, up_twin, via_grpc=True)
    up_poller.tick()
    up_poller.farewell(b"bye")
    assert up_twin.reports == []


def _agent_toml(path: Path, extra: str) -> Path:
    key = SigningKey.generate().public.to_text()
    path.write_text(
        'fleet = "plant-a"\nedge = "st-01"\ndata_dir = "data"\nbroker_host = "127.0.0.1"\n'
        'broker_port = 1883\ninsecure = true\npassword = "x"\ngrpc_target = "127.0.0.1:50551"\n'
        f'manager_public_key = "{key}"\n{extra}'
    )
    return path


def test_agent_toml_fallback_settings(tmp_path: Path) -> None:
    defaults = load_settings(_agent_toml(tmp_path / "a.toml", ""))
    assert (defaults.grpc_fallback_after_s, defaults.grpc_poll_interval_s) == (60.0, 5.0)
    tuned = load_settings(
        _agent_toml(tmp_path / "b.toml", "grpc_fallback_after_s = 0\ngrpc_poll_interval_s = 1\n")
    )
    assert (tuned.grpc_fallback_after_s, tuned.grpc_poll_interval_s) == (0, 1)
    for bad in ("grpc_fallback_after_s = -1\n", "grpc_poll_interval_s = 0\n"):
        with pytest.raises(SettingsError, match=r"grpc_fallback_after_s must be >= 0"):
            load_settings(_agent_toml(tmp_path / "c.toml", bad))


def test_the_heartbeat_does_not_wait_for_a_poll() -> None:
    """Issue 27: a gRPC-mode station beats every 2.5 s even where it polls every 10 s, so
    the manager can mark its silence lost within seconds; no poll runs at a beat."""
    station, twin = Station(connected=False), Twin()
    poller = _poller(station, twin, via_grpc=True, heartbeat_s=2.5, poll_interval_s=10.0)
    poller.tick()
    polls = len(twin.fetches)
    twin.reports.clear()
    for _ in range(3):
        station.now += 2.5
        poller.tick()
    assert twin.reports == [("state", BIRTH)] * 3
    assert len(twin.fetches) == polls
