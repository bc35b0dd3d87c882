"""The manager's data path under failure: every record exactly once, bad input contained.

Broker outage, SIGKILLed agent, SIGKILLed ``manager serve``, an edge that was offline
while the operator changed things, and malformed, oversized, wrongly typed or stale
messages on every topic each side subscribes to.
"""

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import (
    FLEET,
    Feeder,
    FleetHome,
    Proc,
    Processes,
    RawClient,
    agent_status,
    count_predictions,
    deploy,
    done_count,
    drop_images,
    free_port,
    prediction_for,
    publish_model,
    set_threshold,
    stage_images,
    wait_config_applied,
    wait_deploy_done,
    wait_until,
)

from fedge.edge_manager.serve import ManagerService
from fedge.protocols import codec, topics
from fedge.protocols.config import EdgeConfig
from fedge.protocols.deployment import DeploymentDesired
from fedge.transport.broker import MosquittoBroker

pytestmark = pytest.mark.integration


@dataclass
class Plant:
    """A broker run in-process (so it can be stopped and restarted) and fedge processes."""

    fh: FleetHome
    broker: MosquittoBroker
    processes: Processes
    serve: Proc | None = None
    agents: dict[str, Proc] = field(default_factory=dict)
    http_ports: dict[str, int] = field(default_factory=dict)

    def start_serve(self) -> Proc:
        ready = self.fh.root / f"serve-{len(self.processes.procs)}.ready"
        self.serve = self.processes.start("serve", "manager", "serve", "--ready-file", str(ready))
        wait_until(ready.exists, 20, "manager serve to be ready")
        return self.serve

    def with_local_api(self, edge: str) -> int:
        port = free_port()
        self.fh.set_agent_option(edge, "http_port", port)
        self.http_ports[edge] = port
        return port

    def start_agent(self, edge: str) -> Proc:
        self.agents[edge] = self.processes.start(
            edge, "agent", "run", "--config", str(self.fh.agents[edge])
        )
        return self.agents[edge]

    def status(self, edge: str) -> dict[str, Any]:
        return agent_status(self.http_ports[edge])

    def serve_v1(self, edges: list[str]) -> None:
        """Publish inspect:1, start the agents, deploy it and wait until every one serves it."""
        publish_model(self.fh, 1, seed=1)
        for edge in edges:
            self.start_agent(edge)
        deployment = deploy(self.fh, 1, edges)
        for edge in edges:
            row = wait_deploy_done(self.fh, deployment, edge)
            assert row["deploy_stage"] == "active", self.agents[edge].output()

    def gaps(self, edge: str) -> list[dict[str, Any]]:
        return self.fh.db.query("SELECT * FROM gaps WHERE edge=?", (edge,))

    def wait_all_stored(self, edge: str, n: int, timeout_s: float = 60.0) -> None:
        """Exactly ``n`` predictions of ``edge``, each once, and no open gap."""
        wait_until(
            lambda: (count_predictions(self.fh, edge), self.gaps(edge)),
            timeout_s,
            f"exactly {n} predictions of {edge}, each stored once, and no open gap",
            expect=lambda seen: seen == ({"n": n, "ids": n, "sources": n}, []),
        )


@pytest.fixture
def plant(fleet_home: FleetHome, processes: Processes) -> Iterator[Plant]:
    processes.env["FEDGE_HOME"] = str(fleet_home.home.root)
    plant = Plant(fleet_home, fleet_home.broker(), processes)
    plant.broker.start()
    try:
        yield plant
    finally:
        processes.close()  # agents first, while the broker is still there for their goodbye
        plant.broker.stop()


def _local_backlog_empty(plant: Plant, edge: str) -> bool:
    backlog = plant.status(edge)["backlog"]
    return bool(backlog == {"pending_records": 0, "outbox_batches": 0})


# ---------------------------------------------------------------- outages and crashes


