"""/readyz of the manager: a pure rule (issue 27, item 2)."""

from fedge.edge_manager.metrics.readiness import manager_readiness


def test_the_manager_is_ready_only_with_broker_store_and_worker() -> None:
    ok = manager_readiness(
        broker_connected=True,
        broker_detail="",
        store_state="low",
        store_detail="",
        worker_alive=True,
    )
    assert ok.ready
    down = manager_readiness(
        broker_connected=False,
        broker_detail="connection refused",
        store_state="unwritable",
        store_detail="disk full",
        worker_alive=True,
    )
    assert not down.ready
    assert down.describe() == {
        "ready": False,
        "checks": {
            "broker": "not connected (connection refused)",
            "store": "unwritable (disk full)",
            "worker": "ok",
        },
    }
