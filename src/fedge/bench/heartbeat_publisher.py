"""One process of simulated stations for ``fedge bench heartbeat``.

Run as ``python -m fedge.bench.heartbeat_publisher``; reads a JSON spec line on stdin
(broker address, fleet, edge logins, ``heartbeat_s``), then:

1. connects one :class:`MqttSession` per edge (the agent's transport, its 30 s keepalive)
   and writes ``{"event": "ready"}``;
2. on ``{"cmd": "go"}`` repeats each edge's birth every ``heartbeat_s`` as the agent's
   ``_heartbeat`` does (QoS 0, not retained, session 1), the edges' phases spread evenly
   over one interval so the load is steady, as a fleet's is; ``heartbeat_s`` 0 sends
   nothing (the sessions only keep their keepalive: the fleet before heartbeats);
3. on ``{"cmd": "silence", "edges": [...]}`` stops those edges' heartbeats (their link
   is cut as far as the manager's sweep can tell) and writes ``silenced`` with the wall
   clock of each one's last heartbeat;
4. on ``{"cmd": "stop"}`` (or end of input) writes ``stopped`` with how many heartbeats
   it sent, disconnects and exits.
"""

import json
import sys
import threading
import time
from dataclasses import dataclass

from fedge.bench.edge_login import EdgeLogin, emit
from fedge.protocols import codec, topics
from fedge.protocols.liveness import EdgeState, Liveness
from fedge.transport.mqtt import MqttSession

SESSION = 1  # the session the bench stored for every edge (a live station's birth)


@dataclass(frozen=True)
class HeartbeatSpec:
    host: str
    port: int
    fleet: str
    edges: list[EdgeLogin]
    heartbeat_s: float

    @classmethod
    def from_json(cls, line: str) -> "HeartbeatSpec":
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
                "heartbeat_s": self.heartbeat_s,
            }
        )


def birth(edge: str) -> bytes:
    """What the agent's heartbeat sends: its birth, ONLINE, in its session."""
    return codec.encode(Liveness(edge, SESSION, EdgeState.ONLINE, "bench", "", 0, time.time()))


def phases(edges: list[str], heartbeat_s: float, start: float) -> dict[str, float]:
    """Each edge's first heartbeat, spread evenly over one interval from ``start``."""
    count = max(1, len(edges))
    return {edge: start + heartbeat_s * index / count for index, edge in enumerate(edges)}


class Stations:
    def __init__(self, spec: HeartbeatSpec) -> None:
        self.spec = spec
        self.sessions = {
            login.edge: MqttSession(login.mqtt_settings(spec.host, spec.port))
            for login in spec.edges
        }
        self.sent = 0
        self.last_beat: dict[str, float] = {}
        self._silent: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def connect(self) -> None:
        for session in self.sessions.values():
            session.start()
        for edge, session in self.sessions.items():
            if not session.connected.wait(60):
                emit({"event": "error", "detail": f"{edge} did not connect"})
                raise SystemExit(1)
        emit({"event": "ready", "edges": len(self.sessions)})

    def beat(self) -> None:
        """The heartbeat loop: one thread, each edge at its own phase."""
        if self.spec.heartbeat_s <= 0:
            return
        topic = {e: topics.up(self.spec.fleet, e, topics.Up.STATE) for e in self.sessions}
        due = phases(sorted(self.sessions), self.spec.heartbeat_s, time.monotonic())
        while not self._stop.is_set():
            edge = min(due, key=due.__getitem__)
            wait = due[edge] - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                return
            due[edge] += self.spec.heartbeat_s
            with self._lock:
                if edge in self._silent:
                    continue
                self.sessions[edge].publish(topic[edge], birth(edge), qos=0)
                self.sent += 1
                self.last_beat[edge] = time.time()

    def silence(self, edges: list[str]) -> dict[str, float | None]:
        with self._lock:
            self._silent.update(edges)
            return {edge: self.last_beat.get(edge) for edge in edges}

    def stop(self) -> None:
        self._stop.set()
        for session in self.sessions.values():
            session.stop()


def main() -> None:
    stations = Stations(HeartbeatSpec.from_json(sys.stdin.readline()))
    stations.connect()
    beating: threading.Thread | None = None
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        cmd = command.get("cmd")
        if cmd == "go" and beating is None:
            beating = threading.Thread(target=stations.beat, name="heartbeats", daemon=True)
            beating.start()
            emit({"event": "beating"})
        elif cmd == "silence":
            emit({"event": "silenced", "last_beat": stations.silence(list(command["edges"]))})
        elif cmd == "stop":
            break
    stations.stop()
    if beating is not None:
        beating.join(timeout=5)
    emit({"event": "stopped", "sent": stations.sent})


if __name__ == "__main__":
    main()