def test_broker_outage_loses_and_duplicates_nothing(plant: Plant) -> None:
    edge = "st-01"
    plant.with_local_api(edge)
    plant.start_serve()
    plant.serve_v1([edge])
    inbox = plant.fh.inbox(edge)

    drop_images(inbox, "before", 30, seed=1)
    wait_until(
        lambda: done_count(inbox, "before"), 20, "30 images scored", expect=lambda n: n == 30
    )
    plant.broker.stop()
    drop_images(inbox, "during", 30, seed=2)
    wait_until(
        lambda: done_count(inbox, "during"),
        20,
        "30 images scored offline",
        expect=lambda n: n == 30,
    )
    plant.broker.start()

    plant.wait_all_stored(edge, 60)
    wait_until(lambda: _local_backlog_empty(plant, edge), 20, "the agent's outbox to drain")
    assert count_predictions(plant.fh, edge) == {"n": 60, "ids": 60, "sources": 60}
    assert plant.gaps(edge) == []
    assert plant.serve is not None and plant.serve.running()


def test_agent_sigkill_mid_stream_scores_and_stores_each_image_once(plant: Plant) -> None:
    edge = "st-01"
    plant.start_serve()
    plant.serve_v1([edge])
    inbox = plant.fh.inbox(edge)
    feeder = Feeder(stage_images(inbox, "kill", 200, seed=3), inbox, chunk=4, every_s=0.1)
    feeder.start()
    try:
        wait_until(
            lambda: done_count(inbox, "kill"), 30, "the agent to be busy", expect=lambda n: n >= 40
        )
        plant.processes.kill(plant.agents[edge])
        at_kill = done_count(inbox, "kill")
        assert at_kill < 200, "the agent finished before it could be killed mid-stream"
        plant.start_agent(edge)
        feeder.join(timeout=30)
        assert feeder.fed == 200
    finally:
        feeder.halt.set()

    plant.wait_all_stored(edge, 200)
    assert done_count(inbox, "kill") == 200
    assert list(inbox.glob("*.png")) == []
    assert list((inbox / "failed").iterdir()) == []
    assert count_predictions(plant.fh, edge) == {"n": 200, "ids": 200, "sources": 200}


def test_manager_sigkill_mid_stream_stores_every_record_once(plant: Plant) -> None:
    edges = ["st-01", "st-02"]
    serve = plant.start_serve()
    plant.serve_v1(edges)
    feeders = []
    for seed, edge in enumerate(edges):
        inbox = plant.fh.inbox(edge)
        feeders.append(
            Feeder(stage_images(inbox, f"mk-{edge}", 100, seed=seed), inbox, chunk=2, every_s=0.1)
        )
    for feeder in feeders:
        feeder.start()
    try:
        wait_until(
            lambda: plant.fh.db.scalar("SELECT count(*) FROM predictions"),
            30,
            "predictions to stream in",
            expect=lambda n: n >= 30,
        )
        plant.processes.kill(serve)
        stored_at_kill = plant.fh.db.scalar("SELECT count(*) FROM predictions")
        assert stored_at_kill < 200, "every record arrived before the manager was killed"
        # An operator change made while serve is down goes out when it is back.
        pushed = set_threshold(plant.fh, "st-01", 0.55)
        plant.start_serve()
        for feeder in feeders:
            feeder.join(timeout=30)
            assert feeder.fed == 100
    finally:
        for feeder in feeders:
            feeder.halt.set()
    wait_config_applied(plant.fh, "st-01", pushed)

    for edge in edges:
        plant.wait_all_stored(edge, 100)


