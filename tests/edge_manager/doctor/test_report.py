"""`fedge manager doctor` on real manager homes: expiring certificates, readable keys,
plain listeners, an unencrypted CA key, a stale CRL (issue 13)."""

import datetime as dt
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home
from typer.testing import CliRunner

from fedge.aggregator.superlink.address import connection_toml
from fedge.cli.main import app
from fedge.edge_manager.doctor.facts import gather
from fedge.edge_manager.doctor.report import (
    CertFact,
    Finding,
    HomeFacts,
    check_certificates,
    check_listeners,
    diagnose,
)
from fedge.edge_manager.security import credentials
from fedge.edge_manager.security.enrollment import revoke
from fedge.edge_manager.security.pki import PASSPHRASE_ENV, SERVERS
from fedge.protocols import pki
from fedge.protocols.pki import Role

EDGE = "st-01"
NOW = dt.datetime(2030, 6, 1, tzinfo=dt.UTC)


@pytest.fixture
def fh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetHome]:
    monkeypatch.delenv(PASSPHRASE_ENV, raising=False)
    home = make_fleet_home(tmp_path, edges=(EDGE,))
    yield home
    home.close()


def problems(fh: FleetHome) -> list[Finding]:
    return [f for f in diagnose(gather(fh.home)) if f.severity != "ok"]


def doctor_cli(fh: FleetHome, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["manager", "doctor", "--home", str(fh.home.root), *args])
    return result.exit_code, result.output


def record(fh: FleetHome, identity: str, role: Role, *, issued_days_ago: float, days: float) -> int:
    """A certificate issued to ``identity`` in the past, recorded in the store as the CA
    would; its serial."""
    ca = fh.home.pki().ca()
    now = pki.utcnow() - dt.timedelta(days=issued_days_ago)
    cert, _key = ca.issue_client(identity, role, now=now, days=days)
    info = pki.cert_info(pki.load_certificate(cert))
    credentials.record_certificate(fh.db, info, pem=cert)
    return info.serial


# ---------------------------------------------------------------- pure checks


def test_expired_is_an_error_soon_a_warning_and_only_the_newest_of_a_holder_counts() -> None:
    facts = [
        CertFact("CA (pki/ca.crt)", NOW + dt.timedelta(days=3000)),
        CertFact("server grpc (pki/servers/grpc.crt)", NOW - dt.timedelta(hours=1)),
        CertFact("edge st-02 (serial 2)", NOW + dt.timedelta(days=29), holder="edge st-02"),
        # st-03 renewed: its old certificate runs out, the new one is what it uses.
        CertFact("edge st-03 (serial 3)", NOW + dt.timedelta(days=5), holder="edge st-03"),
        CertFact("edge st-03 (serial 4)", NOW + dt.timedelta(days=90), holder="edge st-03"),
        CertFact("server broker (pki/servers/broker.crt)", None, "missing"),
    ]
    checked = check_certificates(facts, NOW)
    found = {(f.severity, f.subject) for f in checked if f.severity != "ok"}
    assert found == {
        ("error", "server grpc (pki/servers/grpc.crt)"),
        ("warning", "edge st-02 (serial 2)"),
        ("error", "server broker (pki/servers/broker.crt)"),
    }
    # The days left: the home's own certificates one by one, the holders' soonest.
    fine = {f.subject: (f.days_left, f.message) for f in checked if f.severity == "ok"}
    assert (
        fine["CA (pki/ca.crt)"][0] == 3000
        and "not renewed automatically" in (fine["CA (pki/ca.crt)"][1])
    )
    assert fine["home"][0] == 90 and "ends in 90 day(s) (edge st-03)" in fine["home"][1]
    assert [f.severity for f in check_certificates(facts[:1], NOW)] == ["ok"]
    with pytest.raises(ValueError, match="severity 'fatal'"):
        Finding("fatal", "x", "y", "z")  # type: ignore[arg-type]


def test_a_broker_config_without_require_certificate_is_a_plain_listener() -> None:
    tls_conf = "listener 1883 127.0.0.1\n# require_certificate false\nrequire_certificate  true\n"
    assert [f.severity for f in check_listeners(HomeFacts(False, NOW, broker_conf=tls_conf))] == [
        "ok"
    ]
    plain = check_listeners(HomeFacts(False, NOW, broker_conf="# require_certificate true\n"))
    assert [(f.severity, f.subject) for f in plain] == [("error", "broker")]
    assert "require_certificate true" in plain[0].message


# ---------------------------------------------------------------- real homes


