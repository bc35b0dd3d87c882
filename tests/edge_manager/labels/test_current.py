"""One current label per prediction at the manager; relabels recorded (issue 15)."""

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home, publish_model
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_manager.home.layout import ManagerSettings
from fedge.edge_manager.ingest.messages import Ingestor, Verdict
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.labels import current as labels
from fedge.edge_manager.labels.current import Applied, Label, Origin
from fedge.edge_manager.retention import policy as retention
from fedge.edge_manager.store import Store
from fedge.protocols import codec, topics
from fedge.protocols.labels import StationLabels
from fedge.protocols.records import LabelRecord, RecordBatch, Stream

EDGE = "st-01"


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=(EDGE,))
    publish_model(fleet_home, 1)
    for i, decision in enumerate(("reject", "accept")):
        fleet_home.db.conn.execute(
            "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, "
            "decision, threshold, config_version, latency_ms, source) "
            "VALUES (?, ?, 0, ?, 'inspect:1', '{}', ?, 0.5, 1, 1.0, 'api')",
            (f"p-{i}", EDGE, time.time(), decision),
        )
    yield fleet_home
    fleet_home.close()


def _fedge(fh: FleetHome, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"FEDGE_HOME": str(fh.home.root)})
    return result.exit_code, " ".join(result.output.split())


def _label(label_id: str, label: str, at: float, origin: Origin = Origin.EDGE) -> Label:
    return Label(label_id, "p-0", EDGE, label, "op", at, origin)


def _current(store: Store) -> list[tuple[str, str]]:
    return [(r["label_id"], r["label"]) for r in store.query("SELECT * FROM labels")]


def test_the_newest_label_is_current_and_the_others_are_history(tmp_path: Path) -> None:
    store = Store(tmp_path / "manager.db")
    with store.transaction() as conn:
        assert labels.apply(conn, _label("l-1", "scratch", 10.0), 100.0).applied is Applied.LABELLED
        outcome = labels.apply(conn, _label("l-2", "clean", 20.0), 101.0)
        assert outcome.applied is Applied.RELABELLED
        assert outcome.previous is not None and outcome.previous.label == "scratch"
        # A station reporting late: older than the current label, kept as history only.
        late = labels.apply(conn, _label("l-0", "scratch", 5.0), 102.0)
        assert late.applied is Applied.HISTORY
        # Redelivery of any of them changes nothing.
        for label_id in ("l-0", "l-1", "l-2"):
            again = labels.apply(conn, _label(label_id, "scratch", 30.0), 103.0)
            assert again.applied is Applied.DUPLICATE
    assert _current(store) == [("l-2", "clean")]
    replaced = [
        (old.label_id, old.label, by, at) for old, by, at in labels.history(store.conn, "p-0")
    ]
    assert replaced == [("l-0", "scratch", "l-2", 102.0), ("l-1", "scratch", "l-2", 101.0)]
    store.close()


def test_station_labels_follow_the_same_rule(tmp_path: Path) -> None:
    store = Store(tmp_path / "manager.db")
    store.conn.execute(
        "INSERT INTO edges (edge, enrolled_at, token_sha256) VALUES (?,0,'x')", (EDGE,)
    )
    ingestor = Ingestor(store, "plant-a")
    records = (
        LabelRecord("l-new", "p-0", "clean", "cam", 20.0),
        LabelRecord("l-old", "p-0", "scratch", "cam", 10.0),  # arrives after, but older
    )
    for seq, record in enumerate(records):
        batch = RecordBatch(EDGE, Stream.LABELS, 1, seq, (record,))
        with IngestTransaction.open(store) as tx:
            topic = topics.up("plant-a", EDGE, topics.Up.LABELS)
            assert ingestor.handle(tx, topic, codec.encode(batch), 100.0).verdict is (
                Verdict.STORED
            )
    assert _current(store) == [("l-new", "clean")]
    assert store.scalar("SELECT count(*) FROM label_history") == 1
    store.close()