def test_offline_edge_converges_to_the_latest_desired_state(plant: Plant) -> None:
    edge = "st-01"
    plant.with_local_api(edge)
    plant.start_serve()
    plant.serve_v1([edge])
    publish_model(plant.fh, 2, seed=2)
    version = set_threshold(plant.fh, edge, 0.6)
    wait_config_applied(plant.fh, edge, version)

    assert plant.processes.stop(plant.agents[edge]) == 0, "the agent must exit on SIGTERM"
    wait_until(
        lambda: plant.fh.edge_row(edge)["state"],
        10,
        "the goodbye",
        expect=lambda state: state == "offline",
    )

    def published(kind: str, version: int) -> bool:
        row = plant.fh.row(
            "SELECT published_at FROM desired WHERE edge=? AND kind=? AND version=?",
            (edge, kind, version),
        )
        return row.get("published_at") is not None

    # Two threshold pushes and a deployment, each published to the broker while it is away.
    middle = set_threshold(plant.fh, edge, 0.65)
    wait_until(lambda: published("config", middle), 10, f"config v{middle} to be published")
    latest = set_threshold(plant.fh, edge, 0.7)
    wait_until(lambda: published("config", latest), 10, f"config v{latest} to be published")
    deployment = deploy(plant.fh, 2, [edge])
    wait_until(lambda: published("deploy", 2), 10, "the deployment to be published")

    agent = plant.start_agent(edge)
    row = wait_deploy_done(plant.fh, deployment, edge)
    assert (row["deploy_stage"], row["serving"]) == ("active", "inspect:2"), agent.output()
    wait_config_applied(plant.fh, edge, latest)

    status = plant.status(edge)
    assert (status["config_version"], status["threshold"], status["serving"]) == (
        latest,
        0.7,
        "inspect:2",
    )
    applied = status["counters"].get("config.applied", 0)
    assert applied == 1, (
        f"the restarted agent applied {applied} configs to reach v{latest} "
        f"(it should apply only the latest):\n{agent.output()}"
    )
    name = drop_images(plant.fh.inbox(edge), "after", 1, seed=9)[0]
    prediction = prediction_for(plant.fh, edge, f"file:{name}")
    assert (prediction["model"], prediction["threshold"], prediction["config_version"]) == (
        "inspect:2",
        0.7,
        latest,
    )


# ---------------------------------------------------------------- bad input to the manager

INTRUDER = "st-03"


def _liveness(edge: str = INTRUDER, **changes: Any) -> dict[str, Any]:
    return {
        "schema": 1,
        "kind": "liveness",
        "edge": edge,
        "session": 5,
        "state": "online",
        "agent_version": "test",
        "serving": "",
        "applied_config_version": 0,
        "at": 1.0,
        **changes,
    }


def _telemetry(seq: int, edge: str = INTRUDER, **changes: Any) -> dict[str, Any]:
    return {
        "schema": 1,
        "kind": "record_batch",
        "edge": edge,
        "stream": "telemetry",
        "session": 5,
        "seq": seq,
        "records": [{"name": "temperature", "value": 21.5, "at": 1.0}],
        **changes,
    }


def _prediction(**changes: Any) -> dict[str, Any]:
    return {
        "prediction_id": "p-1",
        "at": 1.0,
        "model": "inspect:1",
        "scores": {"clean": 0.9, "scratch": 0.1},
        "decision": "accept",
        "threshold": 0.5,
        "config_version": 0,
        "latency_ms": 1.0,
        "source": "x",
        **changes,
    }


def _dumps(obj: object) -> bytes:
    return json.dumps(obj).encode()


def _up(kind: str) -> str:
    return f"fedge/v1/{FLEET}/{INTRUDER}/up/{kind}"


def _oversized_batch() -> bytes:
    records = [{"name": f"m{i:06d}", "value": 1.0, "at": 1.0} for i in range(7000)]
    payload = _dumps(_telemetry(50, records=records))
    assert len(payload) > 300 * 1024
    return payload


