"""Status documents over gRPC (issue 9) are stored exactly as their MQTT twins are."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedge.edge_manager.ingest.messages import Ingestor, Outcome, Verdict
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.store import Store
from fedge.protocols import codec, topics
from fedge.protocols.config import ConfigReport, ConfigStatus
from fedge.protocols.deployment import DeployStage, DeployStatus
from fedge.protocols.liveness import EdgeState, Liveness

FLEET = "plant-a"
EDGE = "st-01"
NOW = 1000.0


def _over_mqtt(
    ingestor: Ingestor, tx: IngestTransaction, kind: topics.Up, payload: bytes
) -> Outcome:
    return ingestor.handle(tx, topics.up(FLEET, EDGE, kind), payload, NOW)


def _over_grpc(
    ingestor: Ingestor, tx: IngestTransaction, kind: topics.Up, payload: bytes
) -> Outcome:
    return ingestor.handle_status(tx, EDGE, kind, payload, NOW)


def _store(path: Path) -> Store:
    store = Store(path)
    for edge in (EDGE, "st-02"):
        store.conn.execute(
            "INSERT INTO edges (edge, enrolled_at, token_sha256) VALUES (?, 0, 'x')", (edge,)
        )
    return store


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    mqtt, grpc = _store(tmp_path / "mqtt.db"), _store(tmp_path / "grpc.db")
    yield mqtt, grpc
    mqtt.close()
    grpc.close()


def _statuses() -> list[tuple[topics.Up, bytes]]:
    birth = Liveness(EDGE, 3, EdgeState.ONLINE, "0.1", "inspect:1", 2, NOW)
    report = ConfigReport(EDGE, ConfigStatus.APPLIED, 2, 2, "", NOW)
    deployed = DeployStatus(EDGE, "d-1", 1, "inspect", 1, DeployStage.ACTIVE, "", "inspect:1", NOW)
    refused = ConfigReport(EDGE, ConfigStatus.REJECTED, 2, 0, "signature: untrusted", NOW)
    return [
        (topics.Up.STATE, codec.encode(birth)),
        (topics.Up.CONFIG, codec.encode(report)),
        (topics.Up.DEPLOY, codec.encode(deployed)),
        (topics.Up.CONFIG, codec.encode(refused)),
        (topics.Up.STATE, codec.encode(Liveness(EDGE, 2, EdgeState.ONLINE, "0.1", at=NOW))),
    ]


def _tables(store: Store) -> dict[str, list[dict[str, Any]]]:
    return {
        "edges": store.query("SELECT * FROM edges ORDER BY edge"),
        "deploy_events": store.query("SELECT * FROM deploy_events"),
    }


def test_each_status_over_grpc_stores_what_mqtt_would(stores: tuple[Store, Store]) -> None:
    outcomes: dict[str, list[Verdict]] = {}
    for store, send, name in ((stores[0], _over_mqtt, "mqtt"), (stores[1], _over_grpc, "grpc")):
        ingestor = Ingestor(store, FLEET)
        with IngestTransaction.open(store) as tx:
            outcomes[name] = [send(ingestor, tx, kind, p).verdict for kind, p in _statuses()]
    assert outcomes["grpc"] == outcomes["mqtt"]
    assert outcomes["grpc"][-1] is Verdict.IGNORED  # an older session's birth
    assert _tables(stores[1]) == _tables(stores[0])
    edge = stores[1].one("SELECT * FROM edges WHERE edge=?", (EDGE,))
    assert edge is not None
    assert (edge["state"], edge["config_applied"], edge["deploy_stage"]) == ("online", 2, "active")


def test_bad_statuses_over_grpc_are_recorded_as_rejections(tmp_path: Path) -> None:
    store = _store(tmp_path / "manager.db")
    ingestor = Ingestor(store, FLEET)
    foreign = codec.encode(ConfigReport("st-02", ConfigStatus.APPLIED, 1, 1, "", NOW))
    try:
        with IngestTransaction.open(store) as tx:
            outcomes = [
                _over_grpc(ingestor, tx, topics.Up.CONFIG, b"{not json"),
                _over_grpc(ingestor, tx, topics.Up.CONFIG, foreign),
                _over_grpc(ingestor, tx, topics.Up.PREDICTIONS, b"{}"),
            ]
        assert [o.verdict for o in outcomes] == [Verdict.REJECTED] * 3
        assert "came from 'st-01'" in outcomes[1].detail
        assert "predictions is not a status document" in outcomes[2].detail
        rows = store.query("SELECT edge, topic FROM rejections ORDER BY rowid")
        assert rows == [
            {"edge": EDGE, "topic": "grpc:st-01/config"},
            {"edge": EDGE, "topic": "grpc:st-01/config"},
            {"edge": EDGE, "topic": "grpc:st-01/predictions"},
        ]
        untouched = store.one("SELECT config_status FROM edges WHERE edge='st-02'")
        assert untouched == {"config_status": ""}
    finally:
        store.close()
