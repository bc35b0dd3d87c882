"""Watching the fleet as an operator: what edges send up, decoded, one message at a time.

The watcher connects with an operator credential (operators.py): its own broker user and
client id, read-only, so it never disturbs the manager's session. It starts clean and
its session expires on disconnect: a watcher that goes away leaves nothing queued at the
broker.
"""

import json
import queue
from dataclasses import dataclass
from typing import Any

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.security.operators import OperatorCredential
from fedge.protocols import codec, topics
from fedge.protocols.config import ConfigReport
from fedge.protocols.deployment import DeployStatus
from fedge.protocols.errors import ProtocolError
from fedge.protocols.liveness import Liveness
from fedge.protocols.records import RecordBatch
from fedge.transport.mqtt import MqttSession
from fedge.transport.session import Message


@dataclass(frozen=True)
class Seen:
    """One up-going message as plain values (``document`` is its JSON, when it decodes)."""

    edge: str
    kind: str
    retained: bool
    summary: str
    document: dict[str, Any] | None


def describe(fleet: str, topic: str, payload: bytes, retained: bool = False) -> Seen:
    """Decode one message of ``fleet``'s up/ tree; bad input is described, never raised."""
    try:
        parsed = topics.parse(topic)
        if parsed.fleet != fleet or parsed.direction is not topics.Direction.UP:
            raise ValueError(f"not an up-topic of fleet {fleet}")
        summary = _summary(topics.Up(parsed.kind), payload)
    except (ProtocolError, ValueError) as exc:
        edge = topic.split("/")[3] if topic.count("/") >= 5 else "?"
        return Seen(edge, topic.rsplit("/", 1)[-1], retained, f"undecodable: {exc}", None)
    return Seen(parsed.edge, parsed.kind, retained, summary, json.loads(payload))


def _summary(kind: topics.Up, payload: bytes) -> str:
    if kind is topics.Up.STATE:
        alive = codec.decode(payload, Liveness)
        return (
            f"{alive.state.value} session={alive.session} serving={alive.serving or '-'} "
            f"config=v{alive.applied_config_version} agent={alive.agent_version}"
        )
    if kind is topics.Up.CONFIG:
        report = codec.decode(payload, ConfigReport)
        reason = f" ({report.reason})" if report.reason else ""
        return (
            f"{report.status.value} offered=v{report.offered_version} "
            f"in-force=v{report.applied_version}{reason}"
        )
    if kind is topics.Up.DEPLOY:
        status = codec.decode(payload, DeployStatus)
        reason = f" ({status.reason})" if status.reason else ""
        return (
            f"{status.stage.value} {status.deployment_id} "
            f"{status.model_name}:{status.model_version}{reason}"
        )
    batch = codec.decode(payload, RecordBatch)
    return f"seq={batch.seq} session={batch.session} records={len(batch.records)}"


class FleetWatcher:
    """Subscribes to the fleet's up/ topics (or one edge's) with an operator credential."""

    def __init__(self, credential: OperatorCredential, edge: str | None = None) -> None:
        self.credential = credential
        self.subscription = (
            topics.fleet_up_subscription(credential.fleet)
            if edge is None
            else f"{topics.edge_root(credential.fleet, edge)}/up/+"
        )
        self._seen: queue.SimpleQueue[Seen] = queue.SimpleQueue()
        self.session = MqttSession(
            credential.mqtt(),
            on_message=self._on_message,
            on_connect=lambda _: self.session.subscribe(self.subscription, qos=1),
        )

    def _on_message(self, message: Message) -> None:
        self._seen.put(
            describe(self.credential.fleet, message.topic, message.payload, message.retained)
        )

    def start(self, timeout_s: float = 10.0) -> None:
        self.session.start()
        if not self.session.connected.wait(timeout_s):
            self.session.stop()
            where = f"{self.credential.broker_host}:{self.credential.broker_port}"
            raise ManagerError(
                f"operator {self.credential.name!r} could not connect to the broker at "
                f"{where} within {timeout_s:g}s (is it running, and is the credential current?)"
            )

    def next(self, timeout_s: float) -> Seen | None:
        try:
            return self._seen.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def stop(self) -> None:
        self.session.stop()
