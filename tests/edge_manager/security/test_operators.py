"""Operator accounts (issue 9, defect 5): tools watch the fleet under their own identity.

Before them, a tool used the manager's broker user; the broker takes the username as the
client id, so the tool took over the manager's session and its clean start lost the
manager's queued telemetry. These tests run the real Mosquitto, the real manager service
and the real ``fedge`` command.
"""

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import EDGES, FLEET, FleetHome, Processes, RawClient, refused, wait_until

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.watch import describe
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.security.operators import add_operator, load_credential
from fedge.edge_manager.serve import ManagerService
from fedge.protocols import codec, topics
from fedge.protocols.liveness import EdgeState, Liveness
from fedge.protocols.records import MetricRecord, RecordBatch, Stream
from fedge.transport.broker import FleetAccess
from fedge.transport.errors import BrokerError

ROUNDS = 4  # telemetry batches per edge before, while and after the operator connects


def _telemetry(edge: str, seq: int) -> bytes:
    record = MetricRecord("latency_ms", float(seq), 1.0)
    return codec.encode(RecordBatch(edge, Stream.TELEMETRY, 1, seq, (record,)))


@pytest.fixture
def home_env(fleet_home: FleetHome, processes: Processes) -> Iterator[FleetHome]:
    processes.env["FEDGE_HOME"] = str(fleet_home.home.root)
    yield fleet_home


