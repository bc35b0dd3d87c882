"""The enrollment endpoint under a stranger's load (issue 24): real sockets, real TLS.

Before this issue one silent TCP connection stopped enrollment (the TLS handshake ran in
the accept loop, with no deadline). Shown here: 100 idle connections and a few stalled
handshakes, held from a stranger's network namespace, delay a real enrollment by under a
second; an oversized body is refused by its declared length before it is sent; a
slowloris, a stalled handshake and a trickled body are each cut at their deadline.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home, stranger_host

from fedge.edge_agent.identity.enroll import enroll_device
from fedge.edge_manager.security import credentials
from fedge.edge_manager.security.enroll_server import MAX_BODY, EnrollServer
from fedge.edge_manager.security.enrollment import invite
from fedge.transport.http_server import Deadlines

pytestmark = pytest.mark.integration

# Short deadlines, so that the tests of cutting peers off take seconds.
SHORT = Deadlines(handshake_s=1.0, headers_s=1.0, body_s=1.0, keep_alive_s=1)

# Run in the stranger's namespace: 100 TCP connections that say nothing and 5 that begin
# a TLS ClientHello and stall; "open" once all are, then (on a line of stdin) how many
# the server still holds open.
HOLDER = r"""
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
idle = [socket.create_connection((host, port), timeout=5) for _ in range(100)]
stalled = []
for _ in range(5):
    s = socket.create_connection((host, port), timeout=5)
    s.sendall(bytes.fromhex("160301020001000200fc0303") + b"\x00" * 8)
    stalled.append(s)
print("open", flush=True)
sys.stdin.readline()
alive = 0
for s in idle + stalled:
    s.setblocking(False)
    try:
        alive += s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        alive += 1
    except OSError:
        pass
print(alive, flush=True)
"""


@pytest.fixture
def home(tmp_path: Path) -> Iterator[FleetHome]:
    fh = make_fleet_home(tmp_path, edges=())
    try:
        yield fh
    finally:
        fh.close()


@pytest.fixture
def short(home: FleetHome) -> Iterator[EnrollServer]:
    server = EnrollServer(home.home, "127.0.0.1", 0, deadlines=SHORT)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def stranger_python(namespace: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, sys.executable, "-c"]


def _enrol(home: FleetHome, port: int, edge: str, out: Path) -> float:
    token = str(invite(home.home, edge).token)
    started = time.monotonic()
    enroll_device(f"127.0.0.1:{port}", edge, token, out / edge / "agent.toml")
    return time.monotonic() - started


def test_100_idle_connections_from_a_stranger_do_not_delay_a_real_enrollment(
    home: FleetHome, tmp_path: Path
) -> None:
    # Default deadlines: the stranger's connections outlive the enrollment.
    server = EnrollServer(home.home, "0.0.0.0", 0)
    server.start()
    try:
        with stranger_host() as stranger:
            quiet_s = _enrol(home, server.port, "st-01", tmp_path)
            holder = subprocess.Popen(
                [*stranger_python(stranger.name), HOLDER, stranger.host_ip, str(server.port)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                assert holder.stdout is not None and holder.stdin is not None
                assert holder.stdout.readline().strip() == "open", holder.stderr
                loaded_s = _enrol(home, server.port, "st-02", tmp_path)
                holder.stdin.write("\n")
                holder.stdin.flush()
                still_open = int(holder.stdout.readline())
            finally:
                holder.kill()
                holder.wait(timeout=10)
    finally:
        server.stop()
    # Every stranger's connection was still held while the station enrolled.
    assert still_open == 105
    assert loaded_s - quiet_s < 1.0, (quiet_s, loaded_s)
    assert [c.identity for c in credentials.certificates(home.db)] == ["st-01", "st-02"]
    assert server.counters["enrolled"] == 2


def test_an_oversized_body_is_refused_before_it_is_sent(short: EnrollServer) -> None:
    with _tls(short.port) as conn:
        conn.sendall(_head(10_000_000) + b"x" * 1024)
        reply = _read_all(conn)
    assert reply.startswith(b"HTTP/1.1 413 ") and b'"error":"oversized"' in reply.replace(b" ", b"")
    assert short.counters["refused_oversized"] == 1
    # Without a length (chunked): refused too, nothing read.
    with _tls(short.port) as conn:
        conn.sendall(
            b"POST /v1/enroll HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"10\r\n0123456789abcdef\r\n"
        )
        assert _read_all(conn).startswith(b"HTTP/1.1 411 ")
    assert short.counters["refused_no_length"] == 1
    # Unfinished headers past what the server keeps (8 KiB): 400, the connection closed.
    with _tls(short.port) as conn:
        conn.sendall(b"GET /v1/ca HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20_000)
        assert _read_all(conn).startswith(b"HTTP/1.1 400 ")


def test_a_slowloris_is_cut_off_at_the_header_deadline(short: EnrollServer) -> None:
    with _tls(short.port) as conn:
        started = time.monotonic()
        conn.sendall(b"POST /v1/enroll HTTP/1.1\r\n")
        closed_after = None
        for _ in range(40):  # up to 8 s of trickling, a byte every 0.2 s
            try:
                conn.sendall(b"X")
                time.sleep(0.2)  # the attacker's pace, not a wait for a state
            except OSError:
                closed_after = time.monotonic() - started
                break
            if _closed(conn):
                closed_after = time.monotonic() - started
                break
    assert closed_after is not None and closed_after < 3.0, closed_after
    assert short.counters["timeout_headers"] == 1
    # The endpoint still answers.
    with _tls(short.port) as conn:
        conn.sendall(b"GET /v1/ca HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"BEGIN CERTIFICATE" in _read_all(conn)


def test_a_stalled_handshake_and_a_trickled_body_are_cut_off(short: EnrollServer) -> None:
    with socket.create_connection(("127.0.0.1", short.port), timeout=5) as raw:
        started = time.monotonic()
        raw.sendall(bytes.fromhex("160301020001000200fc0303"))  # a ClientHello, begun
        assert raw.recv(1) == b""  # closed by the server, not by our 5 s timeout
        assert time.monotonic() - started < 3.0
    with _tls(short.port) as conn:
        conn.sendall(_head(200) + b"{")
        reply = _read_all(conn)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert short.counters["refused_slow_body"] == 1
    assert MAX_BODY == 16 * 1024


# -- raw HTTPS


def _tls(port: int) -> ssl.SSLSocket:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    return context.wrap_socket(raw)


def _head(length: int) -> bytes:
    return (
        b"POST /v1/enroll HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(length).encode() + b"\r\n\r\n"
    )


def _read_all(conn: ssl.SSLSocket) -> bytes:
    """Everything the server sends until it closes (socket timeout: 5 s)."""
    chunks = []
    while chunk := conn.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _closed(conn: ssl.SSLSocket) -> bool:
    conn.setblocking(False)
    try:
        return conn.recv(1) == b""
    except (ssl.SSLWantReadError, BlockingIOError):
        return False
    except OSError:
        return True
    finally:
        conn.setblocking(True)
        conn.settimeout(5)
