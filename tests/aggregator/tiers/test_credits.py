"""A job's rounds checked against its tiers' credits; a stopped job resumes with a
corrected manifest (issue 15)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedge.aggregator.fleet.manifest import load_fleet_manifest, parse_fleet_manifest
from fedge.aggregator.jobs.amend import amend_job, diff, regranted
from fedge.aggregator.jobs.checkpoint import latest_checkpoint
from fedge.aggregator.jobs.control import halt_job
from fedge.aggregator.jobs.directory import JOB_MANIFEST, RUNS_DB, JobError
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.aggregator.jobs.spec import ManifestError, check_tier_credits
from fedge.cli.main import app
from fedge.sim.job_manifest import load_manifest, parse_manifest
from fedge.sim.jobs import resume_job, run_job

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "jobs"
# A small fleet and short rounds: a job of a few rounds takes seconds.
SCENARIO = """
name = "tiny-credits"
[data]
alpha = 0.5
[fleet]
parties = 4
per_round = 2
[[fleet.groups]]
count = 2
cpus = 4.0
data_share = 0.5
[[fleet.groups]]
count = 2
cpus = 0.5
data_share = 0.5
[device]
seconds_per_example = 0.01
[training]
rounds = 4
lr = 0.2
local_epochs = 1
batch_size = 16
target_accuracy = 0.9
"""


def write_job(folder: Path, *, rounds: int, credits: int, seed: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scenario.toml").write_text(SCENARIO)
    path = folder / f"job-{rounds}-{credits}-{seed}.toml"
    path.write_text(
        f"""
[job]
name = "tiny-credits"
rounds = {rounds}
seed = {seed}
[task]
scenario = "scenario.toml"
[strategy]
kind = "tiered"
[strategy.params]
tiers = 2
profiling_rounds = 1
credits_per_tier = {credits}
[federation]
workers = 2
"""
    )
    return path


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_rounds_are_checked_against_the_credits() -> None:
    check_tier_credits(7, "tiered", {"tiers": 2, "credits_per_tier": 3})  # 6 selections
    check_tier_credits(10**6, "tiered", {"tiers": 2})  # unlimited
    check_tier_credits(10**6, "fedavg", {"credits_per_tier": 1})  # no tiers
    with pytest.raises(ManifestError) as caught:
        check_tier_credits(1000, "tiered", {"tiers": 5, "credits_per_tier": 100})
    message = str(caught.value)
    assert "job.rounds = 1000 needs 999 tier selections" in message
    assert "(100 per tier x 5 tiers) allows 500" in message
    assert "credits_per_tier to 200 or more, or lower job.rounds to 501" in message
    assert "fedge aggregator resume --dir DIR --manifest NEW.toml" in message
    with pytest.raises(ManifestError, match=re.escape("([300, 10]) allows 310")):
        check_tier_credits(400, "distill", {"tiers": 2, "credits_per_tier": [300, 10]})
    # Three stations form at most three tiers, whatever `tiers` says.
    with pytest.raises(ManifestError, match="1 per tier x 3 tiers"):
        check_tier_credits(5, "tiered", {"tiers": 5, "credits_per_tier": 1}, parties=3)


def test_the_shipped_examples_pass() -> None:
    load_manifest(EXAMPLES / "tiered-digits.toml")
    load_fleet_manifest(EXAMPLES / "fleet-inspect.toml")


def test_a_manifest_with_too_few_credits_is_refused_when_it_loads(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"needs 11 tier selections .* allows 6"):
        load_manifest(write_job(tmp_path, rounds=12, credits=3))
    fleet = (EXAMPLES / "fleet-inspect.toml").read_text()
    fleet = fleet.replace("tiers = 2\n", "tiers = 2\ncredits_per_tier = 1\n")
    with pytest.raises(ManifestError, match=r"job.rounds = 4 needs 3 .* allows 2"):
        parse_fleet_manifest(fleet)
    result = CliRunner().invoke(
        app,
        ["aggregator", "run", str(write_job(tmp_path, rounds=12, credits=3)), "--dir",
         str(tmp_path / "job")],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "job.rounds = 12 needs 11 tier selections" in _flat(result.output)
    assert not (tmp_path / "job" / "runs.db").exists()


def test_what_a_resume_may_change() -> None:
    old = {"job": {"rounds": 4, "seed": 1}, "strategy": {"params": {"credits_per_tier": 2}}}
    new = {"job": {"rounds": 8, "seed": 1}, "strategy": {"params": {"credits_per_tier": 4}}}
    assert diff(old, new) == {
        "job.rounds": (4, 8),
        "strategy.params.credits_per_tier": (2, 4),
    }
    # Tier 0 was selected once: each tier gets the 2 credits more.
    assert regranted([1, 2], 2, 4) == [3, 4]
    assert regranted([1, 2], [2, 2], [2, 5]) == [1, 5]
    assert regranted([1, 2], 2, None) == [None, None]
    with pytest.raises(ManifestError, match="tier 0 has already been selected 1 times"):
        regranted([1, 2], 2, 0)


def test_a_halted_job_resumes_with_more_rounds_and_credits(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"

    def halt_at_2(done: int, total: int, accuracy: float | None) -> None:
        if done == 2:
            halt_job(job_dir)

    halted = run_job(write_job(tmp_path, rounds=4, credits=2), job_dir, progress=halt_at_2)
    assert (halted.state, halted.last_round) == (RunState.HALTED, 2)
    checkpoint = latest_checkpoint(job_dir)
    assert checkpoint is not None
    assert sorted(checkpoint.strategy_state["selection"]["credits"]) == [1, 2]

    runner = CliRunner()
    resume = ["aggregator", "resume", "--dir", str(job_dir), "--manifest"]
    # More rounds than the credits allow: refused, nothing changed.
    result = runner.invoke(app, [*resume, str(write_job(tmp_path, rounds=8, credits=2))])
    assert result.exit_code == 1, result.output
    assert "job.rounds = 8 needs 7 tier selections" in _flat(result.output)
    # A field that changes what was trained: refused, naming it.
    result = runner.invoke(app, [*resume, str(write_job(tmp_path, rounds=8, credits=4, seed=2))])
    assert result.exit_code == 1, result.output
    assert "job.seed cannot change when a job resumes" in _flat(result.output)
    assert "rounds = 4" in (job_dir / JOB_MANIFEST).read_text()

    result = runner.invoke(app, [*resume, str(write_job(tmp_path, rounds=8, credits=4))])
    assert result.exit_code == 0, result.output
    output = _flat(result.output)
    assert "job.rounds: 4 -> 8" in output and "credits_per_tier: 2 -> 4" in output
    assert "completed" in output, output
    assert (job_dir / f"{JOB_MANIFEST}.1").read_text().count("rounds = 4") == 1
    final = latest_checkpoint(job_dir)
    assert final is not None and final.round == 8
    # 1 + 6 + 1 left: 7 selections of the 8 credits in all.
    assert sum(final.strategy_state["selection"]["credits"]) == 8 - 7


def test_a_job_that_ran_out_of_credits_resumes_with_a_corrected_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: started by a fedge without the check, the job failed when its
    credits ran out, and resuming failed the same way until the manifest was corrected."""
    job_dir = tmp_path / "job"
    with monkeypatch.context() as unchecked:
        unchecked.setattr("fedge.sim.job_manifest.check_tier_credits", lambda *a, **k: None)
        with pytest.raises(JobError, match=r"failed after round 3: .*spent its credits"):
            run_job(write_job(tmp_path, rounds=6, credits=1), job_dir)
    assert store_state(job_dir) is RunState.FAILED
    with pytest.raises(ManifestError, match=re.escape("job.rounds = 6 needs 5 tier selections")):
        resume_job(job_dir)

    def parse(text: str) -> object:  # as the CLI does: against the job's scenario copy
        return parse_manifest(text, base_dir=job_dir, scenario_file=job_dir / "scenario.toml")

    amended = amend_job(job_dir, write_job(tmp_path, rounds=6, credits=3), parse)
    assert amended.changes == {"strategy.params.credits_per_tier": (1, 3)}
    assert amended.checkpoint_round == 3
    result = resume_job(job_dir)
    assert (result.state, result.last_round, result.resumed_from) == (RunState.COMPLETED, 6, 3)


