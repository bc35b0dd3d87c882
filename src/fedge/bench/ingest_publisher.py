"""One publisher process of the ingest benchmark.

Run as ``python -m fedge.bench.ingest_publisher``; reads a JSON spec line on stdin (broker
address, fleet, edge logins -- a password each, or under mutual TLS the paths of each
edge's certificate files --, how many records per edge, batch size, which share of
batches to send twice), then:

1. encodes every :class:`RecordBatch` up front -- the agent's outbox holds exact bytes
   too, so encoding is not part of what the manager has to keep up with;
2. connects one :class:`MqttSession` per edge (the transport the agent uses), authenticated
   as that edge (by password, or by its client certificate), and writes
   ``{"event": "ready"}``;
3. on the ``go`` command publishes everything at QoS 1, round-robin over its edges, with
   the chosen batches published a second time a few batches later (what a QoS 1
   redelivery after a reconnect looks like to the manager), and writes ``published``
   with its first-publish and all-acknowledged wall-clock times;
4. on ``stop`` disconnects and exits.
"""

import json
import random
import sys
import threading
import time
from dataclasses import dataclass

from fedge.bench.edge_login import EdgeLogin, emit
from fedge.protocols import codec, topics
from fedge.protocols.records import MetricRecord, RecordBatch, Stream
from fedge.transport.mqtt import MqttSession
from fedge.transport.session import PublishResult

REDELIVERY_LAG = 3  # a duplicate follows its original this many batches later


@dataclass(frozen=True)
class PublisherSpec:
    host: str
    port: int
    fleet: str
    edges: list[EdgeLogin]
    records_per_edge: int
    batch_records: int
    duplicate_fraction: float
    seed: int = 0
    max_inflight: int = 100

    @classmethod
    def from_json(cls, line: str) -> "PublisherSpec":
        data = json.loads(line)
        data["edges"] = [EdgeLogin.from_json(entry) for entry in data["edges"]]
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(
            {
                "host": self.host,
                "port": self.port,
                "fleet": self.fleet,
                "edges": [login.to_json() for login in self.edges],
                "records_per_edge": self.records_per_edge,
                "batch_records": self.batch_records,
                "duplicate_fraction": self.duplicate_fraction,
                "seed": self.seed,
                "max_inflight": self.max_inflight,
            }
        )


def edge_batches(edge: str, records: int, batch_records: int) -> list[bytes]:
    """The edge's telemetry, ``batch_records`` per batch, seq 0, 1, ... (the wire bytes)."""
    payloads = []
    at = time.time()
    for seq, start in enumerate(range(0, records, batch_records)):
        count = min(batch_records, records - start)
        batch = RecordBatch(
            edge,
            Stream.TELEMETRY,
            0,
            seq,
            tuple(
                MetricRecord(f"sensor_{i % 16}", float(start + i) * 0.5, at + (start + i) * 1e-3)
                for i in range(count)
            ),
        )
        payloads.append(codec.encode(batch))
    return payloads


def publish_plan(
    spec: PublisherSpec, payloads: dict[str, list[bytes]]
) -> tuple[list[tuple[str, bytes]], int]:
    """Round-robin over edges, with the chosen duplicates; returns (plan, duplicates)."""
    rng = random.Random(spec.seed)
    every = [(edge, index) for edge, batches in payloads.items() for index in range(len(batches))]
    wanted = round(len(every) * spec.duplicate_fraction)
    if spec.duplicate_fraction > 0:
        wanted = max(1, wanted)  # a small run still exercises the dedupe
    chosen = set(rng.sample(every, min(wanted, len(every))))
    per_edge: dict[str, list[bytes]] = {}
    for edge, batches in payloads.items():
        sequence: list[bytes] = []
        later: dict[int, list[bytes]] = {}
        for index, payload in enumerate(batches):
            sequence.append(payload)
            sequence.extend(later.pop(index, []))
            if (edge, index) in chosen:
                later.setdefault(index + REDELIVERY_LAG, []).append(payload)
        for rest in later.values():  # duplicates of the last batches go at the end
            sequence.extend(rest)
        per_edge[edge] = sequence
    plan: list[tuple[str, bytes]] = []
    longest = max((len(s) for s in per_edge.values()), default=0)
    for index in range(longest):
        for edge, sequence in per_edge.items():
            if index < len(sequence):
                plan.append((edge, sequence[index]))
    return plan, len(chosen)


class Publisher:
    def __init__(self, spec: PublisherSpec) -> None:
        self.spec = spec
        self.acked = 0
        self.refused = 0
        self._lock = threading.Lock()
        self.all_acked = threading.Event()
        self.expected = 0
        self.sessions = {
            login.edge: MqttSession(
                login.mqtt_settings(spec.host, spec.port, max_inflight=spec.max_inflight),
                on_published=self._on_published,
            )
            for login in spec.edges
        }

    def _on_published(self, result: PublishResult) -> None:
        with self._lock:
            self.acked += 1
            if not result.ok:
                self.refused += 1
            if self.expected and self.acked >= self.expected:
                self.all_acked.set()

    def run(self) -> None:
        payloads = {
            edge: edge_batches(edge, self.spec.records_per_edge, self.spec.batch_records)
            for edge in self.sessions
        }
        plan, duplicates = publish_plan(self.spec, payloads)
        for session in self.sessions.values():
            session.start()
        for edge, session in self.sessions.items():
            if not session.connected.wait(20):
                emit({"event": "error", "detail": f"{edge} did not connect"})
                raise SystemExit(1)
        emit(
            {
                "event": "ready",
                "batches": sum(len(p) for p in payloads.values()),
                "messages": len(plan),
                "duplicates": duplicates,
                "bytes": sum(len(p) for _, p in plan),
            }
        )
        if _command() != "go":
            return self.stop()
        topic = {e: topics.up(self.spec.fleet, e, topics.Up.TELEMETRY) for e in self.sessions}
        with self._lock:
            self.expected = len(plan)
        first = time.time()
        for edge, payload in plan:
            self.sessions[edge].publish(topic[edge], payload, qos=1)
        last = time.time()
        acked = self.all_acked.wait(300)
        emit(
            {
                "event": "published",
                "first_publish_at": first,
                "last_publish_at": last,
                "all_acked_at": time.time() if acked else None,
                "acked": self.acked,
                "refused": self.refused,
            }
        )
        _command()  # "stop" (or end of input)
        self.stop()

    def stop(self) -> None:
        for session in self.sessions.values():
            session.stop()
        emit({"event": "stopped"})


def _command() -> str:
    line = sys.stdin.readline()
    if not line.strip():
        return ""
    return str(json.loads(line).get("cmd", ""))


def main() -> None:
    Publisher(PublisherSpec.from_json(sys.stdin.readline())).run()


if __name__ == "__main__":
    main()