def test_an_old_store_with_several_labels_per_prediction_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "manager.db"
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE labels (label_id TEXT PRIMARY KEY, prediction_id TEXT NOT NULL, "
        "edge TEXT NOT NULL, label TEXT NOT NULL, who TEXT NOT NULL, at REAL NOT NULL, "
        "origin TEXT NOT NULL)"
    )
    conn.executemany(
        "INSERT INTO labels VALUES (?,?,?,?,'op',?,'operator')",
        [("l-1", "p-0", EDGE, "scratch", 1.0), ("l-2", "p-0", EDGE, "clean", 2.0),
         ("l-3", "p-1", EDGE, "clean", 1.0)],
    )  # fmt: skip
    conn.commit()
    conn.close()
    store = Store(path)
    assert sorted(_current(store)) == [("l-2", "clean"), ("l-3", "clean")]
    assert store.query("SELECT label_id, replaced_by FROM label_history") == [
        {"label_id": "l-1", "replaced_by": "l-2"}
    ]
    with pytest.raises(sqlite3.IntegrityError):  # one current label per prediction, enforced
        store.conn.execute(
            "INSERT INTO labels VALUES ('l-9', 'p-0', ?, 'clean', 'op', 3.0, 'edge')", (EDGE,)
        )
    store.close()
    Store(path).close()  # opening again is a no-op


def test_relabel_says_from_what_and_agreement_counts_each_prediction_once(
    fh: FleetHome,
) -> None:
    code, output = _fedge(fh, "labels", "add", "p-0", "clean", "--who", "alice")
    assert code == 0, output
    assert output.startswith("l-") and "relabelled" not in output
    with fh.fleet() as fleet:
        assert fleet.label_agreement(EDGE) == 0.0  # a reject labelled clean
    code, output = _fedge(fh, "labels", "add", "p-0", "scratch", "--who", "bob")
    assert code == 0, output
    assert "relabelled p-0: clean -> scratch (was labelled by alice at" in output
    code, output = _fedge(fh, "labels", "add", "p-0", "scratch")
    assert code == 0, output
    assert (
        "p-0 is already labelled scratch (by bob at" in output and "nothing was changed" in output
    )
    assert fh.db.scalar("SELECT count(*) FROM labels") == 1
    assert fh.db.scalar("SELECT count(*) FROM label_history") == 1
    with fh.fleet() as fleet:
        assert fleet.label_agreement(EDGE) == 1.0  # one prediction, its current label
        assert fleet.show(EDGE).labels == 1
    code, output = _fedge(fh, "labels", "stats")
    assert code == 0 and f"{EDGE} 2 1 1 100%" in output, output
    code, output = _fedge(fh, "predictions", "show", "p-0")
    assert code == 0, output
    assert "label scratch by bob" in output and "relabelled from clean by alice" in output


def test_the_station_gets_the_current_label_only(fh: FleetHome) -> None:
    with fh.fleet() as fleet:
        first, _ = fleet.add_label("p-0", "clean", "alice")
        second, outcome = fleet.add_label("p-0", "scratch", "bob")
        assert outcome.applied is Applied.RELABELLED
    document = fh.db.scalar("SELECT document FROM desired WHERE kind='labels'")
    sent = codec.decode(str(document).encode(), StationLabels)
    assert [(r.label_id, r.label) for r in sent.labels] == [(second, "scratch")]
    assert first != second


def test_replaced_labels_are_pruned_with_the_labels(tmp_path: Path) -> None:
    store = Store(tmp_path / "manager.db")
    day = retention.DAY_S
    with store.transaction() as conn:
        labels.apply(conn, _label("l-1", "scratch", 0.0), 0.0)
        labels.apply(conn, _label("l-2", "clean", 2 * day), 2 * day)
    policy = retention.RetentionPolicy.from_settings(
        ManagerSettings("plant-a", keep_labels_days=1.0)
    )
    assert retention.due(store, policy, 2.5 * day)["labels"] == 1
    with store.transaction() as conn:
        pruned, _ = retention.prune_step(conn, policy, 2.5 * day, chunk=100)
    assert pruned["labels"] == 1
    assert store.scalar("SELECT count(*) FROM label_history") == 0
    assert _current(store) == [("l-2", "clean")]
    store.close()
