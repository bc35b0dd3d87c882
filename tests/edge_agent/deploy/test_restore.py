"""Restoring the serving model at start-up: decisions, pointers, verification, the agent.

The decisions are pure and tested on literals; :func:`restore.verify` and the agent's
start-up run on real ONNX files signed by a real manager key (no broker, no processes).
"""

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home, publish_model

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.deploy import restore
from fedge.edge_agent.deploy.restore import KeptModel
from fedge.edge_agent.errors import DeployError
from fedge.edge_agent.settings import AgentSettings
from fedge.edge_agent.store import LocalStore
from fedge.edge_manager.registry.versions import PublishedModel
from fedge.protocols import codec
from fedge.protocols.deployment import DeployStage, DeployStatus
from fedge.protocols.signing import SigningKey, TrustedKeys, trusted

EDGE = "st-01"


def _kept(version: int, deployment_version: int = 0, path: str = "") -> KeptModel:
    return KeptModel(
        path=Path(path or f"/data/models/inspect/{version}/model.onnx"),
        name="inspect",
        version=version,
        deployment_id=f"d-{deployment_version}" if deployment_version else "",
        deployment_version=deployment_version,
    )


@dataclasses.dataclass
class Models:
    fh: FleetHome
    v1: PublishedModel
    v2: PublishedModel
    data_dir: Path

    def keys(self) -> TrustedKeys:
        return trusted(self.fh.home.signing_key().public)

    def kept(self, published: PublishedModel, deployment_version: int) -> KeptModel:
        """``published`` as the deployer stores it on the station, and its pointer."""
        version = published.manifest.version
        path = self.data_dir / "models" / "inspect" / str(version) / "model.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(published.path, path)
        return KeptModel(
            path=path,
            name="inspect",
            version=version,
            manifest_envelope=published.envelope.decode(),
            manifest=codec.encode(published.manifest).decode(),
            deployment_id=f"d-{deployment_version}",
            deployment_version=deployment_version,
        )


@pytest.fixture
def models(tmp_path: Path) -> Iterator[Models]:
    fh = make_fleet_home(tmp_path, edges=(EDGE,))
    yield Models(fh, publish_model(fh, 1, seed=1), publish_model(fh, 2, seed=2), tmp_path / "st")
    fh.close()


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- decisions (pure)


def test_remember_puts_the_newest_first_once_and_keeps_a_few() -> None:
    v1, v2, v3, v4 = (_kept(v, v) for v in (1, 2, 3, 4))
    history = restore.remember((), v1)
    history = restore.remember(history, v2)
    assert history == (v2, v1)
    # The same file made active again (a re-fetched deployment) moves to the front once.
    assert restore.remember(history, dataclasses.replace(v1, deployment_version=9))[1:] == (v2,)
    history = restore.remember(restore.remember(history, v3), v4)
    assert history == (v4, v3, v2)
    assert restore.remember(history, v1, keep=2) == (v1, v4)


def test_candidates_are_the_active_model_then_the_kept_ones_newest_first() -> None:
    v1, v2, v3 = (_kept(v, v) for v in (1, 2, 3))
    assert restore.candidates(v3, (v3, v2, v1)) == (v3, v2, v1)
    assert restore.candidates(v2, (v3, v2, v1)) == (v2, v3, v1)
    assert restore.candidates(None, (v2, v1)) == (v2, v1)
    assert restore.candidates(v1, ()) == (v1,)


def test_restore_serves_the_first_model_that_verifies() -> None:
    v1, v2, v3 = (_kept(v, v) for v in (1, 2, 3))
    broken = {v3.path, v2.path}

    def verify(kept: KeptModel) -> str:
        if kept.path in broken:
            raise DeployError("hash_mismatch", kept.ref)
        return f"loaded {kept.ref}"

    restored = restore.restore((v3, v2, v1), verify)
    assert (restored.model, restored.kept) == ("loaded inspect:1", v1)
    assert [(k, e.reason) for k, e in restored.failures] == [
        (v3, "hash_mismatch"),
        (v2, "hash_mismatch"),
    ]
    assert restore.restore((v1,), verify) == restore.Restored("loaded inspect:1", v1, ())
    nothing = restore.restore((v3, v2), verify)
    assert (nothing.model, nothing.kept, len(nothing.failures)) == (None, None, 2)


@pytest.mark.parametrize(
    ("done", "deployment_version", "floor"),
    [
        (2, 2, 1),  # the deployment that brought the model is due again
        (5, 2, 1),  # later ones (which failed) are due again too: the retained one wins
        (0, 2, 0),
        (7, 0, 0),  # not known which deployment: every retained one is due
    ],
)
def test_redeploy_floor(done: int, deployment_version: int, floor: int) -> None:
    assert restore.redeploy_floor(done, deployment_version) == floor


