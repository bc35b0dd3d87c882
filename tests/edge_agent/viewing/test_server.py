"""The station's image endpoint over real mutual TLS (issue 30): it sends a kept image to
the manager's certificate only while its own signed config allows operator viewing, and
refuses everything else with a reason, counted at the station; the manager's client
checks the station's certificate and bounds the reply."""

import socket
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fedge.edge_agent.viewing.server import ImageServer, StationImages
from fedge.edge_manager.viewing.client import ViewError, ViewFailure, fetch_image
from fedge.protocols.config import EdgeConfig
from fedge.protocols.fleet_ca import FleetCA
from fedge.protocols.pki import Role, TlsFiles
from fedge.protocols.viewing import Refusal

pytestmark = pytest.mark.integration

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


@dataclass
class Station:
    config: EdgeConfig | None
    kept: dict[str, Path]
    known: set[str]
    counters: Counter[str]


def _pair(ca: FleetCA, root: Path, name: str, role: Role, ca_path: Path) -> TlsFiles:
    cert, key = ca.issue_client(name, role)
    (root / f"{name}-{role}.crt").write_bytes(cert)
    (root / f"{name}-{role}.key").write_bytes(key)
    return TlsFiles(ca_path, root / f"{name}-{role}.crt", root / f"{name}-{role}.key")


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, TlsFiles]:
    ca = FleetCA.create("plant")
    ca_path = tmp_path / "ca.crt"
    ca_path.write_bytes(ca.cert_pem)
    return {
        "station": _pair(ca, tmp_path, "st-01", Role.EDGE, ca_path),
        "other": _pair(ca, tmp_path, "st-02", Role.EDGE, ca_path),
        "manager": _pair(ca, tmp_path, "manager", Role.MANAGER, ca_path),
        "operator": _pair(ca, tmp_path, "lena", Role.OPERATOR, ca_path),
    }


@pytest.fixture
def station(tmp_path: Path, pki: dict[str, TlsFiles]) -> Iterator[tuple[Station, ImageServer]]:
    image = tmp_path / "p-1.png"
    image.write_bytes(PNG)
    state = Station(
        EdgeConfig(fleet="plant", edge="st-01", version=2, operator_viewing=True),
        {"p-1": image},
        {"p-1", "p-pruned"},
        Counter(),
    )
    images = StationImages(
        config=lambda: state.config,
        known=lambda pid: pid in state.known,
        kept=lambda pid: (
            (state.kept[pid], state.kept[pid].stat().st_size) if pid in state.kept else None
        ),
        counters=state.counters,
    )
    server = ImageServer(images, pki["station"], "127.0.0.1", 0)
    server.start()
    try:
        yield state, server
    finally:
        server.stop()


def _refusal(files: TlsFiles, address: str, pid: str, edge: str = "st-01") -> ViewError:
    with pytest.raises(ViewError) as caught:
        fetch_image(files, edge, address, pid, timeout_s=2.0)
    return caught.value


def test_the_manager_gets_the_kept_bytes_while_the_policy_is_on(
    station: tuple[Station, ImageServer], pki: dict[str, TlsFiles]
) -> None:
    state, server = station
    got = fetch_image(pki["manager"], "st-01", server.address, "p-1")
    assert got.data == PNG and got.media_type == "image/png"
    assert state.counters["images.sent"] == 1
    assert state.counters["images.bytes_sent"] == len(PNG)


def test_policy_off_at_the_station_sends_nothing_whatever_the_manager_thinks(
    station: tuple[Station, ImageServer], pki: dict[str, TlsFiles]
) -> None:
    state, server = station
    state.config = EdgeConfig(fleet="plant", edge="st-01", version=3)  # turned off
    error = _refusal(pki["manager"], server.address, "p-1")
    assert error.kind is ViewFailure.REFUSED and error.refusal is Refusal.POLICY_OFF
    assert "operator viewing" in str(error)
    assert state.counters["images.refused.policy_off"] == 1
    assert state.counters["images.bytes_sent"] == 0
    state.config = None  # no config applied yet: off too
    assert _refusal(pki["manager"], server.address, "p-1").refusal is Refusal.POLICY_OFF


def test_unknown_and_pruned_predictions_are_refused_with_their_reason(
    station: tuple[Station, ImageServer], pki: dict[str, TlsFiles]
) -> None:
    state, server = station
    assert _refusal(pki["manager"], server.address, "p-nope").refusal is Refusal.UNKNOWN
    assert _refusal(pki["manager"], server.address, "p-pruned").refusal is Refusal.PRUNED
    assert state.counters["images.refused.unknown"] == 1
    assert state.counters["images.refused.pruned"] == 1
    assert state.counters["images.sent"] == 0


def test_only_the_managers_certificate_is_served(
    station: tuple[Station, ImageServer], pki: dict[str, TlsFiles]
) -> None:
    state, server = station
    # An operator's certificate from the same CA: refused by the station.
    error = _refusal(pki["operator"], server.address, "p-1")
    assert error.refusal is Refusal.NOT_MANAGER
    # Another station's certificate: refused before a byte of the request is sent.
    error = _refusal(pki["other"], server.address, "p-1")
    assert error.refusal is Refusal.NOT_MANAGER
    assert state.counters["images.refused.not_manager"] == 2
    assert state.counters["images.sent"] == 0


def test_the_manager_refuses_a_peer_that_is_not_the_station(
    station: tuple[Station, ImageServer], pki: dict[str, TlsFiles]
) -> None:
    state, server = station
    error = _refusal(pki["manager"], server.address, "p-1", edge="st-02")
    assert error.kind is ViewFailure.IMPOSTOR and "nothing was asked" in str(error)
    assert sum(state.counters.values()) == 0  # the station never saw a request


def test_an_oversized_reply_is_refused_unread(
    station: tuple[Station, ImageServer], pki: dict[str, TlsFiles]
) -> None:
    _, server = station
    with pytest.raises(ViewError) as caught:
        fetch_image(pki["manager"], "st-01", server.address, "p-1", max_bytes=100)
    assert caught.value.kind is ViewFailure.TOO_LARGE


def test_a_station_that_is_down_or_silent_fails_within_the_deadline(
    pki: dict[str, TlsFiles],
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens
    error = _refusal(pki["manager"], f"127.0.0.1:{port}", "p-1")
    assert error.kind is ViewFailure.OFFLINE and "did not answer" in str(error)
    silent = socket.socket()  # listens, never shakes hands
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        with pytest.raises(ViewError) as caught:
            fetch_image(
                pki["manager"], "st-01", f"127.0.0.1:{silent.getsockname()[1]}", "p-1",
                timeout_s=0.5,
            )  # fmt: skip
        assert caught.value.kind is ViewFailure.OFFLINE
    finally:
        silent.close()
