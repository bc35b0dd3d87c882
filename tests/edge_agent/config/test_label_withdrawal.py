"""An operator's undo at the manager withdraws the label at the station too (issue 30)."""

import time
from pathlib import Path

import pytest
from conftest import make_fleet_home

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.operations import LABELS, Fleet
from fedge.edge_manager.labels.operations import withdraw_label


def _newest_labels_envelope(fleet: Fleet) -> bytes:
    rows = [r for r in desired_store.unpublished(fleet.store, skip=set()) if r.kind == LABELS]
    return rows[-1].envelope.encode()


def test_a_withdrawn_label_leaves_the_station_and_a_later_one_stands(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path, edges=("st-01",))
    with fh.fleet() as fleet:
        for pid in ("p-1", "p-2"):
            fleet.store.conn.execute(
                "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, "
                "decision, threshold, config_version, latency_ms, source) "
                "VALUES (?, 'st-01', 0, ?, 'inspect:1', '{}', 'accept', 0.5, 1, 1.0, 'api')",
                (pid, time.time()),
            )
        fleet.add_label("p-1", "scratch", "lena")
        fleet.add_label("p-2", "clean", "lena")
        given = _newest_labels_envelope(fleet)
        gone = withdraw_label(fleet, "p-1", "lena")
        assert gone.label == "scratch"
        withdrawn = _newest_labels_envelope(fleet)
        with pytest.raises(ManagerError, match="no label given at the manager"):
            withdraw_label(fleet, "p-1", "lena")  # nothing left to withdraw: nothing changes
        fleet.add_label("p-1", "clean", "lena")  # labelled again after the undo
        again = _newest_labels_envelope(fleet)

    agent = EdgeAgent(fh.agent_settings("st-01"))
    try:
        agent.station.keep("p-1", b"png bytes", ".png")
        agent.station.keep("p-2", b"png bytes", ".png")
        agent.handle_labels(given)
        assert {(i.prediction_id, i.label) for i in agent.station.labelled()} == {
            ("p-1", "scratch"), ("p-2", "clean"),
        }  # fmt: skip
        agent.handle_labels(withdrawn)
        assert [(i.prediction_id, i.label) for i in agent.station.labelled()] == [("p-2", "clean")]
        assert agent.counters["labels.withdrawn"] == 1
        # The agent's own label index loses it too.
        assert {(r["prediction_id"], r["label"]) for r in agent.store.labels()} == {
            ("p-2", "clean"),
        }  # fmt: skip
        assert agent.counters["labels.index_withdrawn"] == 1
        agent.handle_labels(again)  # still lists the withdrawal: the newer label stands
        assert {(i.prediction_id, i.label) for i in agent.station.labelled()} == {
            ("p-1", "clean"), ("p-2", "clean"),
        }  # fmt: skip
        assert agent.counters["labels.withdrawn"] == 1
        assert {(r["prediction_id"], r["label"]) for r in agent.store.labels()} == {
            ("p-1", "clean"), ("p-2", "clean"),
        }  # fmt: skip
        assert agent.counters["labels.index_withdrawn"] == 1
    finally:
        agent.store.close()
        agent.station.close()
