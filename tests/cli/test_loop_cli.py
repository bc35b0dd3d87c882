"""``fedge loop enable/disable/status``: a policy checked whole before it is stored."""

import json
from pathlib import Path

import pytest
from conftest import make_fleet_home, publish_model
from typer.testing import CliRunner

from fedge.cli.main import app

JOB = """[job]
name = "nightly"
rounds = 1

[task]
model = "inspect:1"

[strategy]
kind = "fedavg"

[federation]
backend = "fleet"
fleet = "{fleet}"
edges = "all"
"""


def fedge(home: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"FEDGE_HOME": str(home)})
    return result.exit_code, result.output


@pytest.fixture
def home(tmp_path: Path) -> Path:
    fh = make_fleet_home(tmp_path)
    publish_model(fh, 1)
    (tmp_path / "job.toml").write_text(JOB.format(fleet=fh.settings.fleet))
    return fh.home.root


def test_enable_status_disable(home: Path, tmp_path: Path) -> None:
    job = str(tmp_path / "job.toml")
    code, out = fedge(
        home, "loop", "enable", "inspect", "--job", job, "--min-new-labels", "50",
        "--or-on-alert", "drift", "--canary", "st-01", "--health-window", "30s",
    )  # fmt: skip
    assert code == 0, out
    assert "50 new labels or input_drift or score_drift" in " ".join(out.split())
    code, out = fedge(home, "loop", "status", "--json")
    assert code == 0, out
    (policy,) = json.loads(out)["policies"]
    assert policy["enabled"] and not policy["due"] and policy["why"].startswith("0/50 new labels")
    assert fedge(home, "loop", "disable", "inspect")[0] == 0
    assert not json.loads(fedge(home, "loop", "status", "--json")[1])["policies"][0]["enabled"]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--or-on-alert", "fire"], "unknown alert kind 'fire'"),
        (["--waves", "50%,40%"], "waves"),
        (["--health-window", "ten minutes"], "ten minutes"),
        (["--abort-if", "latency<5"], "latency"),
        (["--min-new-labels", "0"], "never trigger"),
    ],
)
def test_a_bad_policy_is_refused_and_nothing_stored(
    home: Path, tmp_path: Path, extra: list[str], fragment: str
) -> None:
    job = str(tmp_path / "job.toml")
    code, out = fedge(home, "loop", "enable", "inspect", "--job", job, *extra)
    assert code == 1 and fragment in " ".join(out.split()), out
    assert json.loads(fedge(home, "loop", "status", "--json")[1])["policies"] == []


def test_an_unknown_model_or_a_bad_job_is_refused(home: Path, tmp_path: Path) -> None:
    job = str(tmp_path / "job.toml")
    code, out = fedge(home, "loop", "enable", "nosuch", "--job", job)
    assert code == 1 and "no version of model 'nosuch'" in out, out
    (tmp_path / "bad.toml").write_text("[job]\nname = 'x'\n")
    code, out = fedge(home, "loop", "enable", "inspect", "--job", str(tmp_path / "bad.toml"))
    assert code == 1 and "error:" in out, out
    code, out = fedge(home, "loop", "disable", "inspect")
    assert code == 1 and "has no loop policy" in out, out
