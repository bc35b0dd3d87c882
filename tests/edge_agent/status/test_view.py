"""``fedge agent status`` from a station's file: counts, the model pointer, the thresholds.

A real agent file (SQLite, the agent's own LocalStore) read back read-only.
"""

import hashlib
import time
from pathlib import Path

from fedge.edge_agent.deploy.restore import KeptModel, encode_kept
from fedge.edge_agent.status.view import from_facts, threshold_text
from fedge.edge_agent.store import LocalStore, read_facts
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.manifest import ModelManifest, TensorSpec, Thresholds
from fedge.protocols.records import PredictionRecord


def _prediction(n: int, decision: str, at: float) -> PredictionRecord:
    return PredictionRecord(
        prediction_id=f"p-{n}",
        at=at,
        model="inspect:2",
        scores={"clean": 0.3, "scratch": 0.7} if decision == "reject" else {"clean": 0.9},
        decision=decision,
        threshold=0.5,
        config_version=3,
        latency_ms=2.0,
    )


def _manifest(recommended: Thresholds | None = None) -> ModelManifest:
    return ModelManifest(
        name="inspect",
        version=2,
        sha256=hashlib.sha256(b"model").hexdigest(),
        size=5,
        inputs=(TensorSpec("image", "float32", ("batch", 1, 32, 32)),),
        outputs=(TensorSpec("probs", "float32", ("batch", 2)),),
        classes=("clean", "scratch", "dent"),
        positive_classes=("scratch", "dent"),
        thresholds=recommended,
    )


def _station(tmp_path: Path, config: EdgeConfig, manifest: ModelManifest) -> Path:
    path = tmp_path / "agent.db"
    store = LocalStore(path)
    now = time.time()
    store.add_predictions([_prediction(i, "reject" if i < 3 else "accept", now) for i in range(8)])
    store.add_label("l-1", "p-0", "scratch", "operator", now)
    store.put("applied_config", codec.encode(config).decode())
    kept = KeptModel(
        path=tmp_path / "model.onnx",
        name=manifest.name,
        version=manifest.version,
        manifest=codec.encode(manifest).decode(),
        deployment_id="d-42",
        deployment_version=7,
    )
    store.put("active_model", encode_kept(kept))
    store.close()
    return path


def test_the_file_alone_gives_counts_model_and_per_class_thresholds(tmp_path: Path) -> None:
    config = EdgeConfig(
        "plant-a", "st-01", 3, default_threshold=0.6, class_thresholds={"dent": 0.8}
    )
    path = _station(tmp_path, config, _manifest())
    status = from_facts("st-01", read_facts(path), "agent.db")
    assert (status.running, status.serving, status.config_version) == (False, "inspect:2", 3)
    counts = status.counts
    assert (counts.predictions, counts.rejects, counts.labels) == (8, 3, 1)
    assert (counts.pending_records, counts.outbox_batches) == (9, 0)  # 8 predictions, 1 label
    assert counts.last_acknowledged_at is None and counts.oldest_unsent_at is not None
    assert counts.deployment == "d-42 (v7)"
    assert status.reject_rate == 3 / 8
    assert status.broker_connected is None  # not running: unknown, not "disconnected"
    assert status.thresholds["source"] == "config"
    assert threshold_text(status.thresholds) == (
        "default 0.6; per-class (overrides the default): dent 0.8 (from the config)"
    )


def test_a_config_for_another_model_yields_to_the_models_recommendation(tmp_path: Path) -> None:
    config = EdgeConfig("plant-a", "st-01", 4, default_threshold=0.6, model="inspect:1")
    recommended = Thresholds(default_threshold=0.35, class_thresholds={"scratch": 0.4})
    path = _station(tmp_path, config, _manifest(recommended))
    status = from_facts("st-01", read_facts(path), "agent.db")
    assert status.thresholds["default_threshold"] == 0.35
    assert status.thresholds["class_thresholds"] == {"scratch": 0.4}
    assert threshold_text(status.thresholds).endswith("(from the serving model's recommendation)")


def test_an_acknowledged_batch_is_the_last_contact_and_survives_a_reopen(tmp_path: Path) -> None:
    path = _station(tmp_path, EdgeConfig("plant-a", "st-01", 1), _manifest())
    store = LocalStore(path)
    store.seal_batches("st-01", 1, 500)
    [entry, *_] = store.outbox(10, set())
    before = time.time()
    store.acknowledge(entry.id)
    store.close()
    facts = read_facts(path)
    assert facts.last_acknowledged_at is not None and facts.last_acknowledged_at >= before
    assert facts.outbox_batches == 1  # the label's batch is still waiting


def test_no_config_and_no_model_decide_with_the_agents_default(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "agent.db")
    store.close()
    status = from_facts("st-01", read_facts(tmp_path / "agent.db"), "agent.db")
    assert (status.serving, status.config_version, status.counts.predictions) == ("", 0, 0)
    assert threshold_text(status.thresholds) == (
        "0.5 (from the agent's default (no config, no recommendation))"
    )
