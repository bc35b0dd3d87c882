"""`fedge console --tls`: HTTPS with a certificate from the fleet CA, Secure cookies.

A real `fedge console` process; clients are httpx over real TLS. A client that trusts the
fleet CA logs in; one that does not is refused by the handshake; plain HTTP gets no page.
"""

import datetime as dt
import re
import ssl
from pathlib import Path

import httpx
import pytest
from conftest import Processes, free_port, make_fleet_home, port_open, wait_until
from starlette.testclient import TestClient

from fedge.console import audit
from fedge.console.address import wants_tls
from fedge.console.app import create_app
from fedge.console.cert_login import Revocations, operator_of, presented_chain
from fedge.edge_manager.security import pki as fleet_pki
from fedge.edge_manager.security.operators import add_operator, remove_operator
from fedge.protocols import pki
from fedge.protocols.fleet_ca import FleetCA
from fedge.protocols.pki import Role, key_pem, new_key
from fedge.protocols.pki import utcnow as pki_now

pytestmark = pytest.mark.integration

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def test_the_console_over_tls_is_trusted_through_the_fleet_ca(
    tmp_path: Path, processes: Processes
) -> None:
    fh = make_fleet_home(tmp_path)
    home = str(fh.home.root)
    token = processes.cli("console", "token", "add", "ada", "--home", home).stdout.strip()
    console_cert = fh.home.pki().server_files("console").cert
    assert not console_cert.exists()  # issued on first use, not at init
    port = free_port()
    served = processes.start("console", "console", "--tls", "--home", home, "--port", str(port))
    wait_until(lambda: port_open(port), 15, "the console to listen")
    wait_until(lambda: f"https://127.0.0.1:{port}/" in served.output(), 10, "its URL")
    assert console_cert.exists()

    context = ssl.create_default_context(cafile=str(fh.home.pki().ca_path))
    with httpx.Client(verify=context, base_url=f"https://127.0.0.1:{port}") as client:
        page = client.get("/login")
        assert page.status_code == 200
        assert "secure" in page.headers["set-cookie"].lower()  # the login form's cookie
        # No HSTS on loopback: it would bind localhost on every port, the plain console too.
        assert "strict-transport-security" not in page.headers
        login = {"csrf": CSRF.findall(page.text)[0], "token": token}
        done = client.post("/login", data=login, follow_redirects=False)
        assert done.status_code == 303
        cookie = done.headers["set-cookie"].lower()
        assert "secure" in cookie and "httponly" in cookie and "samesite=strict" in cookie
        assert 'data-edge="st-01"' in client.get("/").text
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://localhost:{port}/login", timeout=5)  # the system's roots only
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/login", timeout=5)
    assert served.running(), served.output()


def test_the_console_certificate_is_issued_again_only_when_it_must_be(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path)
    home_pki = fh.home.pki()
    first = home_pki.served_files("console", ["127.0.0.1"])
    issued = first.cert.read_bytes()
    assert home_pki.served_files(
        "console", ["127.0.0.1", "localhost", "0.0.0.0"]
    ).cert.read_bytes() == (issued)
    # An address it does not name: issued again, naming it.
    again = home_pki.served_files("console", ["FD00::1"])
    assert again.cert.read_bytes() != issued
    reissued = again.cert.read_bytes()
    # The same address spelt otherwise is the same address: no new certificate.
    assert home_pki.served_files("console", ["fd00:0:0::1", "[fd00::1]"]).cert.read_bytes() == (
        reissued
    )
    assert fleet_pki.covers(again.cert, ["fd00::1", "LOCALHOST", "0:0:0:0:0:0:0:0"])
    assert not fleet_pki.covers(again.cert, ["plant-b.example"])
    # Within RENEW_BEFORE_DAYS of its end (825 days): issued again.
    soon = pki_now() + dt.timedelta(days=pki.SERVER_DAYS - fleet_pki.RENEW_BEFORE_DAYS + 1)
    renewed = home_pki.served_files("console", ["fd00::1"], now=soon)
    assert renewed.cert.read_bytes() != reissued
    # A key that is not the certificate's (a write cut short): issued again.
    other = home_pki.served_files("console", ["fd00::1"])
    other.key.write_bytes(key_pem(new_key()))
    assert not fleet_pki.usable(other, pki_now())
    fixed = home_pki.served_files("console", ["fd00::1"])
    assert fleet_pki.usable(fixed, pki_now())
    # Issued by the fleet's CA, as a server certificate; `manager advertise` renews it.
    ca = FleetCA.load(home_pki.ca_path, home_pki.ca_key_path)
    assert ca.verify(fixed.cert.read_bytes()).identity == "console"
    before = fixed.cert.read_bytes()
    fh.home.advertise("plant-a.example")
    assert fixed.cert.read_bytes() != before
    assert fleet_pki.covers(fixed.cert, ["plant-a.example"])