# (topic kind, payload, the reason the manager must record)
BAD_UP_MESSAGES: dict[str, tuple[str, bytes, str]] = {
    "state: invalid JSON": ("state", b"{not json", "malformed"),
    "config: invalid JSON": ("config", b"{not json", "malformed"),
    "deploy: truncated JSON": ("deploy", b"[1,", "malformed"),
    "telemetry: not UTF-8": ("telemetry", b"\xff\xfe\x00", "malformed"),
    "predictions: JSON null": ("predictions", b"null", "malformed"),
    "labels: empty": ("labels", b"", "malformed"),
    "telemetry: 300 KiB": ("telemetry", _oversized_batch(), "oversized"),
    "telemetry: seq as a string": (
        "telemetry",
        _dumps({**_telemetry(51), "seq": "51"}),
        "malformed",
    ),
    "telemetry: value NaN": (
        "telemetry",
        b'{"schema":1,"kind":"record_batch","edge":"st-03","stream":"telemetry","session":5,'
        b'"seq":52,"records":[{"name":"t","value":NaN,"at":1.0}]}',
        "malformed",
    ),
    "telemetry: schema 2": ("telemetry", _dumps(_telemetry(53, schema=2)), "malformed"),
    "telemetry: unknown field": ("telemetry", _dumps(_telemetry(54, extra=1)), "malformed"),
    "telemetry: negative seq": ("telemetry", _dumps(_telemetry(-1)), "invalid"),
    "predictions: score as a string": (
        "predictions",
        _dumps(
            _telemetry(
                55,
                stream="predictions",
                records=[_prediction(scores={"clean": "0.9"})],
            )
        ),
        "malformed",
    ),
    "labels: label is not an identifier": (
        "labels",
        _dumps(
            _telemetry(
                56,
                stream="labels",
                records=[
                    {
                        "label_id": "l-1",
                        "prediction_id": "p-1",
                        "label": "no such label!",
                        "who": "x",
                        "at": 1.0,
                    }
                ],
            )
        ),
        "invalid",
    ),
    "state: session is a boolean": ("state", _dumps(_liveness(session=True)), "malformed"),
    "state: a config report (wrong kind)": (
        "state",
        _dumps(
            {
                "schema": 1,
                "kind": "config_report",
                "edge": INTRUDER,
                "status": "applied",
                "applied_version": 1,
                "offered_version": 1,
            }
        ),
        "malformed",
    ),
    "config: unknown status": (
        "config",
        _dumps(
            {
                "schema": 1,
                "kind": "config_report",
                "edge": INTRUDER,
                "status": "maybe",
                "applied_version": 1,
                "offered_version": 1,
            }
        ),
        "malformed",
    ),
    "deploy: unknown stage": (
        "deploy",
        _dumps(
            {
                "schema": 1,
                "kind": "deploy_status",
                "edge": INTRUDER,
                "deployment_id": "d-1",
                "version": 1,
                "model_name": "inspect",
                "model_version": 1,
                "stage": "exploded",
            }
        ),
        "malformed",
    ),
    "predictions: a telemetry batch on the wrong stream topic": (
        "predictions",
        _dumps(_telemetry(57)),
        "invalid",
    ),
    "telemetry: claims to be st-01": ("telemetry", _dumps(_telemetry(58, edge="st-01")), "invalid"),
    "state: claims to be st-01": ("state", _dumps(_liveness(edge="st-01")), "invalid"),
    "an up topic the protocol does not have": ("bogus", _dumps(_telemetry(59)), "malformed"),
}


@pytest.fixture
def intruder(plant: Plant) -> Iterator[RawClient]:
    """``manager serve`` running, and a connection holding st-03's own credentials.

    No agent runs as st-03 (one would fight this client for the username-as-client-id
    session); st-03 has announced itself with a valid birth, so serve is subscribed.
    """
    plant.fh.enroll(INTRUDER)
    plant.broker.stop()  # restart with st-03's account (a reload is asynchronous)
    plant.broker = plant.fh.broker()
    plant.broker.start()
    plant.start_serve()
    client = plant.fh.client(plant.broker.port, INTRUDER)
    try:
        client.wait_connected()
        assert client.publish(_up("state"), _dumps(_liveness())) < 0x80
        wait_until(
            lambda: plant.fh.edge_row(INTRUDER).get("state"),
            20,
            "st-03's birth to be ingested",
            expect=lambda state: state == "online",
        )
        yield client
    finally:
        client.close()


def _tables(plant: Plant) -> dict[str, int]:
    return {
        table: int(plant.fh.db.scalar(f"SELECT count(*) FROM {table}"))
        for table in ("predictions", "telemetry", "labels", "deploy_events", "batches")
    }


