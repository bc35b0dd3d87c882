"""What the agent and the manager need of an MQTT connection, as a Protocol.

Two implementations ship: :class:`fedge.transport.mqtt.MqttSession` (paho, a real
broker) and :class:`fedge.transport.memory.MemorySession` (an in-memory broker for fast
behaviour tests and the simulator). Both call back on a thread of their own, never on
the caller's: a callback may publish, and must not find the caller's locks held.
"""

from collections.abc import Callable
from threading import Event
from typing import Protocol

from fedge.transport.link import LinkState
from fedge.transport.mqtt import (
    Message,
    MqttSettings,
    OnConnect,
    OnDisconnect,
    OnMessage,
    OnPublished,
    Will,
)


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
