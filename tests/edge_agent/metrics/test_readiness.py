"""/readyz of the agent: its rule and the data directory's write probe (issue 27)."""

from pathlib import Path

from fedge.edge_agent.metrics.readiness import agent_readiness, uplink_problem, write_problem


def test_the_agent_needs_an_uplink_a_writable_store_and_a_model(tmp_path: Path) -> None:
    assert uplink_problem(broker_connected=True, via_grpc=False) is None
    assert uplink_problem(broker_connected=False, via_grpc=True) is None
    assert uplink_problem(broker_connected=False, via_grpc=False) is not None
    assert write_problem(tmp_path) is None
    assert write_problem(tmp_path / "missing") is not None
    assert agent_readiness(uplink=None, store_writable=None, serving="m:1").ready
    not_serving = agent_readiness(uplink=None, store_writable=None, serving="")
    assert not not_serving.ready
    assert "no model" in str(not_serving.describe()["checks"])