def test_bad_messages_to_the_manager_are_counted_and_contained(
    plant: Plant, intruder: RawClient
) -> None:
    assert intruder.publish(_up("telemetry"), _dumps(_telemetry(0))) < 0x80
    wait_until(
        lambda: _tables(plant)["telemetry"], 20, "the first valid batch", expect=lambda n: n == 1
    )
    before = _tables(plant)
    edges_before = plant.fh.db.query("SELECT * FROM edges ORDER BY edge")

    for what, (kind, payload, _) in BAD_UP_MESSAGES.items():
        assert intruder.publish(_up(kind), payload) < 0x80, what
    # Stale: a batch number already stored (other content), and a will from an old session.
    stale = _telemetry(0, records=[{"name": "temperature", "value": -99.0, "at": 2.0}])
    assert intruder.publish(_up("telemetry"), _dumps(stale)) < 0x80
    old_will = _liveness(session=4, state="lost")
    assert intruder.publish(_up("state"), _dumps(old_will)) < 0x80
    # Messages from one client arrive in order: once this is stored, all the above was seen.
    assert intruder.publish(_up("telemetry"), _dumps(_telemetry(1))) < 0x80
    wait_until(
        lambda: _tables(plant)["telemetry"], 20, "the last valid batch", expect=lambda n: n == 2
    )

    rejections = plant.fh.db.query("SELECT edge, topic, reason, detail FROM rejections")
    assert Counter(r["reason"] for r in rejections) == Counter(
        reason for _, _, reason in BAD_UP_MESSAGES.values()
    ), rejections
    assert {r["edge"] for r in rejections} == {INTRUDER}
    assert _tables(plant) == {**before, "telemetry": 2, "batches": before["batches"] + 1}
    values = plant.fh.db.query("SELECT seq, value FROM telemetry ORDER BY seq")
    assert values == [{"seq": 0, "value": 21.5}, {"seq": 1, "value": 21.5}]
    stream = plant.fh.row("SELECT * FROM streams WHERE edge=? AND stream='telemetry'", (INTRUDER,))
    assert (stream["max_seq"], stream["batches"], stream["duplicates"]) == (1, 2, 1)
    assert plant.gaps(INTRUDER) == []
    edges_after = plant.fh.db.query("SELECT * FROM edges ORDER BY edge")
    for row in (*edges_before, *edges_after):
        row.pop("last_seen")  # a stored message refreshes it
    assert edges_after == edges_before, "a rejected or stale message changed an edge's state"
    assert plant.serve is not None
    assert plant.serve.running(), plant.serve.output()


def test_record_numbers_beyond_sqlite_integers_are_rejected_not_fatal(
    plant: Plant, intruder: RawClient
) -> None:
    """seq/session are u64 on the wire; SQLite stores signed 64-bit integers."""
    poison = _telemetry(2**64 - 1)
    assert intruder.publish(_up("telemetry"), _dumps(poison)) < 0x80
    assert intruder.publish(_up("telemetry"), _dumps(_telemetry(0))) < 0x80
    seen = wait_until(
        lambda: (
            _tables(plant)["telemetry"],
            plant.fh.db.scalar("SELECT count(*) FROM rejections"),
        ),
        15,
        "the valid batch stored and the out-of-range one recorded as a rejection",
        expect=lambda seen: seen == (1, 1),
    )
    assert seen == (1, 1)
    assert plant.serve is not None and plant.serve.running()


# ---------------------------------------------------------------- bad input to the agent


@dataclass
class AgentBench:
    fh: FleetHome
    service: ManagerService
    agent: Proc
    http_port: int
    config_version: int

    def counters(self) -> dict[str, int]:
        counters: dict[str, int] = agent_status(self.http_port)["counters"]
        return counters

    def publish(self, kind: topics.Down, payload: bytes) -> None:
        topic = topics.down(FLEET, "st-01", kind)
        assert self.service.mqtt.publish_and_wait(topic, payload, qos=1, timeout_s=5), topic