def test_restore_status_names_the_deployment_the_fallback_and_the_failure() -> None:
    error = DeployError("hash_mismatch", "model.onnx changed on disk")
    status = restore.restore_status(EDGE, _kept(2, 4), None, error, "inspect:1", 10.0)
    assert status == DeployStatus(
        EDGE,
        "d-4",
        4,
        "inspect",
        2,
        DeployStage.FAILED,
        "restore_failed: hash_mismatch: model.onnx changed on disk; serving inspect:1, the "
        "newest previous model that verifies; fetching the deployment again",
        "inspect:1",
        10.0,
    )
    none_left = restore.restore_status(EDGE, _kept(2, 4), None, error, "", 10.0)
    assert none_left is not None and none_left.serving == ""
    assert "no previous model verifies, serving none" in none_left.reason


def test_restore_status_falls_back_to_the_last_reported_deployment() -> None:
    error = DeployError("bad_pointer", "garbled")
    previous = DeployStatus(EDGE, "d-abc", 3, "inspect", 2, DeployStage.ACTIVE, "", "inspect:2")
    # A pointer written before deployments were kept with it: the last report says which.
    status = restore.restore_status(EDGE, _kept(2), previous, error, "", 1.0)
    assert status is not None
    assert (status.deployment_id, status.version, status.model_version) == ("d-abc", 3, 2)
    # An unreadable pointer: the model is the last reported one.
    status = restore.restore_status(EDGE, None, previous, error, "", 1.0)
    assert status is not None
    assert (status.model_name, status.model_version, status.stage) == (
        "inspect",
        2,
        DeployStage.FAILED,
    )
    assert restore.restore_status(EDGE, _kept(2), None, error, "", 1.0) is None
    assert restore.restore_status(EDGE, None, None, error, "", 1.0) is None


# ---------------------------------------------------------------- pointers


def test_pointer_round_trip_and_the_original_format() -> None:
    kept = dataclasses.replace(_kept(2, 4), manifest_envelope='{"signed":1}', manifest="{}")
    assert restore.decode_kept(restore.encode_kept(kept)) == kept
    assert restore.decode_history(restore.encode_history((kept, _kept(1, 1)))) == (
        kept,
        _kept(1, 1),
    )


def test_original_pointer_is_read_from_its_manifest(models: Models) -> None:
    manifest = codec.encode(models.v1.manifest).decode()
    legacy = json.dumps({"manifest": manifest, "path": "/data/model.onnx"})
    kept = restore.decode_kept(legacy)
    assert (kept.ref, kept.path, kept.manifest, kept.manifest_envelope) == (
        "inspect:1",
        Path("/data/model.onnx"),
        manifest,
        "",
    )
    assert (kept.deployment_id, kept.deployment_version) == ("", 0)


@pytest.mark.parametrize(
    "raw",
    ["not json", "[]", '{"path": 3}', '{"path": "/x", "manifest": "{}"}'],
    ids=["not-json", "not-an-object", "bad-path", "bad-manifest"],
)
def test_unreadable_pointer_is_a_bad_pointer(raw: str) -> None:
    with pytest.raises(DeployError) as caught:
        restore.decode_kept(raw)
    assert caught.value.reason == "bad_pointer"


def test_history_skips_what_it_cannot_read() -> None:
    good = _kept(1, 1)
    raw = json.dumps([{"path": 1}, json.loads(restore.encode_kept(good))])
    assert restore.decode_history(raw) == (good,)
    assert restore.decode_history(None) == ()
    assert restore.decode_history("garbage") == ()
    assert restore.decode_history('{"a": 1}') == ()


# ---------------------------------------------------------------- verify (files, ONNX Runtime)


def test_prune_models_keeps_the_kept_ones_and_removes_the_rest(tmp_path: Path) -> None:
    root = tmp_path / "models"
    for name, version in [("inspect", 1), ("inspect", 2), ("inspect", 3), ("other", 7)]:
        (root / name / str(version)).mkdir(parents=True)
        (root / name / str(version) / "model.onnx").write_bytes(b"x")
    (root / "inspect" / "4").mkdir()
    (root / "inspect" / "4" / "model.onnx.download").write_bytes(b"partial")
    kept = [
        _kept(3, path=str(root / "inspect" / "3" / "model.onnx")),
        _kept(2, path=str(root / "inspect" / "2" / "model.onnx")),
    ]
    removed = restore.prune_models(root, kept)
    assert sorted(p.relative_to(root).as_posix() for p in removed) == [
        "inspect/1",
        "inspect/4",
        "other/7",
    ]
    assert sorted(p.relative_to(root).as_posix() for p in root.glob("*/*")) == [
        "inspect/2",
        "inspect/3",
    ]
    assert restore.prune_models(tmp_path / "none", kept) == []


def test_verify_checks_signature_hash_load_and_smoke_test(models: Models) -> None:
    kept = models.kept(models.v2, 2)
    assert restore.verify(kept, models.keys()).ref == "inspect:2"
    legacy = dataclasses.replace(kept, manifest_envelope="")
    assert restore.verify(legacy, models.keys()).ref == "inspect:2"

    failures = {
        "bad_signature": (kept, trusted(SigningKey.generate().public)),
        "manifest_mismatch": (dataclasses.replace(kept, version=3), models.keys()),
        "unreadable": (dataclasses.replace(kept, path=kept.path.with_name("gone")), models.keys()),
    }
    for reason, (candidate, keys) in failures.items():
        with pytest.raises(DeployError) as caught:
            restore.verify(candidate, keys)
        assert caught.value.reason == reason, caught.value

    _flip_byte(kept.path)
    with pytest.raises(DeployError) as caught:
        restore.verify(kept, models.keys())
    assert caught.value.reason == "hash_mismatch"
    assert "changed on disk" in caught.value.detail


