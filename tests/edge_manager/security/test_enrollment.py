"""Enrollment with a one-time token over the real HTTPS endpoint (issue 13).

The device makes its key; the manager signs its CSR only for a good token: unused, not
expired, issued for the edge the CSR names. Every refusal issues nothing and is counted.
"""

import http.client
import json
import os
import ssl
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FEDGE, FleetHome, make_fleet_home

from fedge.edge_agent.identity.enroll import EnrollmentRefused, enroll_device
from fedge.edge_agent.settings import load_settings
from fedge.edge_manager.security import credentials
from fedge.edge_manager.security.enroll_server import EnrollServer
from fedge.edge_manager.security.enrollment import invite
from fedge.protocols import pki
from fedge.protocols.enrollment import JoinToken

pytestmark = pytest.mark.integration


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[tuple[FleetHome, EnrollServer]]:
    fh = make_fleet_home(tmp_path, edges=())
    server = EnrollServer(fh.home, "127.0.0.1", 0)
    server.start()
    try:
        yield fh, server
    finally:
        server.stop()
        fh.close()


def issued(fh: FleetHome) -> list[str]:
    return [c.identity for c in credentials.certificates(fh.db)]


def test_a_device_enrols_with_its_own_key_and_gets_a_config_without_secrets(
    endpoint: tuple[FleetHome, EnrollServer], tmp_path: Path
) -> None:
    fh, server = endpoint
    invitation = invite(fh.home, "st-01")
    config = tmp_path / "device" / "agent.toml"
    enrolled = enroll_device(f"127.0.0.1:{server.port}", "st-01", str(invitation.token), config)
    settings = load_settings(config)
    assert settings.edge == "st-01" and settings.tls() == enrolled.tls
    text = config.read_text()
    assert "password" not in text and "PRIVATE KEY" not in text
    assert stat.S_IMODE(os.stat(enrolled.tls.key).st_mode) == 0o600
    info = fh.home.pki().ca().verify(enrolled.tls.cert.read_bytes())
    assert (info.identity, info.role) == ("st-01", pki.Role.EDGE)
    # The manager kept no key of the station's and only the token's hash.
    assert not list(fh.home.root.rglob("st-01*.key"))
    assert invitation.token.secret not in (fh.home.db_path.read_bytes().decode("latin-1"))
    assert issued(fh) == ["st-01"]
    assert fh.row("SELECT edge FROM edges WHERE edge='st-01'")
    assert server.counters["enrolled"] == 1


def test_a_token_used_twice_expired_or_for_another_edge_issues_nothing(
    endpoint: tuple[FleetHome, EnrollServer], tmp_path: Path
) -> None:
    fh, server = endpoint
    url = f"127.0.0.1:{server.port}"
    token = str(invite(fh.home, "st-01").token)
    enroll_device(url, "st-01", token, tmp_path / "a" / "agent.toml")
    with pytest.raises(EnrollmentRefused, match="already used"):
        enroll_device(url, "st-01", token, tmp_path / "b" / "agent.toml")

    short = str(invite(fh.home, "st-02", ttl_s=0.2).token)
    time.sleep(0.4)
    with pytest.raises(EnrollmentRefused, match="expired"):
        enroll_device(url, "st-02", short, tmp_path / "c" / "agent.toml")

    for_st3 = str(invite(fh.home, "st-03").token)
    with pytest.raises(EnrollmentRefused, match="issued for 'st-03', not 'st-04'"):
        enroll_device(url, "st-04", for_st3, tmp_path / "d" / "agent.toml")
    # The refused attempts left the st-03 token usable by st-03.
    assert issued(fh) == ["st-01"]
    assert not (tmp_path / "b" / "agent.toml").exists()
    assert not (tmp_path / "d" / "agent.key").exists()
    assert server.counters["refused_token_used"] == 1
    assert server.counters["refused_token_expired"] == 1
    assert server.counters["refused_wrong_edge"] == 1
    enroll_device(url, "st-03", for_st3, tmp_path / "e" / "agent.toml")
    assert issued(fh) == ["st-01", "st-03"]


def test_a_csr_naming_another_edge_is_refused_and_the_token_survives(
    endpoint: tuple[FleetHome, EnrollServer],
) -> None:
    fh, server = endpoint
    invitation = invite(fh.home, "st-01")
    _, csr_for_st2 = pki.new_key_and_csr("st-02")
    body = (
        b'{"schema":1,"kind":"enroll_request","edge":"st-01","token":"'
        + invitation.token.secret.encode()
        + b'","csr":'
        + json.dumps(csr_for_st2.decode()).encode()
        + b"}"
    )
    status, reply = _post(server.port, body)
    assert status == 403 and b"names 'st-02', not 'st-01'" in reply
    assert issued(fh) == []
    assert server.counters["refused_bad_csr"] == 1
    # Malformed and oversized requests: clear errors, nothing issued.
    assert _post(server.port, b"{not json")[0] == 400
    assert _post(server.port, b"x" * 20_000)[0] == 413
    assert issued(fh) == []


def test_a_manager_whose_ca_is_not_the_tokens_gets_nothing(
    endpoint: tuple[FleetHome, EnrollServer], tmp_path: Path
) -> None:
    fh, server = endpoint
    token = invite(fh.home, "st-01").token
    forged_pin = JoinToken(token.secret, "0" * 64)
    with pytest.raises(EnrollmentRefused, match="not this fleet's manager"):
        enroll_device(f"127.0.0.1:{server.port}", "st-01", str(forged_pin), tmp_path / "x.toml")
    assert server.counters["enrolled"] == 0 and issued(fh) == []


def test_fedge_agent_enroll_on_the_command_line(
    endpoint: tuple[FleetHome, EnrollServer], tmp_path: Path
) -> None:
    fh, server = endpoint
    printed = subprocess.run(
        [str(FEDGE), "edge", "enroll", "st-05", "--home", str(fh.home.root)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    command = next(line for line in printed.splitlines() if line.startswith("fedge agent"))
    assert "--token" not in command  # asked for: not in the process list or shell history
    token = next(line for line in printed.splitlines() if line.startswith("token: "))[7:]
    config = tmp_path / "st-05" / "agent.toml"
    result = subprocess.run(
        [
            str(FEDGE),
            "agent",
            "enroll",
            "--manager",
            f"127.0.0.1:{server.port}",
            "--edge",
            "st-05",
            "--config",
            str(config),
        ],
        input=token + "\n",
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert token not in result.stdout + result.stderr
    assert load_settings(config).edge == "st-05"


def _post(port: int, body: bytes) -> tuple[int, bytes]:
    context = ssl.create_default_context(cafile=None)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        connection.request("POST", "/v1/enroll", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()
