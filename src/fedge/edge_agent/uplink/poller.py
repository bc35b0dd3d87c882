"""Desired documents down and status documents up over gRPC, for a station without MQTT.

Issue 9 (defect 7): a station whose MQTT is blocked received no configs or deployments
at all. While ``report_via = "grpc"``, or once MQTT has been down for
``grpc_fallback_after_s``, the publisher thread polls the manager's DesiredSync every
``grpc_poll_interval_s``: it says which version of each desired document it has and
gets the newer signed envelopes, exactly the bytes the retained down/ topics carry. They
go to the agent's MQTT handlers, which verify them and dedupe by version, so a document
that both transports deliver is applied once.

While MQTT is down, the status documents the agent publishes on its retained up/ topics
(liveness, config report, deploy status) go up over DesiredSync too, and the manager
stores them with the code that stores the MQTT ones. On entering that mode the agent
states again what is in force, as a new MQTT session's birth does; since gRPC has no
will, the liveness is repeated every ``heartbeat_s`` (:data:`HEARTBEAT_S` by default,
whether a poll is due or not) so the manager marks a silent station lost within seconds
(edge_manager/fleet/liveness.py, issue 27).
"""

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from fedge.protocols.topics import Up
from fedge.transport.grpc.client import SyncError
from fedge.transport.grpc.contract import DesiredDocument, SinkResult

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.5
# Retained statuses replace their predecessor, so only refused-deployment reports (not
# retained) can pile up while the manager is unreachable; the oldest of those go first.
MAX_PENDING = 32
# A poll runs on the publisher thread: a manager that does not answer must not stall the
# outbox for long.
CALL_TIMEOUT_S = 5.0


class DesiredTransport(Protocol):
    """What the poller needs of :class:`~fedge.transport.grpc.client.DesiredClient`."""

    def fetch(self, known: Mapping[str, int], timeout_s: float = ...) -> list[DesiredDocument]: ...

    def report(self, kind: str, payload: bytes, timeout_s: float = ...) -> SinkResult: ...

    def close(self) -> None: ...


# kind (an up/ topic), payload, retained
Status = tuple[Up, bytes, bool]


def grpc_mode(
    *, report_via_grpc: bool, connected: bool, down_for_s: float, fallback_after_s: float
) -> bool:
    """Whether desired documents are polled over gRPC now."""
    if report_via_grpc:
        return True
    return not connected and fallback_after_s > 0 and down_for_s >= fallback_after_s


def queue_status(pending: tuple[Status, ...], status: Status) -> tuple[Status, ...]:
    """``pending`` with ``status`` added last.

    A retained status replaces the pending one of its kind, as on a retained topic only
    the latest counts; beyond :data:`MAX_PENDING` the oldest non-retained one is dropped.
    """
    kind, _, retained = status
    kept = [s for s in pending if not (retained and s[2] and s[0] is kind)]
    kept.append(status)
    while len(kept) > MAX_PENDING:
        oldest = next((s for s in kept if not s[2]), kept[0])
        kept.remove(oldest)
    return tuple(kept)