# ---------------------------------------------------------------- the agent's start-up


def _settings(models: Models) -> AgentSettings:
    return AgentSettings(
        fleet="plant-a",
        edge=EDGE,
        data_dir=models.data_dir,
        broker_host="127.0.0.1",
        broker_port=1,
        insecure=True,
        password="secret",
        grpc_target="127.0.0.1:1",
        manager_public_key=models.fh.home.signing_key().public.to_text(),
    )


def _station(models: Models, state: dict[str, str]) -> None:
    store = LocalStore(models.data_dir / "agent.db")
    for key, value in state.items():
        store.put(key, value)
    store.close()


def _start(models: Models) -> EdgeAgent:
    """An agent's construction: what it serves before it ever connects."""
    return EdgeAgent(_settings(models))


@pytest.fixture
def agents() -> Iterator[list[EdgeAgent]]:
    started: list[EdgeAgent] = []
    yield started
    for agent in started:
        agent.store.close()
        agent.station.close()


def _v2_active(models: Models) -> tuple[KeptModel, KeptModel, dict[str, str]]:
    v1, v2 = models.kept(models.v1, 1), models.kept(models.v2, 2)
    active_status = DeployStatus(EDGE, "d-2", 2, "inspect", 2, DeployStage.ACTIVE, "", "inspect:2")
    state = {
        "active_model": restore.encode_kept(v2),
        "model_history": restore.encode_history((v2, v1)),
        "deploy_done_version": "2",
        "last_deploy_status": codec.encode(active_status).decode(),
    }
    return v1, v2, state


def _last_status(agent: EdgeAgent) -> DeployStatus:
    raw = agent.store.get("last_deploy_status")
    assert raw is not None
    return codec.decode(raw.encode(), DeployStatus)


def test_start_serves_the_active_model_when_it_verifies(
    models: Models, agents: list[EdgeAgent]
) -> None:
    _, _, state = _v2_active(models)
    _station(models, state)
    agent = _start(models)
    agents.append(agent)
    assert agent.serving == "inspect:2"
    assert agent.store.get("deploy_done_version") == "2"
    assert _last_status(agent).stage is DeployStage.ACTIVE
    assert agent.counters["restore_failed"] == 0


def test_start_falls_back_reports_and_asks_for_the_deployment_again(
    models: Models, agents: list[EdgeAgent]
) -> None:
    _, v2, state = _v2_active(models)
    _station(models, state)
    _flip_byte(v2.path)
    agent = _start(models)
    agents.append(agent)

    assert agent.serving == "inspect:1"
    assert agent.counters["restore_failed"] == 1
    # The retained deployment (version 2) is due again.
    assert agent.store.get("deploy_done_version") == "1"
    status = _last_status(agent)
    assert (status.deployment_id, status.version, status.model_name, status.model_version) == (
        "d-2",
        2,
        "inspect",
        2,
    )
    assert (status.stage, status.serving) == (DeployStage.FAILED, "inspect:1")
    assert status.reason.startswith("restore_failed: hash_mismatch: inspect:2"), status.reason
    # It is what the next connection publishes, after the birth.
    assert agent.deployments.last_status == codec.encode(status)


def test_start_serves_none_when_no_kept_model_verifies(
    models: Models, agents: list[EdgeAgent]
) -> None:
    v1, v2, state = _v2_active(models)
    _station(models, state)
    _flip_byte(v2.path)
    v1.path.unlink()
    agent = _start(models)
    agents.append(agent)

    assert agent.model is None and agent.serving == ""
    assert agent.store.get("deploy_done_version") == "1"
    status = _last_status(agent)
    assert (status.stage, status.serving) == (DeployStage.FAILED, "")
    assert "serving none" in status.reason


def test_start_with_an_original_pointer_asks_for_the_last_reported_deployment(
    models: Models, agents: list[EdgeAgent]
) -> None:
    """A store written before models were kept: no history, no deployment in the pointer."""
    _, v2, state = _v2_active(models)
    pointer = {"manifest": v2.manifest, "path": str(v2.path)}
    state = {**state, "active_model": json.dumps(pointer)}
    del state["model_history"]
    _station(models, state)
    agent = _start(models)
    agents.append(agent)
    assert agent.serving == "inspect:2", "an original pointer still restores"
    agent.store.close()
    agent.station.close()
    agents.clear()

    _flip_byte(v2.path)
    agent = _start(models)
    agents.append(agent)
    assert agent.serving == ""
    assert agent.store.get("deploy_done_version") == "1"
    status = _last_status(agent)
    assert (status.deployment_id, status.stage) == ("d-2", DeployStage.FAILED)