def test_a_fresh_tls_home_is_clean_but_for_the_unencrypted_ca_key(fh: FleetHome) -> None:
    found = diagnose(gather(fh.home))
    assert [(f.severity, f.check, f.subject) for f in found if f.severity != "ok"] == [
        ("warning", "ca-key-encryption", "pki/ca.key")
    ]
    assert "FEDGE_CA_PASSPHRASE" in found[0].message
    assert {f.check for f in found} == {
        "certificate-expiry",
        "key-permissions",
        "plain-listener",
        "ca-key-encryption",
        "crl",
        "secrets-in-logs",
        "signing-key",
        "store-space",
        "broker-save",
    }


def test_a_passphrase_encrypts_the_ca_key_and_the_home_is_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PASSPHRASE_ENV, "correct horse battery staple")
    fh = make_fleet_home(tmp_path, edges=(EDGE,))
    try:
        assert problems(fh) == []
        assert (
            (fh.home.root / "pki" / "ca.key")
            .read_bytes()
            .startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY-----")
        )
    finally:
        fh.close()


def test_a_readable_key_or_an_open_directory_is_an_error_naming_it(fh: FleetHome) -> None:
    key = fh.home.root / "pki" / "servers" / "broker.key"
    key.chmod(0o644)
    found = problems(fh)
    assert [(f.severity, f.check, f.subject) for f in found if f.check == "key-permissions"] == [
        ("error", "key-permissions", "pki/servers/broker.key")
    ]
    assert "mode 0644" in found[0].message and "chmod 600" in found[0].message
    key.chmod(0o600)
    (fh.home.root / "keys").chmod(0o777)
    (fh.home.root / "keys" / "manager.key").chmod(0o640)
    subjects = {f.subject for f in problems(fh) if f.check == "key-permissions"}
    assert subjects == {"keys", "keys/manager.key"}


def test_a_station_certificate_expiring_within_30_days_is_a_warning(fh: FleetHome) -> None:
    serial = record(fh, "st-09", Role.EDGE, issued_days_ago=20, days=40)
    found = [f for f in problems(fh) if f.check == "certificate-expiry"]
    assert [(f.severity, f.subject) for f in found] == [
        ("warning", f"edge st-09 (serial {serial:x})")
    ]
    assert "expires in 20 day(s)" in found[0].message
    expired = record(fh, "alice", Role.OPERATOR, issued_days_ago=50, days=40)
    found = [f for f in problems(fh) if f.check == "certificate-expiry"]
    assert ("error", f"operator alice (serial {expired:x})") in {
        (f.severity, f.subject) for f in found
    }
    # Revoked, it is no longer the doctor's concern (the CRL is: see below).
    revoke(fh.home, "alice")
    revoke(fh.home, "st-09")
    assert [f for f in problems(fh) if f.check == "certificate-expiry"] == []


def test_a_crl_missing_a_revocation_or_unparsable_is_an_error(fh: FleetHome) -> None:
    credentials.revoke(fh.db, EDGE)  # recorded, but the CRL file was not rewritten
    found = [f for f in problems(fh) if f.check == "crl"]
    assert [(f.severity, f.subject) for f in found] == [("error", "pki/crl.pem")]
    assert "older than the newest revocation" in found[0].message and EDGE in found[0].message
    revoke(fh.home, EDGE)  # rewrites it
    assert [f for f in problems(fh) if f.check == "crl"] == []
    fh.home.pki().crl_path.write_text("not a CRL\n")
    found = [f for f in problems(fh) if f.check == "crl"]
    assert [f.severity for f in found] == ["error"] and "does not parse" in found[0].message


def test_an_insecure_home_reports_plain_listeners_as_a_development_home(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path, edges=(EDGE,), insecure=True)
    try:
        found = problems(fh)
        assert {(f.severity, f.check, f.subject) for f in found} == {
            ("warning", "plain-listener", "broker"),
            ("warning", "plain-listener", "grpc"),
            ("warning", "plain-listener", "superlink"),
        }
        assert all("development home" in f.message for f in found)
        # Its password files are checked like keys.
        (fh.home.root / "secrets" / "edges.json").chmod(0o604)
        assert ("error", "secrets/edges.json") in {(f.severity, f.subject) for f in problems(fh)}
    finally:
        fh.close()


@pytest.mark.integration
def test_a_tls_broker_config_is_clean_and_one_without_certificates_is_not(fh: FleetHome) -> None:
    broker = fh.broker()
    broker.start()
    broker.stop()
    conf = fh.home.root / "broker" / "mosquitto.conf"
    assert "require_certificate true" in conf.read_text()
    assert problems(fh)[0].check == "ca-key-encryption"  # the only finding
    conf.write_text(conf.read_text().replace("require_certificate true\n", ""))
    found = [f for f in problems(fh) if f.check == "plain-listener"]
    assert [(f.severity, f.subject) for f in found] == [("error", "broker")]


