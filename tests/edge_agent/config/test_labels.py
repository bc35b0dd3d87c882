"""Labels given at the manager reach the station that scored the image, once."""

import json
import time
from pathlib import Path

from conftest import make_fleet_home

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.fleet.operations import LABELS
from fedge.protocols import codec
from fedge.protocols.labels import StationLabels
from fedge.protocols.signing import SigningKey


def test_manager_labels_join_the_station_training_set_once(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path, edges=("st-01",))
    with fh.fleet() as fleet:
        fleet.store.conn.execute(
            "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, "
            "decision, threshold, config_version, latency_ms, source) "
            "VALUES ('p-1', 'st-01', 0, ?, 'inspect:1', '{}', "
            "'accept', 0.5, 1, 1.0, 'api')",
            (time.time(),),
        )
        fleet.add_label("p-1", "scratch", "operator-3")
        first = desired_store.unpublished(fleet.store, skip=set())
        fleet.add_label("p-1", "clean", "operator-3")  # a relabel: a new document version
        docs = [
            row for row in desired_store.unpublished(fleet.store, skip=set()) if row.kind == LABELS
        ]
    assert [row.version for row in first if row.kind == LABELS] == [1]
    assert [row.version for row in docs] == [2]  # the older one is superseded
    envelope = docs[0].envelope.encode()

    agent = EdgeAgent(fh.agent_settings("st-01"))
    try:
        agent.station.keep("p-1", b"png bytes", ".png")
        agent.handle_labels(envelope)
        labelled = agent.station.labelled()
        assert [(i.prediction_id, i.label) for i in labelled] == [("p-1", "clean")]
        # One label per prediction (issue 15): the document holds the current one only.
        assert agent.counters["labels.from_manager"] == 1
        assert agent.store.backlog()["pending_records"] == 0  # not sent back up
        agent.handle_labels(envelope)  # the retained copy again, e.g. on reconnect
        assert agent.counters["labels.stale"] == 1
        assert agent.counters["labels.from_manager"] == 1

        # Forged (another key) or for another edge: counted, nothing changes.
        document = codec.decode(json.loads(envelope)["payload"].encode(), StationLabels)
        forged = SigningKey.generate().sign(
            StationLabels(document.fleet, "st-01", 9, document.labels, document.issued_at)
        )
        agent.handle_labels(forged)
        other = fh.home.signing_key().sign(
            StationLabels(document.fleet, "st-02", 10, document.labels, document.issued_at)
        )
        agent.handle_labels(other)
        agent.handle_labels(b"{not json")
        rejected = sum(v for k, v in agent.counters.items() if k.startswith("labels.rejected"))
        assert rejected == 3
        assert agent.store.get("labels_version") == "2"
    finally:
        agent.store.close()
        agent.station.close()


def test_a_labels_document_always_fits_what_the_station_accepts(tmp_path: Path) -> None:
    """Long, non-ASCII operator names: the newest labels that fit are sent, never a
    document every station would refuse as oversized; old documents are not kept."""
    fh = make_fleet_home(tmp_path, edges=("st-01",))
    with fh.fleet() as fleet:
        for index in range(150):
            fleet.store.conn.execute(
                "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, "
                "decision, threshold, config_version, latency_ms, source) "
                "VALUES (?, 'st-01', 0, ?, 'inspect:1', '{}', "
                "'accept', 0.5, 1, 1.0, 'api')",
                (f"p-{index}", time.time()),
            )
            fleet.add_label(f"p-{index}", "scratch", "é" * 128)
        docs = [
            row for row in desired_store.unpublished(fleet.store, skip=set()) if row.kind == LABELS
        ]
        kept = fleet.store.scalar("SELECT count(*) FROM desired WHERE kind='labels'")
    assert [row.version for row in docs] == [150]
    assert kept == 1
    agent = EdgeAgent(fh.agent_settings("st-01"))
    try:
        agent.handle_labels(docs[0].envelope.encode())
        applied = agent.counters["labels.from_manager"]
        assert 10 < applied < 150, applied  # trimmed to fit, newest first
        assert agent.store.get("labels_version") == "150"
    finally:
        agent.store.close()
        agent.station.close()


def test_telemetry_says_what_the_station_could_train_on(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path, edges=("st-01",))
    agent = EdgeAgent(fh.agent_settings("st-01"))
    try:
        agent.station.keep("p-1", b"png bytes", ".png")
        agent.station.label("p-1", "clean")
        agent.station.keep("p-2", b"png", ".png")
        agent._emit_metrics()
        rows = agent.store._conn.execute("SELECT record FROM pending").fetchall()
        metrics = {json.loads(r[0])["name"]: json.loads(r[0])["value"] for r in rows}
    finally:
        agent.store.close()
        agent.station.close()
    assert metrics["station.images"] == 2.0
    assert metrics["station.labelled"] == 1.0
    assert metrics["training.running"] == 0.0


def test_a_relabel_at_the_manager_replaces_the_label_on_the_station(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path, edges=("st-01",))
    envelopes = []
    with fh.fleet() as fleet:
        fleet.store.conn.execute(
            "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, "
            "decision, threshold, config_version, latency_ms, source) "
            "VALUES ('p-1', 'st-01', 0, ?, 'inspect:1', '{}', "
            "'accept', 0.5, 1, 1.0, 'api')",
            (time.time(),),
        )
        for label in ("scratch", "clean"):
            fleet.add_label("p-1", label, "alice")
            (row,) = [
                r for r in desired_store.unpublished(fleet.store, skip=set()) if r.kind == LABELS
            ]
            envelopes.append(row.envelope.encode())
    agent = EdgeAgent(fh.agent_settings("st-01"))
    try:
        agent.station.keep("p-1", b"png bytes", ".png")
        for envelope in envelopes:  # the station saw the first label, then the relabel
            agent.handle_labels(envelope)
        assert [(i.prediction_id, i.label) for i in agent.station.labelled()] == [("p-1", "clean")]
    finally:
        agent.store.close()
        agent.station.close()
