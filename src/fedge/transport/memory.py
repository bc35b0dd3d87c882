"""An MQTT broker in memory: the twin of Mosquitto for fast behaviour tests and simulation.

What the agent and the manager rely on is kept: topic filters with ``+`` and ``#``;
retained messages (an empty retained payload clears one) delivered on subscribe;
QoS 0/1 with a PUBACK per publish (``on_published``), a refusal code when the ACL denies
it; persistent sessions (``clean_start=False``: subscriptions and QoS 1 messages kept
while the client is away, ``session_present`` on its return); manual acks (a message not
acked is delivered again on reconnect); wills on an abrupt disconnect, not on a clean
one; a second connection with the same client id takes the session over. A broker
outage (:meth:`MemoryBroker.stop` / :meth:`start`) and a dropped client
(:meth:`MemoryBroker.drop`) are faults tests can inject. What it leaves out: QoS 2, will
delay, message expiry, shared subscriptions, sizes and rates.

Each session calls back on a thread of its own, in order, as paho's network thread
does; the broker never calls back while holding its lock.
"""

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fedge.transport.acl import Acl, matches
from fedge.transport.errors import TransportError
from fedge.transport.link import LinkEvent, LinkState, advance
from fedge.transport.session import (
    Message,
    MqttSettings,
    OnConnect,
    OnDisconnect,
    OnMessage,
    OnPublished,
    PublishResult,
    Will,
)

log = logging.getLogger(__name__)
NOT_AUTHORIZED = 0x87
NO_MATCHING_SUBSCRIBERS = 0x10


@dataclass
class _Delivery:
    topic: str
    payload: bytes
    qos: int
    retained: bool = False


@dataclass
class _ClientState:
    subscriptions: dict[str, int] = field(default_factory=dict)
    offline: list[_Delivery] = field(default_factory=list)  # QoS 1, while away
    unacked: dict[int, _Delivery] = field(default_factory=dict)  # manual ack pending
    live: "MemorySession | None" = None
    mids: "itertools.count[int]" = field(default_factory=lambda: itertools.count(1))


