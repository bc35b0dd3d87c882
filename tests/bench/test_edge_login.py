"""The login a simulated edge gets in its helper's spec: a password or certificate paths."""

from pathlib import Path

import pytest

from fedge.bench.config_push_worker import WorkerSpec
from fedge.bench.edge_login import EdgeLogin, EdgeLoginError
from fedge.bench.ingest_publisher import PublisherSpec
from fedge.protocols.pki import TlsFiles

FILES = TlsFiles(ca=Path("/b/ca.crt"), cert=Path("/b/e1.crt"), key=Path("/b/e1.key"))


def test_password_login_round_trips() -> None:
    login = EdgeLogin("e1", password="pw")
    assert login.to_json() == {"edge": "e1", "password": "pw"}
    assert EdgeLogin.from_json(login.to_json()) == login
    assert "pw" not in repr(login)


def test_tls_login_carries_paths_only() -> None:
    login = EdgeLogin("e1", tls=FILES)
    data = login.to_json()
    assert data == {"edge": "e1", "ca": "/b/ca.crt", "cert": "/b/e1.crt", "key": "/b/e1.key"}
    assert "password" not in data
    assert EdgeLogin.from_json(data) == login


def test_exactly_one_credential() -> None:
    with pytest.raises(EdgeLoginError, match="not both"):
        EdgeLogin("e1")
    with pytest.raises(EdgeLoginError, match="not both"):
        EdgeLogin("e1", password="pw", tls=FILES)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (["e1", "pw"], "not an edge login: list"),
        ({"password": "pw"}, "not an edge login"),
        ({"edge": "e1", "ca": "/b/ca.crt", "cert": "/b/e1.crt"}, "no key file"),
        ({"edge": "e1"}, "no ca file"),
    ],
)
def test_malformed_entries_are_refused(entry: object, message: str) -> None:
    with pytest.raises(EdgeLoginError, match=message):
        EdgeLogin.from_json(entry)


def test_specs_carry_both_kinds() -> None:
    logins = [EdgeLogin("e1", tls=FILES), EdgeLogin("e2", password="pw")]
    worker = WorkerSpec("127.0.0.1", 1883, "f", "key", logins, "/tmp/a.db")
    assert WorkerSpec.from_json(worker.to_json()) == worker
    publisher = PublisherSpec("127.0.0.1", 1883, "f", logins, 10, 5, 0.1)
    assert PublisherSpec.from_json(publisher.to_json()) == publisher
