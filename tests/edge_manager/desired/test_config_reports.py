"""What ``fedge edge show`` says about config reports: a rejection, then a newer document."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FLEET, FleetHome, make_fleet_home

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_manager.fleet.views import EdgeView
from fedge.edge_manager.ingest.messages import Ingestor, Verdict
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.protocols import topics
from fedge.protocols.config import EdgeConfig
from fedge.protocols.signing import SigningKey

EDGE = "st-01"


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=(EDGE,))
    yield fleet_home
    fleet_home.close()


def test_an_applied_report_clears_the_previous_rejection(
    fh: FleetHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = EdgeAgent(fh.agent_settings(EDGE))
    sent: list[tuple[str, bytes]] = []

    def publish(topic: str, payload: bytes, *args: Any, **kwargs: Any) -> None:
        sent.append((topic, payload))

    monkeypatch.setattr(agent.mqtt, "publish", publish)
    topic = topics.up(FLEET, EDGE, topics.Up.CONFIG)
    manager = fh.home.signing_key()

    def ingest_reports() -> EdgeView:
        with fh.fleet() as fleet:
            ingestor = Ingestor(fleet.store, FLEET)
            for report_topic, payload in sent:
                assert report_topic == topic
                with IngestTransaction.open(fleet.store) as tx:
                    outcome = ingestor.handle(tx, report_topic, payload, 1.0)
                assert outcome.verdict is Verdict.STORED
            sent.clear()
            return fleet.show(EDGE)

    try:
        first = manager.sign(EdgeConfig(FLEET, EDGE, 1, default_threshold=0.4))
        second = manager.sign(EdgeConfig(FLEET, EDGE, 2, default_threshold=0.6))
        agent.handle_config(first)
        assert ingest_reports().config_reason == ""

        forged = SigningKey.generate().sign(EdgeConfig(FLEET, EDGE, 9, default_threshold=0.01))
        agent.handle_config(forged)
        view = ingest_reports()
        assert view.config_status == "rejected:0"
        assert "bad_signature" in view.config_reason

        agent.handle_config(second)  # a newer genuine document, applied
        view = ingest_reports()
        assert (view.config_applied, view.config_status) == (2, "applied:2")
        assert view.config_reason == ""
    finally:
        agent.store.close()
        agent.station.close()
