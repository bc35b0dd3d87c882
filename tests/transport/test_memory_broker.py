"""The in-memory broker behaves as Mosquitto does where fedge relies on it.

Each contract test runs twice, against a real Mosquitto (fleet ACL, passwords) and
against the twin (transport/memory.py) with the same ACL, through the same Session
interface. Faults only the twin can inject (a dropped client's will) are tested on it.
"""

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import free_port, wait_until

from fedge.protocols import topics
from fedge.transport.acl import fleet_acl, matches
from fedge.transport.broker import FleetAccess, MosquittoBroker
from fedge.transport.memory import MemoryBroker
from fedge.transport.mqtt import MqttSession
from fedge.transport.session import Message, MqttSettings, PublishResult, Session, Will

FLEET = "plant-a"
ACCESS = FleetAccess(FLEET, "manager", "m-secret", {"st-01": "one-secret", "st-02": "two-secret"})
PASSWORDS = {"manager": "m-secret", "st-01": "one-secret", "st-02": "two-secret"}


@dataclass
class Client:
    session: Session
    messages: "queue.SimpleQueue[Message]" = field(default_factory=queue.SimpleQueue)
    acks: "queue.SimpleQueue[PublishResult]" = field(default_factory=queue.SimpleQueue)
    connects: "queue.SimpleQueue[bool]" = field(default_factory=queue.SimpleQueue)

    def next_message(self, timeout_s: float = 5.0) -> Message:
        return self.messages.get(timeout=timeout_s)

    def nothing_within(self, seconds: float) -> bool:
        try:
            self.messages.get(timeout=seconds)
        except queue.Empty:
            return True
        return False


Connect = Callable[..., Client]


@pytest.fixture(params=[pytest.param("mosquitto", marks=pytest.mark.integration), "memory"])
def connect(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Connect]:
    clients: list[Client] = []
    broker: MosquittoBroker | None = None
    memory = MemoryBroker(acl=fleet_acl(ACCESS))
    if request.param == "mosquitto":
        broker = MosquittoBroker(tmp_path, ACCESS, free_port())
        broker.start()

    def make(identity: str, *, clean_start: bool = True, manual_ack: bool = False) -> Client:
        settings = MqttSettings(
            "127.0.0.1",
            broker.port if broker is not None else 0,
            identity,
            username=identity,
            password=PASSWORDS[identity],
            clean_start=clean_start,
            manual_ack=manual_ack,
        )
        client: Client | None = None

        def on_message(message: Message) -> None:
            assert client is not None
            client.messages.put(message)

        def on_published(result: PublishResult) -> None:
            assert client is not None
            client.acks.put(result)

        def on_connect(present: bool) -> None:
            assert client is not None
            client.connects.put(present)

        factory = MqttSession if broker is not None else memory.session
        client = Client(
            factory(
                settings, on_message=on_message, on_published=on_published, on_connect=on_connect
            )
        )
        client.session.start()
        wait_until(client.session.connected.is_set, 10, f"{identity} to connect")
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.session.stop()
    if broker is not None:
        broker.stop()


def down(edge: str, kind: topics.Down = topics.Down.CONFIG) -> str:
    return topics.down(FLEET, edge, kind)


def up(edge: str, kind: topics.Up = topics.Up.STATE) -> str:
    return topics.up(FLEET, edge, kind)


def test_retained_documents_reach_their_edge_only_and_an_empty_one_clears(
    connect: Connect,
) -> None:
    manager = connect("manager")
    manager.session.publish(down("st-01"), b"v1", qos=1, retain=True)
    assert manager.acks.get(timeout=5).ok
    one = connect("st-01")
    one.session.subscribe(topics.edge_subscription(FLEET, "st-01"))
    got = one.next_message()
    assert (got.topic, got.payload, got.retained) == (down("st-01"), b"v1", True)
    # Another edge may subscribe to st-01's documents, and receives none of them.
    two = connect("st-02")
    two.session.subscribe(topics.edge_subscription(FLEET, "st-01"))
    manager.session.publish(down("st-01"), b"v2", qos=1, retain=True)
    live = one.next_message()
    assert (live.payload, live.retained) == (b"v2", False)
    assert two.nothing_within(0.5)
    manager.session.publish(down("st-01"), b"", qos=1, retain=True)
    one.next_message()  # the clearing itself is delivered to a live subscriber
    late = connect("st-01", clean_start=True)
    late.session.subscribe(topics.edge_subscription(FLEET, "st-01"))
    assert late.nothing_within(0.5)