def test_a_home_without_a_fleet_ca_cannot_serve_tls(tmp_path: Path, processes: Processes) -> None:
    fh = make_fleet_home(tmp_path, insecure=True)
    result = processes.cli(
        "console", "--tls", "--home", str(fh.home.root), "--port", str(free_port()), expect=1
    )
    assert "holds no fleet CA" in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("host", "flag", "has_ca", "expected"),
    [
        ("127.0.0.1", None, True, False),  # this machine only: plain, as `make console`
        ("0.0.0.0", None, True, True),  # reachable from others: HTTPS by default
        ("10.1.2.3", None, False, False),  # an --insecure home has no CA to issue from
        ("0.0.0.0", False, True, False),  # behind a TLS proxy
        ("127.0.0.1", True, True, True),
    ],
)
def test_when_the_console_serves_https(
    host: str, flag: bool | None, has_ca: bool, expected: bool
) -> None:
    assert wants_tls(host, flag, has_ca) is expected


def test_hsts_only_where_asked(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path)
    for hsts in (False, True):
        client = TestClient(create_app(fh.home, https=True, hsts=hsts), follow_redirects=False)
        headers = client.get("/login").headers
        assert ("strict-transport-security" in headers) is hsts
        assert "secure" in headers["set-cookie"].lower()


def test_an_operator_logs_in_with_the_certificate_the_fleet_ca_issued_them(
    tmp_path: Path, processes: Processes
) -> None:
    fh = make_fleet_home(tmp_path)
    home = str(fh.home.root)
    add_operator(fh.home, "alice")  # her certificate, kept in the home here
    add_operator(fh.home, "bob")
    processes.cli("console", "token", "add", "alice", "--role", "operator", "--home", home)
    processes.cli("console", "token", "add", "bob", "--role", "admin", "--home", home)
    port = free_port()
    served = processes.start("console", "console", "--tls", "--home", home, "--port", str(port))
    wait_until(lambda: port_open(port), 15, "the console to listen")
    base = f"https://127.0.0.1:{port}"

    def client(identity: str | None) -> httpx.Client:
        # A context of its own: the certificate is loaded into it.
        context = ssl.create_default_context(cafile=str(fh.home.pki().ca_path))
        if identity is not None:
            files = fh.tls_files(identity)
            context.load_cert_chain(str(files.cert), str(files.key))
        return httpx.Client(verify=context, base_url=base, follow_redirects=False)

    with client("alice") as alice:
        page = alice.get("/login")
        assert "Log in as alice (operator certificate)" in page.text
        done = alice.post("/login", data={"csrf": CSRF.findall(page.text)[0], "certificate": "1"})
        assert done.status_code == 303, done.text
        assert "alice (operator)" in alice.get("/").text  # her account's role
    # Without a certificate, or with a station's: no certificate login, and a forced one
    # is refused.
    for identity in (None, "st-01"):
        with client(identity) as other:
            page = other.get("/login")
            assert "operator certificate)" not in page.text
            forced = other.post(
                "/login", data={"csrf": CSRF.findall(page.text)[0], "certificate": "1"}
            )
            assert forced.status_code == 403 and "no console account" in forced.text
    # bob logs in with his; once his certificate is revoked his session ends, and the
    # handshake still passes (the console checks the CRL itself) but a login does not.
    with client("bob") as bob:
        page = bob.get("/login")
        done = bob.post("/login", data={"csrf": CSRF.findall(page.text)[0], "certificate": "1"})
        assert done.status_code == 303 and "bob (admin)" in bob.get("/").text
        remove_operator(fh.home, "bob")
        ended = bob.get("/")
        assert ended.status_code == 303 and ended.headers["location"] == "/login"
    with client("bob") as bob:
        page = bob.get("/login")
        assert "operator certificate)" not in page.text
        forced = bob.post("/login", data={"csrf": CSRF.findall(page.text)[0], "certificate": "1"})
        assert forced.status_code == 403
    with fh.fleet() as fleet:
        logins = [(e.who, e.detail, e.outcome.value) for e in audit.recent(fleet.store)]
    assert ("alice", "certificate", "done") in logins
    assert logins.count(("-", "unknown certificate", "refused")) == 3
    assert served.running(), served.output()


def test_only_a_verified_unrevoked_operator_certificate_of_the_fleet_ca_names_anyone(
    tmp_path: Path,
) -> None:
    fh = make_fleet_home(tmp_path)
    files = fh.home.pki()
    ca = FleetCA.load(files.ca_path, files.ca_key_path)
    alice, _ = ca.issue_client("alice", Role.OPERATOR)
    station, _ = ca.issue_client("st-01", Role.EDGE)
    other_ca = FleetCA.create("plant-b")
    forged, _ = other_ca.issue_client("admin", Role.OPERATOR)

    def name(pem: bytes, **tls: object) -> str | None:
        scope = {"extensions": {"tls": {"client_cert_chain": [pem.decode()], **tls}}}
        found = operator_of(presented_chain(scope), files.ca_path, Revocations(files.crl_path))
        return None if found is None else found.name

    assert name(alice) == "alice"
    assert name(alice, client_cert_error="certificate verify failed") is None
    assert name(station) is None  # a station is not a person
    assert name(forged) is None  # another CA's, whatever it says it is
    assert operator_of([], files.ca_path, Revocations(files.crl_path)) is None
    later = pki_now() + dt.timedelta(days=pki.CLIENT_DAYS + 1)
    chain = presented_chain({"extensions": {"tls": {"client_cert_chain": [alice.decode()]}}})
    crl = Revocations(files.crl_path)
    assert operator_of(chain, files.ca_path, crl, now=later) is None  # expired
    missing = Revocations(tmp_path / "no-crl.pem")
    assert operator_of(chain, files.ca_path, missing) is None  # can't tell