class MemoryBroker:
    def __init__(self, acl: Acl | None = None) -> None:
        self.acl = acl
        self.running = True
        self._lock = threading.RLock()
        self._clients: dict[str, _ClientState] = {}
        self._retained: dict[str, _Delivery] = {}
        self._waiting: list[MemorySession] = []  # started while the broker was down

    # -- what a test or simulator does

    def session(
        self,
        settings: MqttSettings,
        *,
        on_message: OnMessage | None = None,
        on_connect: OnConnect | None = None,
        on_published: OnPublished | None = None,
        on_disconnect: OnDisconnect | None = None,
        will: Will | None = None,
        will_factory: Callable[[], Will] | None = None,
        lazy_will: bool = False,
    ) -> "MemorySession":
        """A session factory with ``MqttSession``'s signature (transport.session)."""
        return MemorySession(
            self,
            settings,
            on_message=on_message,
            on_connect=on_connect,
            on_published=on_published,
            on_disconnect=on_disconnect,
            will_factory=will_factory or ((lambda: will) if will is not None else None),
        )

    def retained(self, topic: str) -> bytes | None:
        with self._lock:
            delivery = self._retained.get(topic)
        return None if delivery is None else delivery.payload

    def stop(self) -> None:
        """An outage: every client is disconnected (no wills: the broker is gone); its
        sessions, subscriptions and retained messages survive (Mosquitto's persistence)."""
        with self._lock:
            self.running = False
            dropped = [c.live for c in self._clients.values() if c.live is not None]
            for client in self._clients.values():
                client.live = None
            self._waiting.extend(dropped)
        for session in dropped:
            session._lost("broker stopped")

    def start(self) -> None:
        """Back from an outage: the clients that want to be connected reconnect."""
        with self._lock:
            self.running = True
            waiting, self._waiting = self._waiting, []
        for session in waiting:
            session._reconnect()

    def drop(self, client_id: str) -> None:
        """The client's network fails: its will is published, then it reconnects."""
        with self._lock:
            client = self._clients.get(client_id)
            session = None if client is None else client.live
            if client is None or session is None:
                return
            client.live = None
            will = session._will
        if will is not None:
            self._route(client_id, will.topic, will.payload, will.qos, will.retain, check=False)
        session._lost("connection dropped")
        session._reconnect()

    # -- what sessions call

    def _connect(self, session: "MemorySession") -> bool:
        settings = session.settings
        with self._lock:
            if not self.running:
                self._waiting.append(session)
                return False
            client = self._clients.get(settings.client_id)
            present = client is not None and not settings.clean_start
            if client is None or settings.clean_start:
                client = _ClientState()
                self._clients[settings.client_id] = client
            taken_over = client.live if client.live is not session else None
            client.live = session
            backlog = list(client.unacked.values()) + client.offline
            client.unacked.clear()
            client.offline.clear()
        if taken_over is not None:
            taken_over._lost("session taken over")
        session._connected(present)
        for delivery in backlog:
            self._deliver(settings.client_id, delivery)
        return True

    def _disconnect(self, session: "MemorySession") -> None:
        with self._lock:
            client = self._clients.get(session.settings.client_id)
            if client is not None and client.live is session:
                client.live = None
                if session.settings.clean_start:
                    del self._clients[session.settings.client_id]
            if session in self._waiting:
                self._waiting.remove(session)

    def _subscribe(self, session: "MemorySession", topic_filter: str, qos: int) -> None:
        client_id = session.settings.client_id
        # As Mosquitto: any filter is granted; the ACL is checked per message delivered.
        with self._lock:
            client = self._clients[client_id]
            client.subscriptions[topic_filter] = qos
            retained = [d for t, d in self._retained.items() if matches(topic_filter, t)]
        for delivery in retained:
            if self.acl is not None and not self.acl(client_id, delivery.topic, "read"):
                continue
            self._deliver(
                client_id, _Delivery(delivery.topic, delivery.payload, min(qos, delivery.qos), True)
            )

    def _publish(
        self, session: "MemorySession", topic: str, payload: bytes, qos: int, retain: bool
    ) -> int | None:
        """The PUBACK's reason code; None when the broker is down (the client keeps it)."""
        with self._lock:
            client = self._clients.get(session.settings.client_id)
            if not self.running or client is None or client.live is not session:
                return None
        return self._route(session.settings.client_id, topic, payload, qos, retain, check=True)

    def _route(
        self, sender: str, topic: str, payload: bytes, qos: int, retain: bool, *, check: bool
    ) -> int:
        if check and self.acl is not None and not self.acl(sender, topic, "write"):
            return NOT_AUTHORIZED
        with self._lock:
            if retain:
                if payload:
                    self._retained[topic] = _Delivery(topic, payload, qos)
                else:
                    self._retained.pop(topic, None)
            targets: list[tuple[str, int]] = []
            for client_id, client in self._clients.items():
                granted = [q for f, q in client.subscriptions.items() if matches(f, topic)]
                if granted:
                    targets.append((client_id, min(qos, max(granted))))
        delivered = 0
        for client_id, delivery_qos in targets:
            if self.acl is not None and not self.acl(client_id, topic, "read"):
                continue
            self._deliver(client_id, _Delivery(topic, payload, delivery_qos))
            delivered += 1
        return 0 if delivered else NO_MATCHING_SUBSCRIBERS

    def _deliver(self, client_id: str, delivery: _Delivery) -> None:
        with self._lock:
            client = self._clients.get(client_id)
            if client is None:
                return
            session = client.live
            if session is None:
                if delivery.qos > 0:
                    client.offline.append(delivery)
                return
            mid = next(client.mids)
            if delivery.qos > 0 and session.settings.manual_ack:
                client.unacked[mid] = delivery
        message = Message(delivery.topic, delivery.payload, delivery.qos, delivery.retained, mid)
        session._call(session._on_message, message)

    def _ack(self, session: "MemorySession", mid: int) -> None:
        with self._lock:
            client = self._clients.get(session.settings.client_id)
            if client is not None:
                client.unacked.pop(mid, None)


def _ignore(*_: object) -> None:
    return None


