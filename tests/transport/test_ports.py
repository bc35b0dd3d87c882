"""Ports for servers fedge starts itself never come from the range outgoing connections use."""

import os
import socket
import time
from pathlib import Path

import pytest

from fedge.transport import ports


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    top = ports.ephemeral_start()
    handed = [ports.free_port() for _ in range(50)]
    assert len(set(handed)) == 50
    assert all(20000 <= port < top for port in handed)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", handed[-1]))


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        busy = held.getsockname()[1]
        draws = iter([busy, busy, busy + 1 if busy + 1 < 65536 else busy - 1])
        monkeypatch.setattr("fedge.transport.ports.random.randrange", lambda lo, hi: next(draws))
        monkeypatch.setattr(ports, "ephemeral_start", lambda: 65535)
        monkeypatch.setattr(ports, "_given", set())
        assert ports.free_port() != busy


def test_a_port_claimed_by_another_process_is_not_handed_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Parallel test workers (and the processes they start) draw from one range: a port
    another process claimed a moment ago is skipped even though it still binds."""
    monkeypatch.setattr(ports, "_claims_dir", lambda: tmp_path)
    monkeypatch.setattr(ports, "_given", set())
    first = ports.free_port()
    assert (tmp_path / str(first)).exists()
    monkeypatch.setattr(ports, "_given", set())  # another process: it has handed out nothing
    draws = iter([first, first, first + 1])
    monkeypatch.setattr("fedge.transport.ports.random.randrange", lambda lo, hi: next(draws))
    assert ports.free_port() == first + 1


def test_a_lapsed_claim_is_taken_over(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ports, "_claims_dir", lambda: tmp_path)
    monkeypatch.setattr(ports, "_given", set())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        candidate = probe.getsockname()[1]
    claim = tmp_path / str(candidate)
    claim.touch()
    old = time.time() - ports.CLAIM_TTL_S - 1
    os.utime(claim, (old, old))
    monkeypatch.setattr("fedge.transport.ports.random.randrange", lambda lo, hi: candidate)
    monkeypatch.setattr(ports, "ephemeral_start", lambda: 65535)
    assert ports.free_port() == candidate
    assert time.time() - claim.stat().st_mtime < 60
