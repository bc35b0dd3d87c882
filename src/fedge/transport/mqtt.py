"""A thin MQTT v5 session over paho-mqtt that speaks plain values.

Nothing of paho leaks out: callers get a :class:`~fedge.transport.session.Message`
(topic, payload, retained, ...) and publish with plain arguments; those values and the
session's Protocol are in :mod:`fedge.transport.session`. The session is persistent
(clean start off, a session expiry), reconnects forever with capped exponential backoff
(paho's own 1 s -> 30 s), and can hand acknowledgements to the caller (``manual_ack``)
so a consumer acks a QoS 1 message only after it is safely stored.
"""

import logging
import ssl
import threading
import time
from collections.abc import Callable

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from fedge.transport.causes import LinkCause, classify, explain
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


def _noop(*_: object) -> None:
    return None


class _SocketErrors(logging.Logger):
    """What paho last logged a socket read or write failing with (not a registered
    logger: one per session, gone with it)."""

    def __init__(self) -> None:
        super().__init__("fedge.transport.mqtt.socket", logging.ERROR)
        self.last = ""

    def log(self, level: int, msg: object, *args: object, **kwargs: object) -> None:
        if level >= logging.ERROR and "socket" in str(msg):
            try:
                self.last = str(msg) % args
            except (TypeError, ValueError):
                self.last = str(msg)

    def take(self) -> str:
        last, self.last = self.last, ""
        return last


class _Client(paho.Client):
    """paho's client, keeping what its last connection attempt raised: paho swallows the
    error (``on_connect_fail`` gets none), and the error is the only thing that tells a
    network cut from a certificate the broker refused (issue 27)."""

    last_connect_error: OSError | None = None

    def reconnect(self) -> MQTTErrorCode:
        self.last_connect_error = None
        try:
            return super().reconnect()
        except OSError as exc:
            self.last_connect_error = exc
            raise


