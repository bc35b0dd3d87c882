"""``fedge jobs``: exit codes and output on a real manager store; bad input is one red
line and queues nothing; every change is in ``show`` with who made it."""

import json
from pathlib import Path

from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.store import Store


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    db_path = ManagerHome(home).db_path
    db_path.parent.mkdir(parents=True, exist_ok=True)
    store = Store(db_path)
    for name in ("st-1", "st-2"):
        edge_store.enroll(store, name, "0" * 64, 0.0)
    store.close()
    return home


def _jobs(home: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["jobs", *args, "--home", str(home)])
    return result.exit_code, result.output


def test_submit_list_show_priority_cancel(tmp_path: Path) -> None:
    home = _home(tmp_path)
    assert _jobs(home, "team", "vision", "--quota", "40") == (
        0,
        "team vision: quota 40 station-h/day\n",
    )
    code, out = _jobs(
        home,
        "submit",
        "--kind",
        "be",
        "--team",
        "vision",
        "--stations",
        "any 1",
        "--as",
        "ana",
        "--json",
    )
    assert code == 0, out
    job_id = json.loads(out)["job_id"]
    assert json.loads(out)["state"] == "queued"
    assert _jobs(home, "priority", job_id, "3", "--as", "bo") == (0, f"{job_id}: priority 3\n")
    assert _jobs(home, "cancel", job_id, "--as", "cy") == (0, f"{job_id}: cancelled\n")
    code, out = _jobs(home, "show", job_id, "--json")
    shown = json.loads(out)
    assert (shown["state"], shown["priority"]) == ("cancelled", 3)
    assert [(e["state"], e["who"]) for e in shown["events"]] == [
        ("queued", "ana"),
        ("queued", "bo"),
        ("cancelled", "cy"),
    ]
    code, out = _jobs(home, "list", "--json")
    assert [j["job_id"] for j in json.loads(out)] == [job_id]


def test_bad_input_is_one_line_and_queues_nothing(tmp_path: Path) -> None:
    home = _home(tmp_path)
    _jobs(home, "team", "vision")
    for args, message in (
        (("--team", "paint"), "unknown team 'paint'"),
        (("--team", "vision", "--stations", "st-1,st-7"), "unknown stations: st-7"),
        (("--team", "vision", "--grace", "0"), "grace period"),
        (("--team", "vision", "--grace", "-3"), "grace period"),
    ):
        code, out = _jobs(home, "submit", "--kind", "te", *args)
        assert code == 1 and message in out and out.startswith("error: "), out
        assert out.count("\n") <= 2, out  # one message (rich may wrap it once), no traceback
    assert _jobs(home, "list") == (0, "no jobs\n")
    code, out = _jobs(home, "show", "job-nope")
    assert code == 1 and "no job job-nope" in out


FLEET_JOB = """
[job]
name = "retrain"
rounds = 2

[task]
model = "inspect:1"

[strategy]
kind = "fedavg"

[federation]
backend = "fleet"
fleet = "plant-a"
edges = "all"
"""


def test_a_fleet_job_manifest_is_checked_and_a_refusal_leaves_nothing(tmp_path: Path) -> None:
    home = _home(tmp_path)
    _jobs(home, "team", "vision")
    manifest = tmp_path / "retrain.toml"
    manifest.write_text(FLEET_JOB)
    bad = tmp_path / "bad.toml"
    bad.write_text(FLEET_JOB.replace("rounds = 2", "rounds = 0"))
    job_dir = tmp_path / "jobs" / "retrain"
    for args, message in (
        (("--manifest", str(manifest)), "--manifest needs --job-dir"),
        (("--manifest", str(bad), "--job-dir", str(job_dir)), "job.rounds"),
        (("--manifest", str(manifest), "--job-dir", str(job_dir), "--grace", "0"), "grace"),
        (("--manifest", str(manifest), "--job-dir", str(job_dir), "--team", "x"), "unknown team"),
    ):
        code, out = _jobs(home, "submit", "--kind", "be", "--team", "vision", *args)
        assert code == 1 and message in out and out.startswith("error: "), out
        assert not job_dir.exists()
    assert _jobs(home, "list") == (0, "no jobs\n")
    code, out = _jobs(
        home, "submit", "--kind", "be", "--team", "vision", "--json",
        "--manifest", str(manifest), "--job-dir", str(job_dir),
    )  # fmt: skip
    assert code == 0, out
    record = json.loads(out)
    assert record["job_id"].startswith("retrain-") and record["job_dir"] == str(job_dir)
    assert (job_dir / "queued.toml").read_text() == FLEET_JOB
    code, out = _jobs(
        home, "submit", "--kind", "be", "--team", "vision",
        "--manifest", str(manifest), "--job-dir", str(job_dir),
    )  # fmt: skip
    assert code == 1 and "already holds a job" in out
