"""Ports for servers fedge starts itself never come from the range outgoing connections use."""

import socket

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