class MemorySession:
    """``MqttSession``'s interface over a :class:`MemoryBroker` (see transport.session)."""

    def __init__(
        self,
        broker: MemoryBroker,
        settings: MqttSettings,
        *,
        on_message: OnMessage | None,
        on_connect: OnConnect | None,
        on_published: OnPublished | None,
        on_disconnect: OnDisconnect | None,
        will_factory: Callable[[], Will] | None,
    ) -> None:
        self.broker = broker
        self.settings = settings
        self._on_message: Callable[[Message], None] = on_message or _ignore
        self._on_connect: Callable[[bool], None] = on_connect or _ignore
        self._on_published: Callable[[PublishResult], None] = on_published or _ignore
        self._on_disconnect: Callable[[str], None] = on_disconnect or _ignore
        self._will_factory = will_factory
        self._will: Will | None = None
        self.connected = threading.Event()
        self.link = LinkState()
        self._mids = itertools.count(1)
        self._pending: list[tuple[int, str, bytes, int, bool]] = []  # queued while away
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- the Session interface

    def reload_certificate(self) -> None:
        return None  # no TLS in memory

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"memory-mqtt-{self.settings.client_id}", daemon=True
        )
        self._thread.start()
        self._reconnect()

    def stop(self, *, final: tuple[str, bytes, bool] | None = None) -> None:
        if final is not None and self.connected.is_set():
            self.broker._publish(self, final[0], final[1], 1, final[2])
        self._stopping = True
        if self.connected.is_set():
            self._note(LinkEvent.STOPPED)
        self.connected.clear()
        self.broker._disconnect(self)
        self._calls.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def subscribe(self, topic: str, qos: int = 1) -> None:
        if not self.connected.is_set():
            raise TransportError(f"subscribe to {topic!r} failed: not connected")
        self.broker._subscribe(self, topic, qos)

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> int:
        mid = next(self._mids)
        with self._lock:
            if not self.connected.is_set():
                if qos > 0:  # paho keeps QoS 1 messages for the next connection
                    self._pending.append((mid, topic, payload, qos, retain))
                return mid
        self._send(mid, topic, payload, qos, retain)
        return mid

    def publish_and_wait(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, timeout_s: float
    ) -> bool:
        """True once the broker took it (as paho's wait: no ``on_published`` call)."""
        if not self.connected.is_set():
            return False
        code = self.broker._publish(self, topic, payload, qos, retain)
        return code is not None and code < 0x80

    def ack(self, message: Message) -> None:
        if self.settings.manual_ack and message.qos > 0:
            self.broker._ack(self, message.mid)

    # -- the broker's side

    def _send(self, mid: int, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        code = self.broker._publish(self, topic, payload, qos, retain)
        if code is None:  # the connection went meanwhile: sent again on the next one
            with self._lock:
                if qos > 0:
                    self._pending.append((mid, topic, payload, qos, retain))
            return
        if qos > 0:
            reason = "Not authorized" if code == NOT_AUTHORIZED else "Success"
            self._call(self._on_published, PublishResult(mid, code, reason))

    def _reconnect(self) -> None:
        if self._stopping:
            return
        if self._will_factory is not None:
            self._will = self._will_factory()
        if not self.broker._connect(self):
            self._note(LinkEvent.UNREACHABLE)

    def _connected(self, session_present: bool) -> None:
        self._note(LinkEvent.CONNECTED)
        with self._lock:
            self.connected.set()
            pending, self._pending = self._pending, []
        self._call(self._on_connect, session_present)
        for mid, topic, payload, qos, retain in pending:
            self._send(mid, topic, payload, qos, retain)

    def _lost(self, why: str) -> None:
        self.connected.clear()
        self._note(LinkEvent.DROPPED, why)
        self._call(self._on_disconnect, why)

    def _call(self, callback: Callable[..., None], *args: object) -> None:
        self._calls.put(lambda: callback(*args))

    def _run(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            try:
                call()
            except Exception:  # a consumer bug must not stop the callbacks
                log.exception("memory mqtt callback failed (%s)", self.settings.client_id)

    def _note(self, event: LinkEvent, detail: str = "") -> None:
        self.link, _ = advance(self.link, event, at=time.time(), detail=detail)