@pytest.mark.integration
def test_an_operator_watches_with_its_own_identity_and_writes_nothing(
    home_env: FleetHome, processes: Processes, tmp_path: Path
) -> None:
    fh = home_env
    broker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    clients: list[RawClient] = []
    try:
        service.start()
        wait_until(service.mqtt.connected.is_set, 10, "the manager's MQTT session")
        edges = {edge: fh.client(broker.port, edge) for edge in EDGES}
        clients += edges.values()
        for edge, client in edges.items():
            client.wait_connected()
            assert client.subscribe(topics.edge_subscription(FLEET, edge)) == [1]
        next_seq = dict.fromkeys(EDGES, 0)

        def publish_round() -> None:
            for edge, client in edges.items():
                topic = topics.up(FLEET, edge, topics.Up.TELEMETRY)
                assert client.publish(topic, _telemetry(edge, next_seq[edge])) < 0x80
                next_seq[edge] += 1

        def wait_stored(n: int) -> None:
            wait_until(
                lambda: fh.db.query(
                    "SELECT edge, max_seq, batches FROM streams WHERE stream='telemetry' "
                    "ORDER BY edge"
                ),
                20,
                f"{n} telemetry batches of every edge at the manager",
                expect=lambda rows: (
                    rows == [{"edge": e, "max_seq": n - 1, "batches": n} for e in EDGES]
                ),
            )

        publish_round()
        wait_stored(1)

        # The broker is running: `operator add` reloads it, the credential works at once.
        path = tmp_path / "ops.operator.toml"
        result = processes.cli("manager", "operator", "add", "ops", "--out", str(path))
        credential = load_credential(path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        # A certificate of role "operator": no password, and its key is nowhere printed.
        assert credential.tls is not None and credential.password == ""
        key_body = credential.tls.key.read_text().splitlines()[1]
        assert key_body not in result.stdout + result.stderr
        assert (credential.fleet, credential.name, credential.broker_port) == (
            FLEET,
            "ops",
            broker.port,
        )
        for _ in range(ROUNDS):
            publish_round()
        # Connected the way the old tools did (clean start), under its own client id.
        operator = fh.client(broker.port, credential.name)
        clients.append(operator)
        operator.wait_connected()
        assert operator.subscribe(f"{topics.ROOT}/{FLEET}/#") == [1]
        for _ in range(ROUNDS):
            publish_round()
        wait_until(
            lambda: len(operator.received(f"{topics.ROOT}/{FLEET}/st-02/up/telemetry")),
            10,
            "the operator to see st-02's telemetry",
            expect=lambda n: n == ROUNDS,
        )

        # Nothing an operator writes is accepted: neither documents edges act on, nor
        # reports in an edge's name (seq 1000 would open a gap at the manager).
        forged = {
            topics.down(FLEET, "st-01", topics.Down.CONFIG): b"self-issued config",
            topics.down(FLEET, "st-01", topics.Down.DEPLOY): b"self-issued deployment",
            topics.up(FLEET, "st-01", topics.Up.TELEMETRY): _telemetry("st-01", 1000),
            topics.up(FLEET, "st-01", topics.Up.STATE): b"{}",
            "elsewhere/topic": b"{}",
        }
        for topic, payload in forged.items():
            assert operator.publish(topic, payload) >= 0x80, topic
        for _ in range(ROUNDS):
            publish_round()

        # The manager kept its session: every batch of every edge stored once, no gap,
        # nothing rejected, and the broker never closed its connection for another client.
        wait_stored(1 + 3 * ROUNDS)
        assert fh.db.query("SELECT * FROM gaps") == []
        assert fh.db.query("SELECT * FROM rejections") == []
        assert service.counters["rejected"] == 0
        assert "already connected" not in broker.log_path.read_text()
        # The edges got no document, and the operator saw only what the edges wrote.
        wait_until(
            lambda: len(operator.messages),
            10,
            "the operator to see every batch published since it subscribed",
            expect=lambda n: n == len(EDGES) * 2 * ROUNDS,
        )
        for client in edges.values():
            assert client.messages == []
        assert {topic for topic, _ in operator.messages} == {
            topics.up(FLEET, edge, topics.Up.TELEMETRY) for edge in EDGES
        }

        # Removing the operator revokes its certificate: the broker refuses it from then on
        # and its open session (out of the ACL) receives nothing more.
        processes.cli("manager", "operator", "remove", "ops")
        refused(broker.port, tls=credential.tls)
        seen = len(operator.messages)
        publish_round()
        wait_stored(2 + 3 * ROUNDS)
        assert len(operator.messages) == seen
    finally:
        for client in clients:
            client.close()
        service.stop()
        broker.stop()


@pytest.mark.integration
def test_operator_names_must_not_collide_with_edges_or_the_manager(
    home_env: FleetHome, processes: Processes, tmp_path: Path
) -> None:
    out = str(tmp_path / "x.toml")
    for name, message in (
        ("st-01", "'st-01' is an enrolled edge; operators need names of their own"),
        ("fedge-manager", "'fedge-manager' is the manager's own broker user; pick another name"),
        ("no/slash", "operator name 'no/slash' is not a valid identifier"),
    ):
        result = processes.cli("manager", "operator", "add", name, "--out", out, expect=1)
        assert message in result.stderr
        assert not Path(out).exists()
    processes.cli("manager", "operator", "add", "ops", "--out", out)
    again = processes.cli("manager", "operator", "add", "ops", "--out", out, expect=1)
    assert "operator 'ops' exists; remove it first" in again.stderr
    # ... and an edge cannot be enrolled under an operator's (or the manager's) name.
    for name in ("ops", "fedge-manager"):
        enrolled = processes.cli(
            "edge", "enroll", name, "--out", str(tmp_path / f"{name}.toml"), expect=1
        )
        assert f"'{name}' is" in enrolled.stderr
    missing = processes.cli("manager", "operator", "remove", "nobody", expect=1)
    assert "no operator 'nobody' (operators: ops)" in missing.stderr


@pytest.mark.integration
def test_operator_list_shows_names_never_secrets(
    home_env: FleetHome, processes: Processes, tmp_path: Path
) -> None:
    empty = processes.cli("manager", "operator", "list")
    assert "no operators" in empty.stdout
    printed = processes.cli("manager", "operator", "add", "alice", "--out", "-").stdout
    processes.cli("manager", "operator", "add", "bob", "--out", str(tmp_path / "bob.toml"))
    alice = load_credential(_write(tmp_path / "alice.toml", printed))
    assert alice.tls is not None
    key_body = alice.tls.key.read_text().splitlines()[1]
    assert "PRIVATE KEY" not in printed  # the credential names its key file, never its bytes
    listed = processes.cli("manager", "operator", "list", "--json").stdout
    assert [o["name"] for o in json.loads(listed)] == ["alice", "bob"]
    assert key_body not in listed + processes.cli("manager", "operator", "list").stdout
    # The manager home keeps the keys 0600.
    assert stat.S_IMODE(os.stat(alice.tls.key).st_mode) == 0o600


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_broker_refuses_a_user_name_used_twice() -> None:
    with pytest.raises(BrokerError, match="st-01 are used twice"):
        FleetAccess(FLEET, "mgr", "pw", {"st-01": "a"}, {"st-01": "b"})
    with pytest.raises(BrokerError, match="mgr are used twice"):
        FleetAccess(FLEET, "mgr", "pw", {}, {"mgr": "b"})


def test_an_operator_reads_the_fleet_and_writes_nothing_in_the_acl() -> None:
    access = FleetAccess(FLEET, "mgr", "pw", {"st-01": "a"}, {"ops": "b"})
    block = access.acl_text().split("user ops\n", 1)[1].split("\n\n", 1)[0].strip()
    assert block == f"topic read fedge/v1/{FLEET}/#"


def test_a_missing_or_broken_credential_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ManagerError, match="cannot read operator credential"):
        load_credential(tmp_path / "absent.toml")
    with pytest.raises(ManagerError, match="is not an operator credential"):
        load_credential(_write(tmp_path / "agent.toml", 'fleet = "plant-a"\n'))


