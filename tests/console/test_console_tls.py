"""`fedge console --tls`: HTTPS with a certificate from the fleet CA, Secure cookies.

A real `fedge console` process; clients are httpx over real TLS. A client that trusts the
fleet CA logs in; one that does not is refused by the handshake; plain HTTP gets no page.
"""

import re
import ssl
from pathlib import Path

import httpx
import pytest
from conftest import Processes, free_port, make_fleet_home, port_open, wait_until

from fedge.edge_manager import fleet_pki
from fedge.protocols.fleet_ca import FleetCA

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
        assert page.headers["strict-transport-security"] == "max-age=31536000"
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


def test_the_console_certificate_is_issued_again_for_a_host_it_does_not_name(
    tmp_path: Path,
) -> None:
    fh = make_fleet_home(tmp_path)
    pki = fh.home.pki()
    first = pki.served_files("console", ["127.0.0.1"])
    issued = first.cert.read_bytes()
    assert pki.served_files("console", ["127.0.0.1", "localhost"]).cert.read_bytes() == issued
    again = pki.served_files("console", ["10.20.30.40"])
    assert again.cert.read_bytes() != issued
    assert fleet_pki.covers(again.cert, ["10.20.30.40", "127.0.0.1"])
    assert not fleet_pki.covers(again.cert, ["plant-b.example"])
    # Issued by the fleet's CA, as a server certificate.
    ca = FleetCA.load(pki.ca_path, pki.ca_key_path)
    assert ca.verify(again.cert.read_bytes()).identity == "console"


def test_a_home_without_a_fleet_ca_cannot_serve_tls(tmp_path: Path, processes: Processes) -> None:
    fh = make_fleet_home(tmp_path, insecure=True)
    result = processes.cli(
        "console", "--tls", "--home", str(fh.home.root), "--port", str(free_port()), expect=1
    )
    assert "holds no fleet CA" in result.stderr + result.stdout