def test_an_edge_cannot_write_where_it_may_not(connect: Connect) -> None:
    manager = connect("manager")
    manager.session.subscribe(topics.fleet_up_subscription(FLEET))
    one = connect("st-01")
    one.session.publish(up("st-02"), b"forged", qos=1)  # another edge's up/ topic
    one.session.publish(down("st-01"), b"forged", qos=1)  # its own down/ topic
    one.session.publish(up("st-01"), b"mine", qos=1)
    assert manager.next_message().payload == b"mine"
    assert manager.nothing_within(0.5)
    results = [one.acks.get(timeout=5) for _ in range(3)]
    assert [(r.reason_code, r.ok) for r in results] == [(135, False), (135, False), (0, True)]


def test_a_persistent_session_keeps_what_came_while_away(connect: Connect) -> None:
    first = connect("st-01", clean_start=False)
    first.session.subscribe(topics.edge_subscription(FLEET, "st-01"))
    assert first.connects.get(timeout=5) is False
    first.session.stop()
    manager = connect("manager")
    manager.session.publish(down("st-01", topics.Down.DEPLOY), b"while away", qos=1)
    assert manager.acks.get(timeout=5).ok
    back = connect("st-01", clean_start=False)
    assert back.connects.get(timeout=5) is True  # session present
    got = back.next_message()
    assert (got.topic, got.payload) == (down("st-01", topics.Down.DEPLOY), b"while away")


def test_a_message_not_acked_is_delivered_again_after_a_reconnect(connect: Connect) -> None:
    manager = connect("manager", clean_start=False, manual_ack=True)
    manager.session.subscribe(topics.fleet_up_subscription(FLEET))
    one = connect("st-01")
    one.session.publish(up("st-01", topics.Up.PREDICTIONS), b"batch-1", qos=1)
    assert manager.next_message().payload == b"batch-1"
    manager.session.stop()  # not acked: as if killed between receiving and storing
    again = connect("manager", clean_start=False, manual_ack=True)
    redelivered = again.next_message()
    assert redelivered.payload == b"batch-1"
    again.session.ack(redelivered)


# ---------------------------------------------------------------- the twin only


def test_topic_filters() -> None:
    assert matches("a/+/c", "a/b/c") and not matches("a/+/c", "a/b/d")
    assert matches("a/#", "a/b/c")
    # MQTT 3.1.1 section 4.7.1.2 (and 5.0 section 4.7.1.2): "sport/#" also matches the
    # singular "sport", since # includes the parent level; "sport/+" does not match
    # "sport" but does match "sport/" (an empty level).
    assert matches("a/#", "a") is True
    assert matches("a/+", "a") is False and matches("a/+", "a/") is True
    assert not matches("a/+", "a/b/c") and matches("#", "x/y")


def test_a_dropped_client_leaves_its_will_and_comes_back() -> None:
    broker = MemoryBroker(acl=fleet_acl(ACCESS))
    seen: queue.SimpleQueue[Message] = queue.SimpleQueue()
    manager = broker.session(MqttSettings("", 0, "manager"), on_message=seen.put)
    manager.start()
    wait_until(manager.connected.is_set, 5, "the manager")
    manager.subscribe(topics.fleet_up_subscription(FLEET))
    wills = iter([b"lost-1", b"lost-2"])
    connected = threading.Event()
    edge = broker.session(
        MqttSettings("", 0, "st-01"),
        will_factory=lambda: Will(up("st-01"), next(wills)),
        on_connect=lambda present: connected.set(),
    )
    edge.start()
    wait_until(connected.is_set, 5, "st-01")
    edge.stop()  # a clean stop leaves no will
    broker.drop("st-01")  # not connected any more: nothing happens
    edge2 = broker.session(
        MqttSettings("", 0, "st-01"), will_factory=lambda: Will(up("st-01"), b"lost")
    )
    edge2.start()
    broker.drop("st-01")
    assert seen.get(timeout=5).payload == b"lost"
    assert broker.retained(up("st-01")) == b"lost"
    wait_until(edge2.connected.is_set, 5, "st-01 to reconnect")
    edge2.stop()
    manager.stop()