def test_describe_decodes_up_messages_and_never_raises() -> None:
    seen = describe(FLEET, topics.up(FLEET, "st-01", topics.Up.TELEMETRY), _telemetry("st-01", 7))
    assert (seen.edge, seen.kind) == ("st-01", "telemetry")
    assert seen.summary == "seq=7 session=1 records=1"
    assert seen.document is not None and seen.document["seq"] == 7
    bad = describe(FLEET, topics.up(FLEET, "st-01", topics.Up.STATE), b"not json")
    assert bad.summary.startswith("undecodable") and bad.document is None
    foreign = describe(FLEET, "fedge/v1/plant-b/st-01/up/state", b"{}")
    assert foreign.summary.startswith("undecodable")


def test_a_home_without_operators_still_loads(tmp_path: Path) -> None:
    from conftest import make_fleet_home

    fh = make_fleet_home(tmp_path, edges=())
    assert not fh.home.operators_path.exists()
    assert ManagerHome(fh.home.root).operator_accounts() == {}
    credential = add_operator(fh.home, "ops")
    assert credential.name == "ops"


@pytest.mark.integration
def test_watch_prints_the_fleet_decoded_with_an_operator_credential(
    home_env: FleetHome, processes: Processes, tmp_path: Path
) -> None:
    broker = home_env.broker()
    broker.start()
    edge = home_env.client(broker.port, "st-01")
    try:
        edge.wait_connected()
        birth = Liveness("st-01", 3, EdgeState.ONLINE, "1.0", "inspect:1", 2, 1.0)
        topic = topics.up(FLEET, "st-01", topics.Up.STATE)
        assert edge.publish(topic, codec.encode(birth), retain=True) < 0x80
        path = tmp_path / "ops.operator.toml"
        processes.cli("manager", "operator", "add", "ops", "--out", str(path))

        # The retained birth is there for a watcher that subscribes after it was sent.
        watched = processes.cli(
            "manager", "watch", "--credential", str(path), "--count", "1", "--seconds", "20"
        )
        assert watched.stdout.strip() == (
            "st-01 state (retained): online session=3 serving=inspect:1 config=v2 agent=1.0"
        )
        as_json = processes.cli(
            "manager", "watch", "--operator", "ops", "--edge", "st-01", "--count", "1", "--json"
        )
        line = json.loads(as_json.stdout)
        assert (line["edge"], line["kind"], line["message"]["session"]) == ("st-01", "state", 3)
        # Two watchers one after the other: the second never took a session over.
        assert "already connected" not in broker.log_path.read_text()
        both = processes.cli("manager", "watch", expect=1)
        assert "give exactly one of --credential FILE or --operator NAME" in both.stderr
    finally:
        edge.close()
        broker.stop()