class DesiredPoller:
    """Runs on the publisher thread (:meth:`tick`); :meth:`offer_status` from any thread.

    Never holds its lock while calling out (gRPC, the handlers, which call into paho).
    """

    def __init__(
        self,
        *,
        report_via_grpc: bool,
        fallback_after_s: float,
        poll_interval_s: float,
        connect: Callable[[], DesiredTransport],
        mqtt_connected: Callable[[], bool],
        known_versions: Callable[[], dict[str, int]],
        handlers: Mapping[str, Callable[[bytes], None]],
        statements: Callable[[], Sequence[tuple[Up, bytes]]],
        counters: Counter[str],
        clock: Callable[[], float] = time.monotonic,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self._report_via_grpc = report_via_grpc
        # gRPC has no will: its heartbeat cannot be turned off, only slowed.
        self._heartbeat_s = heartbeat_s if heartbeat_s > 0 else 30.0
        self._fallback_after_s = fallback_after_s
        self._poll_interval_s = poll_interval_s
        self._connect = connect
        self._mqtt_connected = mqtt_connected
        self._known_versions = known_versions
        self._handlers = handlers
        self._statements = statements
        self.counters = counters
        self._clock = clock
        self._client: DesiredTransport | None = None
        self._last_connected = clock()  # an agent that never connects falls back in time
        self._next_poll = 0.0
        self._next_heartbeat = 0.0
        self._active = False
        # sha256 of the last envelope handed over, per kind: an envelope the handler did not
        # apply (refused, or a deployment still downloading) comes back on every poll and is
        # handled once, as a retained message is once per MQTT session.
        self._handed: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._sending = False  # statuses go over gRPC (guarded by _lock)
        self._pending: tuple[Status, ...] = ()  # guarded by _lock

    @property
    def active(self) -> bool:
        """Polling over gRPC (report_via = "grpc", or MQTT down long enough)."""
        return self._active

    def offer_status(self, kind: Up, payload: bytes, *, retained: bool = True) -> None:
        """A status the agent just published on MQTT; queued for gRPC while MQTT is down."""
        with self._lock:
            if self._sending:
                self._pending = queue_status(self._pending, (kind, payload, retained))

    def tick(self) -> None:
        """One publisher-loop step: poll if due, send pending statuses while MQTT is down."""
        now = self._clock()
        connected = self._mqtt_connected()
        if connected:
            self._last_connected = now
        active = grpc_mode(
            report_via_grpc=self._report_via_grpc,
            connected=connected,
            down_for_s=now - self._last_connected,
            fallback_after_s=self._fallback_after_s,
        )
        if active != self._active:
            self._active = active
            self._next_poll = now
            self.counters["desired.grpc_mode" if active else "desired.mqtt_mode"] += 1
            if self._report_via_grpc:
                log.info("polling desired documents over gRPC (report_via = grpc)")
            elif active:
                log.warning(
                    "MQTT down for %.0f s: polling desired documents over gRPC",
                    now - self._last_connected,
                )
            else:
                log.warning("MQTT is back: desired documents from MQTT only")
        self._set_sending(active and not connected, now)
        if not active:
            return
        poll_due = now >= self._next_poll
        beat_due = not connected and now >= self._next_heartbeat
        if not poll_due and not beat_due:
            return
        if poll_due:
            self._next_poll = now + self._poll_interval_s
        try:
            if self._client is None:
                self._client = self._connect()  # SyncError: unreadable TLS files
            if not connected:
                if beat_due:
                    self._next_heartbeat = now + self._heartbeat_s
                    self._heartbeat()
                self._send_pending(self._client)
            if poll_due:
                self._fetch(self._client)
        except SyncError as exc:
            self.counters["desired.poll_failed"] += 1
            log.warning("desired-document poll failed, will retry: %s", exc)

    def farewell(self, payload: bytes, timeout_s: float = 2.0) -> None:
        """Best effort: the goodbye liveness over gRPC, if that is where statuses go."""
        with self._lock:
            sending = self._sending
        if not sending or self._client is None:
            return
        try:
            self._client.report(Up.STATE.value, payload, timeout_s=timeout_s)
        except SyncError as exc:
            log.warning("goodbye over gRPC not delivered: %s", exc)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- internals

    def _set_sending(self, sending: bool, now: float) -> None:
        with self._lock:
            was, self._sending = self._sending, sending
            if not sending:
                # MQTT carries them again: paho sends what it queued, and the new
                # session's birth re-states the rest.
                self._pending = ()
        if sending and not was:
            # Like a birth: the liveness, then what is in force.
            self._next_heartbeat = now + self._heartbeat_s
            self._restate(self._statements())

    def _heartbeat(self) -> None:
        self._restate([(kind, payload) for kind, payload in self._statements() if kind is Up.STATE])

    def _restate(self, statements: Sequence[tuple[Up, bytes]]) -> None:
        """Queue ``statements`` unless a status of their kind is pending already.

        The pending one stays: it is the last the agent offered, and the agent offers a
        status right after it changes what it states, so a statement read meanwhile may
        be older but is never newer for longer than that.
        """
        with self._lock:
            for kind, payload in statements:
                fresher = any(s[0] is kind and s[2] for s in self._pending)
                if self._sending and not fresher:
                    self._pending = queue_status(self._pending, (kind, payload, True))

    def _send_pending(self, client: DesiredTransport) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                status = self._pending[0]
            kind, payload, _ = status
            try:
                result = client.report(kind.value, payload, timeout_s=CALL_TIMEOUT_S)
            except SyncError as exc:
                if not exc.refused:
                    raise  # kept: sent again at the next poll
                result = SinkResult(accepted=False, error=str(exc))
            with self._lock:
                self._pending = tuple(s for s in self._pending if s is not status)
            if result.accepted:
                self.counters[f"status.grpc.{kind.value}"] += 1
            else:
                # Sending it again cannot help; the manager recorded why.
                self.counters["status.grpc_refused"] += 1
                log.error("manager refused the %s report: %s", kind.value, result.error)

    def _fetch(self, client: DesiredTransport) -> None:
        for doc in client.fetch(self._known_versions(), timeout_s=CALL_TIMEOUT_S):
            handler = self._handlers.get(doc.kind)
            if handler is None:
                self.counters["desired.grpc_unknown_kind"] += 1
                log.warning("ignored a desired document of unknown kind %r", doc.kind[:40])
                continue
            digest = hashlib.sha256(doc.envelope).digest()
            if self._handed.get(doc.kind) == digest:
                continue
            self._handed[doc.kind] = digest
            self.counters[f"desired.grpc.{doc.kind}"] += 1
            try:
                handler(doc.envelope)
            except Exception:  # one handler's bug must not starve the other kinds
                log.exception("handling a %s document from gRPC failed", doc.kind)
