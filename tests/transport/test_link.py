"""Connection changes are logged once each, never the password (issue 15).

Unit tests on the pure fold, then the real client against a real broker that is killed
and started again.
"""

import logging
from pathlib import Path

import pytest
from conftest import make_fleet_home, wait_until

from fedge.transport.link import REMIND_EVERY, LinkEvent, LinkState, advance
from fedge.transport.mqtt import MqttSession
from fedge.transport.session import MqttSettings


def _fold(events: list[tuple[LinkEvent, float]]) -> tuple[LinkState, list[str]]:
    state, lines = LinkState(), []
    for event, at in events:
        state, note = advance(state, event, at=at, detail="why")
        if note is not None:
            lines.append(f"{logging.getLevelName(note.level)} {note.message}")
    return state, lines


def test_a_drop_and_a_reconnect_are_each_one_line() -> None:
    state, lines = _fold(
        [
            (LinkEvent.CONNECTED, 0.0),
            (LinkEvent.DROPPED, 10.0),
            (LinkEvent.UNREACHABLE, 11.0),
            (LinkEvent.UNREACHABLE, 13.0),
            (LinkEvent.CONNECTED, 25.0),
        ]
    )
    assert lines == [
        "INFO connected",
        "WARNING connection lost (why); reconnecting",
        "WARNING broker is not reachable (why); retrying",
        "INFO reconnected after 15 s (2 failed attempts)",
    ]
    assert state == LinkState(connected=True, ever_connected=True)


def test_a_long_outage_is_reminded_not_flooded() -> None:
    state, lines = _fold([(LinkEvent.UNREACHABLE, float(i)) for i in range(REMIND_EVERY * 2)])
    assert len(lines) == 3  # the first attempt, then every REMIND_EVERY
    assert lines[1].startswith(f"WARNING broker still is not reachable after {REMIND_EVERY}")
    assert state.failures == REMIND_EVERY * 2 and not state.ever_connected


def test_a_refusal_is_an_error_and_its_disconnect_adds_nothing() -> None:
    _, lines = _fold([(LinkEvent.REFUSED, 0.0), (LinkEvent.DROPPED, 0.1)])
    assert lines == ["ERROR broker refused the connection (why); retrying"]


@pytest.mark.integration
def test_the_session_logs_loss_and_reconnection(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fh = make_fleet_home(tmp_path, edges=())
    broker = fh.broker()
    session = MqttSession(
        MqttSettings(
            host="127.0.0.1",
            port=fh.settings.broker_port,
            client_id=fh.settings.manager_user,
            tls=fh.home.pki().manager_files(),
        )
    )
    caplog.set_level(logging.INFO, logger="fedge.transport.mqtt")
    broker.start()
    try:
        session.start()
        wait_until(session.connected.is_set, 10, "the first connection")
        broker.stop()
        wait_until(lambda: "connection lost" in caplog.text, 10, "the loss to be logged")
        wait_until(lambda: "is not reachable" in caplog.text, 10, "a failed attempt logged")
        # A stopped broker is a network fault, said as one (issue 27): nothing in the
        # lines about the outage suggests the certificate.
        outage = [r.getMessage() for r in caplog.records if "connected" not in r.getMessage()]
        assert any("nothing listens on the port" in line for line in outage), outage
        assert not any("certificate" in line or "TLS" in line for line in outage), outage
        broker.start()
        wait_until(lambda: "reconnected after" in caplog.text, 40, "the reconnection logged")
    finally:
        session.stop()
        broker.stop()
        fh.close()
    assert f"mqtt {fh.settings.manager_user} -> 127.0.0.1:{fh.settings.broker_port}" in caplog.text
    key_body = fh.home.pki().manager_files().key.read_text().splitlines()[1]
    assert key_body not in caplog.text
    assert "disconnected (stopping)" in caplog.text
