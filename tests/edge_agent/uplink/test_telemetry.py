"""A long outage: telemetry stops being recorded past a backlog; predictions never do."""

import dataclasses
from pathlib import Path

import numpy as np
from conftest import build_onnx_model

from fedge.bench.inference_setup import make_agent
from fedge.edge_agent.store import LocalStore
from fedge.protocols.records import Stream


def _pending(store: LocalStore, stream: Stream) -> int:
    query = "SELECT count(*) FROM pending WHERE stream=?"
    return int(store._conn.execute(query, (stream.value,)).fetchone()[0])


def test_telemetry_pauses_at_the_backlog_limit_and_predictions_go_on(tmp_path: Path) -> None:
    agent = make_agent(tmp_path / "agent", build_onnx_model(tmp_path / "m.onnx"), 32)
    agent.settings = dataclasses.replace(agent.settings, telemetry_backlog_limit=2)
    agent._emit_metrics()
    assert _pending(agent.store, Stream.TELEMETRY) > 0
    agent.store.seal_batches("bench-edge", 0, 500)
    image = np.zeros((32, 32), np.float32)
    agent.score(image)
    agent.store.seal_batches("bench-edge", 0, 500)
    assert agent.store.backlog()["outbox_batches"] == 2  # telemetry + predictions
    agent._emit_metrics()
    assert _pending(agent.store, Stream.TELEMETRY) == 0
    assert agent.counters["telemetry.skipped"] == 1
    agent.score(image)
    assert _pending(agent.store, Stream.PREDICTIONS) == 1
    # The outbox drains (acknowledged batches go): telemetry is recorded again.
    for entry in agent.store.outbox(10, set()):
        agent.store.acknowledge(entry.id)
    agent._emit_metrics()
    assert _pending(agent.store, Stream.TELEMETRY) > 0
