"""The outbox's in-flight bookkeeping against a session that behaves like paho.

paho calls ``on_publish`` on its network thread while holding its outgoing-message mutex,
and ``publish()`` needs that same mutex. An agent that called ``publish()`` while holding a
lock its PUBACK callback takes deadlocked after a broker outage (issue "A fault-injection
and soak suite", defect 1). :class:`PahoLikeSession` reproduces that interleaving on every
publish, deterministically: the PUBACK is delivered from another thread, under the
session's mutex, before ``publish()`` returns the message id.
"""

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.settings import AgentSettings
from fedge.protocols.signing import SigningKey
from fedge.transport.session import OnPublished, PublishResult

EDGE = "st-01"
# How long publish() waits for the network thread's callback before calling it a deadlock.
DEADLOCK_AFTER_S = 10.0  # generous: only a real deadlock takes this long


class PahoLikeSession:
    """Stands in for ``MqttSession``: QoS 1 publishes whose PUBACK comes back as paho does.

    ``ack_early``: the PUBACK is delivered, from a "network thread" holding the session's
    mutex, before ``publish()`` returns (paho does this whenever the broker answers before
    the publisher thread gets the mutex back). Otherwise PUBACKs wait for :meth:`ack_all`.
    """

    def __init__(self, on_published: OnPublished, *, ack_early: bool, first_mid: int = 1) -> None:
        self._on_published = on_published
        self._mutex = threading.RLock()  # paho's _out_message_mutex
        self.ack_early = ack_early
        self.connected = threading.Event()
        self.connected.set()
        self.next_mid = first_mid
        self.published: dict[int, bytes] = {}
        self.unacked: list[int] = []
        self.deadlocked: list[int] = []
        self.reason_code = 0

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> int:
        mid = self.next_mid
        self.next_mid += 1
        self.published[mid] = payload
        if not self.ack_early:
            self.unacked.append(mid)
            return mid
        holding = threading.Event()
        network = threading.Thread(target=self._deliver, args=(mid, holding), daemon=True)
        network.start()
        assert holding.wait(DEADLOCK_AFTER_S), "the network thread never took the mutex"
        # publish() needs the mutex the network thread holds while it runs the callback.
        if self._mutex.acquire(timeout=DEADLOCK_AFTER_S):
            self._mutex.release()
        else:
            # A real paho would block here forever; record it and let the test end.
            self.deadlocked.append(mid)
        return mid

    def _deliver(self, mid: int, holding: threading.Event) -> None:
        with self._mutex:
            holding.set()
            self._on_published(PublishResult(mid, self.reason_code, "reason"))

    def ack_all(self) -> None:
        """The broker's PUBACKs for everything still unacknowledged (on this thread)."""
        while self.unacked:
            mid = self.unacked.pop(0)
            with self._mutex:
                self._on_published(PublishResult(mid, self.reason_code, "reason"))


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[EdgeAgent]:
    settings = AgentSettings(
        fleet="plant-a",
        edge=EDGE,
        data_dir=tmp_path / "data",
        broker_host="127.0.0.1",
        broker_port=1,
        insecure=True,
        password="secret",
        grpc_target="127.0.0.1:1",
        manager_public_key=SigningKey.generate().public.to_text(),
    )
    agent = EdgeAgent(settings)
    yield agent
    agent.store.close()
    agent.station.close()


def _seal(agent: EdgeAgent, batches: int) -> None:
    """``batches`` outbox batches of one telemetry record each."""
    for i in range(batches):
        agent.add_metric("probe", float(i))
    assert agent.store.seal_batches(EDGE, 0, max_records=1) == batches


def _session(
    agent: EdgeAgent, monkeypatch: pytest.MonkeyPatch, *, ack_early: bool, first_mid: int = 1
) -> PahoLikeSession:
    session = PahoLikeSession(agent._on_published, ack_early=ack_early, first_mid=first_mid)
    monkeypatch.setattr(agent, "mqtt", session)
    return session


@pytest.mark.timeout(60)
def test_puback_delivered_under_the_session_mutex_does_not_deadlock_the_publisher(
    agent: EdgeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = _session(agent, monkeypatch, ack_early=True)
    _seal(agent, 5)

    agent._drain_outbox()

    assert session.deadlocked == [], "publish() waited on a callback blocked by the agent's lock"
    assert len(session.published) == 5
    # Each PUBACK arrived before publish() returned its mid, and still counts: every batch
    # is acknowledged once, nothing is left in flight to be resent a minute later.
    assert agent.store.backlog() == {"pending_records": 0, "outbox_batches": 0}
    assert agent.counters["batches.acked"] == 5
    agent._drain_outbox()
    assert len(session.published) == 5


@pytest.mark.timeout(60)
def test_early_refusal_keeps_the_batch_and_stops_retrying_it(
    agent: EdgeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = _session(agent, monkeypatch, ack_early=True)
    session.reason_code = 0x87  # not authorized
    _seal(agent, 2)

    agent._drain_outbox()
    agent._drain_outbox()

    assert session.deadlocked == []
    assert len(session.published) == 2, "a refused batch was retried"
    assert agent.store.backlog()["outbox_batches"] == 2, "a refused batch was dropped"
    assert agent.counters["batches.refused"] == 2


@pytest.mark.timeout(60)
def test_ack_for_another_publish_is_not_taken_for_a_later_batch(
    agent: EdgeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A PUBACK for a report the agent published outside the outbox (a state, a deploy
    # status): nothing in flight has its mid, and paho will reuse the mid later.
    agent._on_published(PublishResult(7, 0, "Success"))
    session = _session(agent, monkeypatch, ack_early=False, first_mid=7)
    _seal(agent, 1)

    agent._drain_outbox()

    assert list(session.published) == [7]
    assert agent.store.backlog()["outbox_batches"] == 1, "acknowledged before its PUBACK"
    session.ack_all()
    assert agent.store.backlog()["outbox_batches"] == 0
    assert agent.counters["batches.acked"] == 1


@pytest.mark.timeout(60)
def test_late_pubacks_acknowledge_their_batches_once(
    agent: EdgeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = _session(agent, monkeypatch, ack_early=False)
    _seal(agent, 3)

    agent._drain_outbox()
    agent._drain_outbox()  # in flight: not sent again
    assert len(session.published) == 3
    session.ack_all()

    assert agent.store.backlog()["outbox_batches"] == 0
    assert agent.counters["batches.acked"] == 3