@pytest.fixture
def agent_bench(plant: Plant) -> Iterator[AgentBench]:
    """st-01 serving inspect:1 at threshold 0.6, its manager running in this process.

    In-process so that the test publishes as the manager user through the manager's own
    session; a second connection with that username would take the session over.
    """
    http_port = plant.with_local_api("st-01")
    service = ManagerService(plant.fh.home)
    service.start()
    try:
        plant.serve_v1(["st-01"])
        version = set_threshold(plant.fh, "st-01", 0.6)
        wait_config_applied(plant.fh, "st-01", version)
        yield AgentBench(plant.fh, service, plant.agents["st-01"], http_port, version)
    finally:
        plant.processes.close()
        service.stop()


def test_bad_documents_to_the_agent_are_counted_and_change_nothing(
    agent_bench: AgentBench,
) -> None:
    bench = agent_bench
    key = bench.fh.home.signing_key()
    applied = bench.config_version
    config = EdgeConfig(FLEET, "st-01", version=applied + 5, default_threshold=0.05)
    with bench.fh.fleet() as fleet:
        manifest = fleet.registry.get("inspect", 1).envelope.decode()
    deployment = DeploymentDesired(FLEET, "st-01", 9, "d-x", manifest)
    big = b'{"pad":"' + b"x" * (300 * 1024) + b'"}'
    config_body = codec.to_wire_obj(config)

    bad_configs = {
        b"{not json": "config.rejected.malformed",
        big: "config.rejected.oversized",
        key.sign(deployment): "config.rejected.malformed",  # a deployment on the config topic
        key.sign_payload(_dumps({**config_body, "version": "9"})): "config.rejected.malformed",
        key.sign_payload(_dumps({**config_body, "extra": 1})): "config.rejected.malformed",
        key.sign_payload(
            _dumps({**config_body, "default_threshold": 1.5})
        ): "config.rejected.invalid",
        key.sign(EdgeConfig(FLEET, "st-02", version=applied + 5)): "config.rejected.invalid",
        codec.encode(config): "config.rejected.bad_signature",  # not signed at all
        key.sign(EdgeConfig(FLEET, "st-01", applied, default_threshold=0.1)): "config.stale",
    }
    bad_deployments = {
        b"\x00\x01": "deploy.rejected.malformed",
        big: "deploy.rejected.oversized",
        key.sign(config): "deploy.rejected.malformed",  # a config on the deploy topic
        key.sign(DeploymentDesired(FLEET, "st-02", 9, "d-x", manifest)): "deploy.rejected.protocol",
        codec.encode(deployment): "deploy.rejected.bad_signature",
        key.sign(DeploymentDesired(FLEET, "st-01", 1, "d-old", manifest)): "deploy.stale",
    }
    before = bench.counters()
    for payload in bad_configs:
        bench.publish(topics.Down.CONFIG, payload)
    for payload in bad_deployments:
        bench.publish(topics.Down.DEPLOY, payload)

    expected = Counter(bad_configs.values()) + Counter(bad_deployments.values())

    def new_counts() -> dict[str, int]:
        now = bench.counters()
        return {name: now.get(name, 0) - before.get(name, 0) for name in expected}

    wait_until(
        new_counts,
        20,
        "the agent to count every bad document",
        expect=lambda counts: counts == dict(expected),
    )
    status = agent_status(bench.http_port)
    assert (status["config_version"], status["threshold"], status["serving"]) == (
        applied,
        0.6,
        "inspect:1",
    )
    assert bench.agent.running(), bench.agent.output()
    assert bench.counters().get("deploy.active", 0) == before.get("deploy.active", 0)

    # Still working: a prediction at the old threshold, then a genuine new config applies.
    name = drop_images(bench.fh.inbox("st-01"), "after-junk", 1)[0]
    prediction = prediction_for(bench.fh, "st-01", f"file:{name}")
    assert (prediction["threshold"], prediction["config_version"]) == (0.6, applied)
    version = set_threshold(bench.fh, "st-01", 0.7)
    wait_config_applied(bench.fh, "st-01", version)
