"""The manager checks the artifact it holds against its own signed manifest before deploying."""

from pathlib import Path

import pytest
from conftest import FleetHome, deploy, publish_model

from fedge.edge_manager.errors import ManagerError


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _deploy_rows(fh: FleetHome) -> int:
    return int(fh.db.scalar("SELECT count(*) FROM desired WHERE kind='deploy'"))


def test_deploy_refuses_a_damaged_registry_artifact(fleet_home: FleetHome) -> None:
    model = publish_model(fleet_home, 1)
    _flip_byte(model.path)
    with pytest.raises(ManagerError, match=r"inspect:1.*sha256"):
        deploy(fleet_home, 1, ["st-01"])
    assert _deploy_rows(fleet_home) == 0
    assert fleet_home.db.scalar("SELECT count(*) FROM deployments") == 0


def test_deploy_refuses_a_truncated_registry_artifact(fleet_home: FleetHome) -> None:
    model = publish_model(fleet_home, 1)
    model.path.write_bytes(model.path.read_bytes()[:-10])
    with pytest.raises(ManagerError, match=r"inspect:1.*size"):
        deploy(fleet_home, 1, ["st-01"])
    assert _deploy_rows(fleet_home) == 0


def test_deploy_of_an_intact_artifact_writes_the_desired_document(
    fleet_home: FleetHome,
) -> None:
    publish_model(fleet_home, 1)
    deploy(fleet_home, 1, ["st-01"])
    assert _deploy_rows(fleet_home) == 1