def test_an_amend_cut_off_after_the_checkpoint_grants_credits_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint is rewritten before job.toml: an amend that dies in between and is
    run again must not grant the extra credits a second time."""
    job_dir = tmp_path / "job"
    with monkeypatch.context() as unchecked:
        unchecked.setattr("fedge.sim.job_manifest.check_tier_credits", lambda *a, **k: None)
        with pytest.raises(JobError):
            run_job(write_job(tmp_path, rounds=6, credits=1), job_dir)

    def parse(text: str) -> object:
        return parse_manifest(text, base_dir=job_dir, scenario_file=job_dir / "scenario.toml")

    corrected = write_job(tmp_path, rounds=6, credits=3)
    with monkeypatch.context() as crash:

        def killed(*_: object) -> None:
            raise OSError("killed before job.toml was written")

        crash.setattr("fedge.aggregator.jobs.amend._keep_previous", killed)
        with pytest.raises(OSError, match="killed"):
            amend_job(job_dir, corrected, parse)
    checkpoint = latest_checkpoint(job_dir)
    assert checkpoint is not None
    once = list(checkpoint.strategy_state["selection"]["credits"])
    assert "credits_per_tier = 1" in (job_dir / JOB_MANIFEST).read_text()

    amend_job(job_dir, corrected, parse)  # run again, to the end this time
    checkpoint = latest_checkpoint(job_dir)
    assert checkpoint is not None
    assert list(checkpoint.strategy_state["selection"]["credits"]) == once
    result = resume_job(job_dir)
    assert (result.state, result.last_round) == (RunState.COMPLETED, 6)


def store_state(job_dir: Path) -> RunState:
    store = RunStore(job_dir / RUNS_DB)
    try:
        (run,) = store.runs()
        return RunState(run["state"])
    finally:
        store.close()