def test_a_superlink_that_ran_plain_in_a_tls_home_is_an_error(fh: FleetHome) -> None:
    cli_home = fh.home.root / "superlink" / "flwr-cli"
    cli_home.mkdir(parents=True)
    address = f"127.0.0.1:{fh.settings.superlink_port}"
    (cli_home / "config.toml").write_text(connection_toml("fedge", address, None))
    found = [f for f in problems(fh) if f.check == "plain-listener"]
    assert [(f.severity, f.subject) for f in found] == [("error", "superlink")]
    (cli_home / "config.toml").write_text(connection_toml("fedge", address, fh.home.pki().ca_path))
    assert [f for f in problems(fh) if f.check == "plain-listener"] == []


def test_a_log_holding_a_private_key_is_reported_without_the_key(fh: FleetHome) -> None:
    key = (fh.home.root / "pki" / "servers" / "grpc.key").read_bytes()
    logs = fh.home.root / "logs"
    logs.mkdir()
    (logs / "serve.log").write_bytes(b"x" * (1 << 20) + b"oops: " + key)  # across a chunk
    code, output = doctor_cli(fh, "--json")
    assert code == 1
    report = json.loads(output)
    assert {k: v for k, v in report["findings"][0].items() if k != "message"} == {
        "severity": "error",
        "check": "secrets-in-logs",
        "subject": "logs/serve.log",
        "days_left": None,
    }
    body = b"".join(key.splitlines()[1:-1]).decode()
    assert body[:40] not in output


# ---------------------------------------------------------------- the command


def test_the_command_exits_1_on_an_error_and_prints_json(fh: FleetHome) -> None:
    code, output = doctor_cli(fh)
    assert code == 0, output
    assert "0 error(s), 1 warning(s)" in output and "ca-key-encryption" in output
    code, output = doctor_cli(fh, "--json")
    report = json.loads(output)
    # ok: the CA, 4 servers, the manager and the stations' soonest (days left), the CRL,
    # key permissions, listeners, logs, signing key, store space, broker save.
    assert code == 0 and report["counts"] == {"ok": 14, "warning": 1, "error": 0}

    os.chmod(fh.home.root / "pki" / "ca.key", 0o644)
    code, output = doctor_cli(fh, "--json")
    report = json.loads(output)
    assert code == 1 and report["counts"]["error"] == 1
    assert report["findings"][0]["subject"] == "pki/ca.key"
    code, output = doctor_cli(fh)
    assert code == 1 and "pki/ca.key" in output and "1 error(s)" in output


def test_the_command_shows_the_days_left_of_every_credential_and_the_crl(fh: FleetHome) -> None:
    code, output = doctor_cli(fh, "--json")
    days = {
        f["subject"]: f["days_left"]
        for f in json.loads(output)["findings"]
        if f["check"] in ("certificate-expiry", "crl")
    }
    assert code == 0
    assert days["CA (pki/ca.crt)"] == pytest.approx(3650, abs=1)
    for name in SERVERS:
        assert days[f"server {name} (pki/servers/{name}.crt)"] == pytest.approx(825, abs=1)
    assert days["manager client (pki/clients/manager.crt)"] == pytest.approx(825, abs=1)
    assert days["pki/crl.pem"] == pytest.approx(365, abs=1)
    assert days["home"] == pytest.approx(90, abs=1)  # the station's
    code, output = doctor_cli(fh)
    said = " ".join(output.split())
    assert "825 day(s) left" in said and "next update in 365 day(s)" in said


def test_a_crl_near_its_next_update_is_a_warning_and_past_it_an_error(fh: FleetHome) -> None:
    fleet_pki = fh.home.pki()
    ca = fleet_pki.ca()
    fleet_pki.write_crl(ca, list, now=pki.utcnow() - dt.timedelta(days=350))
    found = [f for f in problems(fh) if f.check == "crl"]
    assert [(f.severity, f.subject) for f in found] == [("warning", "pki/crl.pem")]
    assert found[0].days_left == pytest.approx(15, abs=1)
    assert "`fedge manager serve` issues it again" in found[0].message
    fleet_pki.write_crl(ca, list, now=pki.utcnow() - dt.timedelta(days=400))
    found = [f for f in problems(fh) if f.check == "crl"]
    assert [f.severity for f in found] == ["error"] and "refuses every station" in found[0].message


def test_the_command_on_a_directory_that_is_no_home_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["manager", "doctor", "--home", str(tmp_path / "nope")])
    assert result.exit_code == 1
    said = " ".join(result.output.split())  # rich wraps at 80 columns
    assert "is not a manager home" in said and "Traceback" not in said
