"""A kill anywhere in a deployment's writes never lets the new model serve unjudged.

Real SQLite store, real ONNX models on disk, real signed manifests and the real
deployment code; the "kill" is an exception raised just before the n-th write to the
store (nothing of that write lands, as with a SIGKILL), for every n. After the restart
the retained desired deployment arrives again: whatever point the kill hit, the station
ends up serving the new model on probation against the old one -- never the new model
taken for its own previous one and trusted unjudged.
"""

import contextlib
import hashlib
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import pytest

from fedge.edge_agent.deploy.models import Deployments
from fedge.edge_agent.serving import ServingState
from fedge.edge_agent.settings import AgentSettings
from fedge.edge_agent.store import LocalStore
from fedge.models.tiny_onnx import build_linear_classifier
from fedge.protocols.deployment import DeploymentDesired
from fedge.protocols.manifest import ModelManifest, TensorSpec
from fedge.protocols.signing import SigningKey, trusted

FLEET, EDGE = "plant-a", "st-01"


class Killed(BaseException):
    """The process died here (a BaseException: no handler in the agent catches it)."""


class DyingStore(LocalStore):
    """A store whose process dies just before its ``die_at``-th key/value write."""

    def __init__(self, path: Path, die_at: int) -> None:
        super().__init__(path)
        self.writes = 0
        self.die_at = die_at

    def _write(self) -> None:
        self.writes += 1
        if self.writes == self.die_at:
            raise Killed(f"killed before write {self.writes}")

    def put(self, key: str, value: str) -> None:
        self._write()
        super().put(key, value)

    def put_many(self, values: Mapping[str, str]) -> None:
        self._write()
        super().put_many(values)


class Station:
    """One agent's deployments over a store file, as a start of the agent builds them."""

    def __init__(self, settings: AgentSettings, store: LocalStore, key: SigningKey) -> None:
        self.store = store
        self.state = ServingState(threading.Lock())
        self.deployments = Deployments(
            settings,
            store,
            trusted(key.public),
            Counter(),
            serving=self.state,
            report=lambda kind, payload, retained: None,
        )
        self.state.install(self.deployments.restore_active())

    @property
    def serving(self) -> str:
        return self.state.ref


def _desired(settings: AgentSettings, key: SigningKey, version: int) -> DeploymentDesired:
    """A deployment of inspect:VERSION, its model already verified on disk."""
    path = settings.data_dir / "models" / "inspect" / str(version) / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    build_linear_classifier(path, seed=version)
    manifest = ModelManifest(
        name="inspect",
        version=version,
        sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        size=path.stat().st_size,
        inputs=(TensorSpec("image", "float32", ("batch", 1, 32, 32)),),
        outputs=(TensorSpec("probs", "float32", ("batch", 2)),),
        classes=("clean", "scratch"),
        positive_classes=("scratch",),
    )
    return DeploymentDesired(
        FLEET, EDGE, version, f"d-{version}", key.sign(manifest).decode(), issued_at=1.0
    )


@pytest.mark.parametrize("die_at", range(1, 8))
def test_a_kill_during_a_deployment_never_trusts_the_new_model_unjudged(
    tmp_path: Path, die_at: int
) -> None:
    key = SigningKey.generate()
    settings = AgentSettings(
        fleet=FLEET,
        edge=EDGE,
        data_dir=tmp_path,
        broker_host="127.0.0.1",
        broker_port=1,
        insecure=True,
        password="p",
        grpc_target="127.0.0.1:1",
        manager_public_key=key.public.to_text(),
    )
    db = tmp_path / "agent.db"
    store = LocalStore(db)
    Station(settings, store, key).deployments.deploy(_desired(settings, key, 1))
    store.close()
    second = _desired(settings, key, 2)  # after the first: its prune keeps only inspect:1

    dying = DyingStore(db, die_at)
    station = Station(settings, dying, key)
    assert station.serving == "inspect:1"
    with contextlib.suppress(Killed):
        station.deployments.deploy(second)
    dying.close()

    # The restart, and the retained desired deployment delivered again.
    store = LocalStore(db)
    restarted = Station(settings, store, key)
    restarted.deployments.deploy(second)
    probation = restarted.deployments.probation.status()
    assert restarted.serving == "inspect:2"
    assert (probation["state"], probation["model"], probation["previous"]) == (
        "on_probation",
        "inspect:2",
        "inspect:1",
    ), f"killed before write {die_at} of {dying.writes}"
    store.close()