class MqttSession:
    """One client connection. Callbacks run on paho's network thread: keep them short."""

    def __init__(
        self,
        settings: MqttSettings,
        *,
        on_message: OnMessage = _noop,
        on_connect: OnConnect = _noop,
        on_published: OnPublished = _noop,
        on_disconnect: OnDisconnect = _noop,
        will: Will | None = None,
        will_factory: Callable[[], Will] | None = None,
        lazy_will: bool = False,
    ) -> None:
        self.settings = settings
        self._on_message = on_message
        self._on_connect = on_connect
        self._on_published = on_published
        self._on_disconnect = on_disconnect
        self.connected = threading.Event()
        # What the connection is doing (read by `manager serve` to report the broker).
        self.link = LinkState()
        self._link_lock = threading.Lock()
        self._stopping = False
        self._answered = False  # the broker answered (CONNACK) the current attempt
        self._client = _Client(
            CallbackAPIVersion.VERSION2,
            client_id=settings.client_id,
            protocol=paho.MQTTv5,
            manual_ack=settings.manual_ack,
        )
        if settings.username is not None:
            self._client.username_pw_set(settings.username, settings.password)
        self._ssl: ssl.SSLContext | None = None
        if settings.tls is not None:
            # Our own context (OpenSSL reads the files; the key never passes through our
            # code), so a renewed certificate can be loaded into it: the next connection
            # presents it, the current one carries on (no downtime).
            self._ssl = ssl.create_default_context(cafile=str(settings.tls.ca))
            self._ssl.minimum_version = ssl.TLSVersion.TLSv1_2
            self._ssl.load_cert_chain(str(settings.tls.cert), str(settings.tls.key))
            self._client.tls_set_context(self._ssl)
        # A factory gives every connection attempt its own will (a fresh session counter).
        self._will_factory = will_factory or ((lambda: will) if will is not None else None)
        # lazy: take the first will in start(), so a session that never connects costs nothing.
        self._lazy_will = lazy_will
        if not lazy_will:
            self._set_will()
        self._client.max_inflight_messages_set(settings.max_inflight)
        self._client.reconnect_delay_set(settings.reconnect_min_s, settings.reconnect_max_s)
        self._client.on_connect = self._handle_connect
        self._client.on_disconnect = self._handle_disconnect
        self._client.on_connect_fail = self._handle_connect_fail
        self._client.on_message = self._handle_message
        self._client.on_publish = self._handle_publish
        # paho reports a socket that failed under it (an SSL alert from the broker, a
        # reset, a timeout) only to its logger: this one keeps the error for the
        # disconnect that follows. A logger, not ``on_log``: paho formats every packet's
        # debug line for ``on_log``, while a logger at ERROR costs a level check.
        self._socket_errors = _SocketErrors()
        self._client.enable_logger(self._socket_errors)

    def _set_will(self) -> None:
        will = self._will_factory() if self._will_factory is not None else None
        if will is None:
            return
        will_props = None
        if will.delay_s:
            will_props = Properties(PacketTypes.WILLMESSAGE)  # type: ignore[no-untyped-call]
            will_props.WillDelayInterval = will.delay_s
        self._client.will_set(
            will.topic, will.payload, qos=will.qos, retain=will.retain, properties=will_props
        )

    def reload_certificate(self) -> None:
        """Present the certificate now in the TLS files from the next connection on."""
        tls = self.settings.tls
        if self._ssl is None or tls is None:
            return
        self._ssl.load_cert_chain(str(tls.cert), str(tls.key))

    # -- lifecycle

    def start(self) -> None:
        """Connect in the background; reconnects forever. Use ``connected.wait()`` to block."""
        if self._lazy_will:
            self._set_will()
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = self.settings.session_expiry_s
        if self.settings.receive_maximum is not None:
            props.ReceiveMaximum = self.settings.receive_maximum
        try:
            self._client.connect_async(
                self.settings.host,
                self.settings.port,
                keepalive=self.settings.keepalive_s,
                clean_start=self.settings.clean_start,
                properties=props,
            )
        except (OSError, ValueError) as exc:
            raise TransportError(
                f"cannot connect to {self.settings.host}:{self.settings.port}: {exc}"
            ) from exc
        self._client.loop_start()

    def stop(self, *, final: tuple[str, bytes, bool] | None = None) -> None:
        """Disconnect cleanly (no will is sent); optionally publish ``final`` first."""
        if final is not None and self.connected.is_set():
            info = self._client.publish(final[0], final[1], qos=1, retain=final[2])
            info.wait_for_publish(timeout=2.0)
        self._stopping = True
        if self.connected.is_set():
            self._note(LinkEvent.STOPPED)
        self._client.disconnect()
        self._client.loop_stop()
        self.connected.clear()

    # -- operations

    def subscribe(self, topic: str, qos: int = 1) -> None:
        result, _ = self._client.subscribe(topic, qos=qos)
        if result != paho.MQTT_ERR_SUCCESS:
            raise TransportError(f"subscribe to {topic!r} failed: {paho.error_string(result)}")

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> int:
        """Queue a publish; return its message id. Completion arrives via ``on_published``."""
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        if info.rc not in (paho.MQTT_ERR_SUCCESS, paho.MQTT_ERR_NO_CONN):
            raise TransportError(f"publish to {topic!r} failed: {paho.error_string(info.rc)}")
        return int(info.mid)

    def publish_and_wait(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, timeout_s: float
    ) -> bool:
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        try:
            info.wait_for_publish(timeout=timeout_s)
        except RuntimeError as exc:  # paho raises when the message was dropped
            raise TransportError(f"publish to {topic!r} failed: {exc}") from exc
        return bool(info.is_published())

    def ack(self, message: Message) -> None:
        if self.settings.manual_ack and message.qos > 0:
            self._client.ack(message.mid, message.qos)

    # -- paho callbacks (network thread)

    def _note(self, event: LinkEvent, detail: str = "") -> None:
        """Fold a connection event into ``link`` and log what changed (never the password)."""
        with self._link_lock:
            self.link, note = advance(self.link, event, at=time.time(), detail=detail)
        if note is not None:
            settings = self.settings
            log.log(
                note.level,
                "mqtt %s -> %s:%s: %s",
                settings.client_id,
                settings.host,
                settings.port,
                note.message,
            )

    def _explain(self, cause: LinkCause) -> str:
        return explain(cause, "the broker", f"{self.settings.host}:{self.settings.port}")

    def _handle_connect_fail(self, client: paho.Client, userdata: object) -> None:
        if self._stopping:
            return
        error = self._client.last_connect_error
        cause = classify(error)
        # A certificate problem needs a person (an error); an outage may pass.
        event = LinkEvent.REFUSED if cause.is_tls else LinkEvent.UNREACHABLE
        detail = self._explain(cause) if cause is not LinkCause.UNKNOWN else ""
        if error is not None:
            detail = f"{detail}: {error}" if detail else str(error)
        self._note(event, detail)

    def _handle_connect(
        self,
        client: paho.Client,
        userdata: object,
        flags: paho.ConnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        self._answered = True
        self._socket_errors.take()
        if reason_code.is_failure:
            self._note(LinkEvent.REFUSED, str(reason_code))
            return
        self._note(LinkEvent.CONNECTED)
        self.connected.set()
        self._on_connect(bool(flags.session_present))

    def _handle_disconnect(
        self,
        client: paho.Client,
        userdata: object,
        flags: paho.DisconnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        self.connected.clear()
        answered, self._answered = self._answered, False  # the next attempt starts afresh
        socket_error = self._socket_errors.take()
        cause = classify(socket_error) if socket_error else LinkCause.UNKNOWN
        if self._stopping:
            pass
        elif not answered:
            # Closed before any CONNACK. Under mutual TLS the broker refuses a certificate
            # (unknown CA, expired, revoked) with a TLS alert, which paho logged as the
            # socket's error; without one the socket was simply closed (a network cut, a
            # broker restarting), which is no reason to suspect the certificate.
            if cause.is_tls:
                self._note(LinkEvent.REFUSED, f"{self._explain(cause)} ({socket_error})")
            else:
                if cause is LinkCause.UNKNOWN:
                    cause = LinkCause.CLOSED
                why = f" ({socket_error})" if socket_error else ""
                self._note(
                    LinkEvent.UNREACHABLE,
                    f"the broker closed the connection before answering: "
                    f"{self._explain(cause)}{why}",
                )
        else:
            why = f"; {self._explain(cause)}" if cause is not LinkCause.UNKNOWN else ""
            self._note(LinkEvent.DROPPED, f"{reason_code}{why}")
        self._on_disconnect(str(reason_code))
        if self._will_factory is not None:
            self._set_will()  # before paho's loop reconnects

    def _handle_message(self, client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        message = Message(msg.topic, bytes(msg.payload), msg.qos, bool(msg.retain), msg.mid)
        try:
            self._on_message(message)
        except Exception:  # a consumer bug must not kill the network thread
            log.exception("message handler failed on %s", message.topic)

    def _handle_publish(
        self,
        client: paho.Client,
        userdata: object,
        mid: int,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        try:
            self._on_published(PublishResult(mid, int(reason_code.value), str(reason_code)))
        except Exception:
            log.exception("publish handler failed for mid %s", mid)
