"""What the agent and the manager need of an MQTT connection: plain values and a Protocol.

The contract lives here, not in an adapter: :class:`Message`, :class:`PublishResult`,
:class:`Will` and :class:`MqttSettings` are what callers hand over and get back, and
:class:`Session` is what they call. Two implementations ship:
:class:`fedge.transport.mqtt.MqttSession` (paho, a real broker; the only module that
imports paho) and :class:`fedge.transport.memory.MemorySession` (an in-memory broker for
fast behaviour tests and the simulator). Both call back on a thread of their own, never
on the caller's: a callback may publish, and must not find the caller's locks held.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from threading import Event
from typing import Protocol

from fedge.protocols.pki import TlsFiles
from fedge.transport.link import LinkState


@dataclass(frozen=True)
class Will:
    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True
    # MQTT 5 Will Delay: a quick reconnect does not flap the edge to "lost".
    delay_s: int = 0


@dataclass(frozen=True)
class MqttSettings:
    host: str
    port: int
    client_id: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    keepalive_s: int = 30
    session_expiry_s: int = 7 * 24 * 3600
    clean_start: bool = False
    max_inflight: int = 100
    reconnect_min_s: int = 1
    reconnect_max_s: int = 30
    manual_ack: bool = False
    # MQTT 5 Receive Maximum: how many unacknowledged QoS 1 messages the broker may have
    # out to this client (None: the broker's default, Mosquitto's max_inflight_messages).
    # A consumer that holds messages until they are stored asks for more (issue 33).
    receive_maximum: int | None = None
    # Mutual TLS with the fleet's certificates (issue 13): the broker takes the
    # certificate's name as the username, so ``username``/``password`` stay None.
    tls: TlsFiles | None = None


@dataclass(frozen=True)
class Message:
    topic: str
    payload: bytes
    qos: int
    retained: bool
    mid: int


@dataclass(frozen=True)
class PublishResult:
    mid: int
    reason_code: int
    reason: str

    @property
    def ok(self) -> bool:
        return self.reason_code < 0x80


OnMessage = Callable[[Message], None]
OnConnect = Callable[[bool], None]  # session_present
OnPublished = Callable[[PublishResult], None]
OnDisconnect = Callable[[str], None]


class Session(Protocol):
    settings: MqttSettings
    connected: Event
    link: LinkState

    def reload_certificate(self) -> None: ...

    def start(self) -> None: ...

    def stop(self, *, final: tuple[str, bytes, bool] | None = None) -> None: ...

    def subscribe(self, topic: str, qos: int = 1) -> None: ...

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> int: ...

    def publish_and_wait(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, timeout_s: float
    ) -> bool: ...

    def ack(self, message: Message) -> None: ...


class SessionFactory(Protocol):
    """``MqttSession`` itself, or ``MemoryBroker.session``."""

    def __call__(
        self,
        settings: MqttSettings,
        *,
        on_message: OnMessage = ...,
        on_connect: OnConnect = ...,
        on_published: OnPublished = ...,
        on_disconnect: OnDisconnect = ...,
        will: Will | None = None,
        will_factory: Callable[[], Will] | None = None,
        lazy_will: bool = False,
    ) -> Session: ...
