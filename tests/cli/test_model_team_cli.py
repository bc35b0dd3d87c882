"""A team owns its models (issue 31 item 4): ``fedge model publish --team``, ``fedge model
list --team``, and ``fedge deploy`` / ``fedge rollout start --as`` refusing a user who is
not a submitter or admin of the model's team (one red line, nothing changed)."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, build_onnx_model, make_fleet_home
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.console import accounts
from fedge.console.accounts import Role


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=("st-01", "st-02"))
    with fleet_home.fleet() as fleet:
        for person in ("ana", "bo"):
            accounts.add_token(fleet.store, person, Role.VIEWER)
    yield fleet_home
    fleet_home.close()


def fedge(fh: FleetHome, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"FEDGE_HOME": str(fh.home.root)})
    return result.exit_code, result.output


def test_a_teams_model_is_listed_and_deployed_by_its_team(fh: FleetHome, tmp_path: Path) -> None:
    model = str(build_onnx_model(tmp_path / "m.onnx"))
    publish = ("model", "publish", model, "--classes", "clean,scratch", "--positive", "scratch")
    assert fedge(fh, "team", "add", "vision", "--as", "root")[0] == 0
    assert fedge(fh, "team", "grant", "vision", "ana", "--role", "admin", "--as", "root")[0] == 0
    assert fedge(fh, "team", "grant", "vision", "bo", "--role", "viewer", "--as", "ana")[0] == 0

    code, out = fedge(fh, *publish, "--name", "inspect", "--version", "1", "--team", "vision",
                      "--as", "bo")  # fmt: skip
    assert code == 1 and "bo is a viewer of team vision" in out, out
    assert json.loads(fedge(fh, "model", "list", "--json")[1]) == []  # nothing published
    code, out = fedge(fh, *publish, "--name", "inspect", "--version", "1", "--team", "vision",
                      "--as", "ana")  # fmt: skip
    assert code == 0 and out.rstrip().endswith("; team vision"), out
    assert fedge(fh, *publish, "--name", "other", "--version", "1")[0] == 0

    code, out = fedge(fh, "model", "list", "--team", "vision", "--json")
    assert [row["name"] for row in json.loads(out)] == ["inspect"], out
    code, out = fedge(fh, "model", "list", "--team", "nope")
    assert code == 1 and "unknown team 'nope'" in out, out

    code, out = fedge(fh, "deploy", "inspect:1", "--edges", "st-01", "--as", "bo")
    assert code == 1 and "inspect:1 belongs to team vision" in out, out
    code, out = fedge(fh, "rollout", "start", "inspect:1", "--edges", "all", "--as", "bo")
    assert code == 1 and "inspect:1 belongs to team vision" in out, out
    with fh.fleet() as fleet:  # refused: no deployment, no rollout
        assert fleet.store.query("SELECT COUNT(*) AS n FROM deployments") == [{"n": 0}]
        assert fleet.store.query("SELECT COUNT(*) AS n FROM rollouts") == [{"n": 0}]
    code, out = fedge(fh, "deploy", "inspect:1", "--edges", "st-01", "--as", "ana")
    assert code == 0 and out.startswith("deployment "), out
    code, out = fedge(fh, "deploy", "other:1", "--edges", "st-02", "--as", "bo")
    assert code == 0, out  # no team's model: anyone's
