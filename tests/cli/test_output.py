"""Output fit for people and scripts (issue 15): brackets kept, no Python reprs, tables
that fit 80 columns without cutting words, ``--json`` on every list and show command,
dates with times."""

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FEDGE, FleetHome, deploy, make_fleet_home, publish_model
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.sim.report import ReportExistsError, report_dir, speedup_text

EDGE = "st-01"
ROOT = Path(__file__).resolve().parents[2]
# 2024-03-05 14:07:09 local time: a date and a time on every timestamp shown.
AT = time.mktime((2024, 3, 5, 14, 7, 9, 0, 0, -1))
SHOWN_AT = "2024-03-05 14:07:09"


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=(EDGE, "st-02"))
    yield fleet_home
    fleet_home.close()


def fedge(fh: FleetHome, *args: str, stdout_only: bool = False) -> tuple[int, str]:
    """Exit code and output (stdout and stderr as a terminal shows them, or stdout only:
    what a script reading ``--json`` gets; warnings go to stderr)."""
    result = CliRunner().invoke(app, list(args), env={"FEDGE_HOME": str(fh.home.root)})
    return result.exit_code, result.stdout if stdout_only else result.output


def fedge_80(*args: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``fedge ARGS`` as a process on an 80-column terminal (rich reads COLUMNS)."""
    env = {**os.environ, "COLUMNS": "80"}
    if home is not None:
        env["FEDGE_HOME"] = str(home)
    return subprocess.run(
        [str(FEDGE), *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def add_prediction(fh: FleetHome, prediction_id: str, decision: str) -> None:
    """A prediction as ingest stores it, from ``EDGE`` (reading is tested, not ingest)."""
    fh.db.conn.execute(
        "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
        "threshold, config_version, latency_ms, source) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (prediction_id, EDGE, 1, AT, "inspect:1", '{"clean": 0.2, "scratch": 0.8}',
         decision, 0.5, 1, 3.0, "part_00000.png"),
    )  # fmt: skip


def fits(output: str, width: int = 80) -> None:
    assert "…" not in output, output
    assert max(len(line) for line in output.splitlines()) <= width, output


# ---------------------------------------------------------------- brackets


def test_an_error_keeps_its_brackets(fh: FleetHome) -> None:
    code, output = fedge(fh, "labels", "add", "p-[x]", "clean")
    assert code == 1
    assert output == "error: no prediction 'p-[x]' has reached the manager\n"


@pytest.mark.integration
def test_the_unknown_strategy_error_names_its_table() -> None:
    result = fedge_80("sim", "--scenario", "tifl-digits", "--strategies", "fedavg,tierd")
    assert result.returncode == 1, result.stderr
    message = " ".join(result.stderr.split())
    assert "scenario 'tifl-digits' has no [strategies.tierd] table (has: " in message


# ---------------------------------------------------------------- no reprs


def test_per_class_thresholds_and_dates_read_as_text(fh: FleetHome) -> None:
    publish_model(fh, 1)
    deploy(fh, 1, [EDGE])
    assert fedge(fh, "edge", "set-threshold", EDGE, "0.6", "--class", "scratch")[0] == 0
    fh.db.conn.execute("UPDATE edges SET last_seen=? WHERE edge=?", (AT, EDGE))
    code, output = fedge(fh, "edge", "show", EDGE)
    assert code == 0, output
    assert "per class scratch 0.6)" in output
    assert f"last seen      {SHOWN_AT}\n" in output
    assert "{" not in output and "None" not in output
    code, output = fedge(fh, "edge", "list")
    assert code == 0, output
    assert SHOWN_AT in " ".join(output.split()) or "2024-03-05" in output


def test_a_published_model_names_its_parent_or_none(fh: FleetHome, tmp_path: Path) -> None:
    model = publish_model(fh, 1).path
    code, output = fedge(
        fh, "model", "publish", str(model), "--name", "inspect", "--version", "2",
        "--classes", "clean,scratch", "--positive", "scratch", "--parent", "1",
    )  # fmt: skip
    assert code == 0, output
    assert output.startswith("published inspect:2 sha256=")
    assert output.rstrip().endswith("classes=clean,scratch parent=inspect:1")
    code, output = fedge(
        fh, "model", "publish", str(model), "--name", "other", "--version", "1",
        "--classes", "clean,scratch",
    )  # fmt: skip
    assert code == 0, output
    assert output.rstrip().endswith("parent=-")
    assert "None" not in output


def test_the_speed_up_is_a_sentence() -> None:
    speedup = {"strategy": "tiered", "median": 2.5, "min": 1.25, "per_seed": {"0": 2.5, "1": None}}
    assert speedup_text(speedup, "fedavg") == (
        "tiered vs fedavg: median 2.50x, min 1.25x (1 of 2 seed(s) reached the target)"
    )
    censored = {"strategy": "tiered", "median": None, "min": None, "per_seed": {"0": None}}
    assert speedup_text(censored, "fedavg") == "tiered vs fedavg: no seed reached the target"


# ---------------------------------------------------------------- 80 columns


@pytest.mark.integration
def test_aggregator_status_fits_80_columns(tmp_path: Path) -> None:
    manifest = (ROOT / "examples" / "jobs" / "tiered-digits.toml").read_text()
    short = tmp_path / "short.toml"
    short.write_text(re.sub(r"(?m)^rounds = \d+", "rounds = 2", manifest, count=1))
    job = tmp_path / "job"
    ran = fedge_80("aggregator", "run", str(short), "--dir", str(job))
    assert ran.returncode == 0, ran.stderr
    result = fedge_80("aggregator", "status", "--dir", str(job))
    assert result.returncode == 0, result.stderr
    fits(result.stdout)
    assert "completed" in result.stdout
    assert re.search(r"\d{4}-\d\d-\d\d", result.stdout)  # the date, not only the time
    statuses = json.loads(fedge_80("aggregator", "status", "--dir", str(job), "--json").stdout)
    assert statuses[0]["state"] == "completed"


@pytest.mark.integration
def test_predictions_list_fits_80_columns_with_whole_ids(fh: FleetHome) -> None:
    prediction_id = "p-" + "a" * 32
    add_prediction(fh, prediction_id, "reject")
    result = fedge_80("predictions", "list", home=fh.home.root)
    assert result.returncode == 0, result.stderr
    fits(result.stdout)
    assert prediction_id in result.stdout  # an id people copy is never folded
    assert "2024-03-05" in result.stdout


# ---------------------------------------------------------------- --json everywhere


def test_every_list_and_show_command_speaks_json(fh: FleetHome) -> None:
    publish_model(fh, 1)
    add_prediction(fh, "p-1", "reject")
    add_prediction(fh, "p-2", "accept")
    assert fedge(fh, "labels", "add", "p-1", "scratch", "--who", "alice")[0] == 0
    assert fedge(fh, "manager", "operator", "add", "bob", "--out", "-")[0] == 0
    commands: dict[tuple[str, ...], Callable[[Any], bool]] = {
        ("edge", "list"): lambda d: [e["edge"] for e in d] == [EDGE, "st-02"],
        ("edge", "show", EDGE): lambda d: d["edge"] == EDGE and d["predictions"] == 2,
        ("model", "list"): lambda d: (
            d[0]["ref"] == "inspect:1" and d[0]["classes"] == ["clean", "scratch"]
        ),
        ("labels", "stats"): lambda d: (
            d[0]
            == {
                "edge": EDGE,
                "predictions": 2,
                "accepts": 1,
                "rejects": 1,
                "labels": 1,
                "label_agreement": 1.0,
            }
        ),
        ("predictions", "list"): lambda d: (
            [p["prediction_id"] for p in d] == ["p-2", "p-1"]
            or [p["prediction_id"] for p in d] == ["p-1", "p-2"]
        ),
        ("predictions", "list", "--unlabelled"): lambda d: (
            [p["prediction_id"] for p in d] == ["p-2"]
        ),
        ("predictions", "show", "p-1"): lambda d: (
            d["labels"][0]["label"] == "scratch" and d["scores"] == {"clean": 0.2, "scratch": 0.8}
        ),
        ("manager", "operator", "list"): lambda d: [o["name"] for o in d] == ["bob"],
    }
    for args, check in commands.items():
        code, output = fedge(fh, *args, "--json", stdout_only=True)
        assert code == 0, (args, output)
        assert check(json.loads(output)), (args, output)


def test_predictions_filters_on_the_command_line(fh: FleetHome) -> None:
    add_prediction(fh, "p-1", "reject")
    add_prediction(fh, "p-2", "accept")
    code, output = fedge(
        fh, "predictions", "list", "--decision", "reject", "--json", stdout_only=True
    )
    assert code == 0, output
    assert [p["prediction_id"] for p in json.loads(output)] == ["p-1"]
    code, output = fedge(fh, "predictions", "list", "--edge", "st-02")
    assert (code, output) == (0, "no predictions match\n")
    code, output = fedge(fh, "predictions", "list", "--model", "inspect")
    assert code == 1
    assert "model must be NAME:VERSION" in output
    code, output = fedge(fh, "predictions", "show", "p-1")
    assert code == 0, output
    assert output.splitlines()[:5] == [
        "p-1",
        f"  edge        {EDGE}",
        f"  at          {SHOWN_AT}",
        "  model       inspect:1 (config v1)",
        "  decision    reject at threshold 0.5",
    ]
    assert "  scores      clean 0.200, scratch 0.800" in output
    assert "  labels      none" in output


# ---------------------------------------------------------------- sim reports


def test_sim_reports_never_overwrite_each_other(tmp_path: Path) -> None:
    first = report_dir(None, "tifl-digits", force=False, now=AT)
    assert first == Path("sim-out") / "tifl-digits-20240305-140709"
    out = tmp_path / "sim"
    out.mkdir()
    assert report_dir(out, "tifl-digits", force=False, now=AT) == out
    (out / "tifl-digits.md").write_text("an earlier run\n")
    with pytest.raises(ReportExistsError, match="--force"):
        report_dir(out, "tifl-digits", force=False, now=AT)
    assert report_dir(out, "tifl-digits", force=True, now=AT) == out


@pytest.mark.integration
def test_a_sim_into_an_earlier_report_is_refused_before_running(tmp_path: Path) -> None:
    (tmp_path / "tifl-digits.md").write_text("an earlier run\n")
    result = fedge_80("sim", "--scenario", "tifl-digits", "--out", str(tmp_path))
    assert result.returncode == 1
    assert "tifl-digits.md exists" in " ".join(result.stderr.split())
    assert (tmp_path / "tifl-digits.md").read_text() == "an earlier run\n"
