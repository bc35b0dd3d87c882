"""Rejected deployment envelopes are reported to the manager, and change nothing else."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FLEET, FleetHome, make_fleet_home

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_manager.ingest.messages import Ingestor, Verdict
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.protocols import codec, topics
from fedge.protocols.deployment import DeploymentDesired, DeployStage, DeployStatus
from fedge.protocols.signing import SigningKey

EDGE = "st-01"


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=(EDGE, "st-02"))
    yield fleet_home
    fleet_home.close()


Sent = list[tuple[str, bytes]]


@pytest.fixture
def sent() -> Sent:
    return []


@pytest.fixture
def agent(fh: FleetHome, sent: Sent, monkeypatch: pytest.MonkeyPatch) -> Iterator[EdgeAgent]:
    """An offline agent whose MQTT publishes are captured in ``sent``."""
    edge_agent = EdgeAgent(fh.agent_settings(EDGE))

    def publish(topic: str, payload: bytes, *args: Any, **kwargs: Any) -> None:
        sent.append((topic, payload))

    monkeypatch.setattr(edge_agent.mqtt, "publish", publish)
    try:
        yield edge_agent
    finally:
        edge_agent.store.close()
        edge_agent.station.close()


def _deploy_reports(sent: Sent) -> list[DeployStatus]:
    topic = topics.up(FLEET, EDGE, topics.Up.DEPLOY)
    return [codec.decode(payload, DeployStatus) for t, payload in sent if t == topic]


def _desired(edge: str = EDGE, fleet: str = FLEET) -> DeploymentDesired:
    return DeploymentDesired(fleet, edge, 7, "d-abc", "{}", "127.0.0.1:1", 1.0)


def _forgeries(fh: FleetHome) -> dict[str, bytes]:
    return {
        "signed by an unpinned key": SigningKey.generate().sign(_desired()),
        "not json": b"{not json",
        "for another edge": fh.home.signing_key().sign(_desired(edge="st-02")),
    }


@pytest.mark.parametrize("what", ["signed by an unpinned key", "not json", "for another edge"])
def test_a_rejected_deployment_is_reported_as_failed(
    fh: FleetHome, agent: EdgeAgent, sent: Sent, what: str
) -> None:
    envelope = _forgeries(fh)[what]
    serving_before = agent.serving
    agent.handle_deploy(envelope)
    assert sum(v for k, v in agent.counters.items() if k.startswith("deploy.rejected.")) == 1
    reports = _deploy_reports(sent)
    assert len(reports) == 1, what
    status = reports[0]
    rejected = next(k for k in agent.counters if k.startswith("deploy.rejected."))
    reason = rejected.removeprefix("deploy.rejected.")
    assert status.stage is DeployStage.FAILED
    assert status.reason.startswith(f"rejected {reason}:"), status.reason
    assert (status.edge, status.deployment_id, status.version) == (EDGE, "unknown", 0)
    assert status.serving == serving_before == agent.serving
    # The real deployment state the agent re-announces on every connection is untouched.
    assert agent.store.get("last_deploy_status") is None
    assert agent.store.get("deploy_done_version") is None


def test_the_manager_shows_a_reported_deployment_rejection(
    fh: FleetHome, agent: EdgeAgent, sent: Sent
) -> None:
    agent.handle_deploy(_forgeries(fh)["signed by an unpinned key"])
    (status,) = _deploy_reports(sent)
    with fh.fleet() as fleet:
        ingestor = Ingestor(fleet.store, FLEET)
        with IngestTransaction.open(fleet.store) as tx:
            outcome = ingestor.handle(
                tx, topics.up(FLEET, EDGE, topics.Up.DEPLOY), codec.encode(status), 1.0
            )
        assert outcome.verdict is Verdict.STORED
        view = fleet.show(EDGE)
    assert view.deploy_stage == "failed"
    assert "bad_signature" in view.deploy_reason
    assert (view.deploy_id, view.serving) == ("unknown", "")
