"""The serve loop's list of desired documents to publish, read while others write."""

import threading
import time
from pathlib import Path

from conftest import make_fleet_home

from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.store import Store

LABELS_WRITTEN = 300


def test_a_document_replaced_while_listed_never_goes_out_as_none(tmp_path: Path) -> None:
    """Each label at the manager writes a new labels document and deletes the older one.
    The publisher (manager serve, its own connection) listing documents meanwhile once
    read each envelope in a second statement, after the row could be gone, and published
    "None" (issue 34: the demo's st-02 logged it as a malformed labels document)."""
    fh = make_fleet_home(tmp_path, edges=("st-01",))
    done, listed, bad = threading.Event(), [0], []

    def publisher() -> None:
        store = Store(fh.home.db_path)  # SQLite: a connection per thread
        try:
            while not done.is_set():
                for doc in desired_store.unpublished(store, skip=set()):
                    listed[0] += 1
                    if not doc.envelope.startswith('{"'):
                        bad.append(doc)
        finally:
            store.close()

    with fh.fleet() as fleet:
        fleet.store.conn.execute(
            "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, "
            "decision, threshold, config_version, latency_ms, source) "
            "VALUES ('p-1', 'st-01', 0, ?, 'inspect:1', '{}', 'accept', 0.5, 1, 1.0, 'api')",
            (time.time(),),
        )
        thread = threading.Thread(target=publisher)
        thread.start()
        try:
            for index in range(LABELS_WRITTEN):  # relabels: a new document version each
                fleet.add_label("p-1", ("clean", "scratch")[index % 2], "operator-3")
        finally:
            done.set()
            thread.join(timeout=30)
    assert not thread.is_alive()
    assert listed[0] > 0
    assert bad == []
