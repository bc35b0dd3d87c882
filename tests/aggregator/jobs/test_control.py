"""Managed training jobs: checkpoints, halt and resume, and a SIGKILL that changes nothing.

The determinism contract: with the same seed, a job halted or killed mid-way and resumed
ends with the same final model -- and the same selections, round by round -- as a job that
ran straight through.
"""

from __future__ import annotations

import json
import signal
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from click.testing import Result
from conftest import Processes, wait_until
from flwr.app import ArrayRecord
from typer.testing import CliRunner

from fedge.aggregator.jobs.checkpoint import (
    CheckpointError,
    checkpoint_rounds,
    latest_checkpoint,
    load_arrays,
    load_checkpoint,
    restore_strategy,
    save_checkpoint,
)
from fedge.aggregator.jobs.control import halt_job, job_status
from fedge.aggregator.jobs.directory import FINAL_MODEL, HALT_REQUEST, RUNS_DB, JobError
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.aggregator.jobs.spec import ManifestError
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.latency import LatencyProfile
from fedge.aggregator.rounds.replies import to_array_record
from fedge.aggregator.strategies.factory import build_strategy
from fedge.aggregator.strategies.streaming import StreamingFedAvg, _Late
from fedge.aggregator.strategies.tiered import TieredFedAvg
from fedge.sim.jobs import resume_job, run_job

ROUNDS = 12
SEED = 3
TIMEOUT_S = 240.0

# 10 parties in 2 speed groups, 3 per round. Ten local epochs of batch 5 make a round take
# a noticeable fraction of a second, so a test can kill a run between two rounds.
SCENARIO = """
name = "tiny-jobs"
[data]
alpha = 0.5
[fleet]
parties = 10
per_round = 3
[[fleet.groups]]
count = 5
cpus = 4.0
data_share = 0.4
[[fleet.groups]]
count = 5
cpus = 0.5
data_share = 0.6
[device]
seconds_per_example = 0.05
jitter_sigma = 0.1
[training]
rounds = 8
lr = 0.2
local_epochs = 10
batch_size = 5
target_accuracy = 0.9
"""

TIERED = "tiers = 2\nprofiling_rounds = 1\ninterval = 3"
# Six asked, the round ends at the third reply: three late replies per round, folded into
# the next round with a staleness weight -- state held in memory between rounds.
STALE = 'over_selection = 1.0\nquorum_fraction = 0.67\nlate_policy = "stale"'

Arrays = dict[str, npt.NDArray[Any]]


def write_job(
    folder: Path,
    *,
    kind: str = "tiered",
    params: str = TIERED,
    rounds: int = ROUNDS,
    extra: str = "",
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scenario.toml").write_text(SCENARIO)
    path = folder / "job.toml"
    path.write_text(
        f"""
[job]
name = "tiny-{kind}"
rounds = {rounds}
seed = {SEED}

[task]
scenario = "scenario.toml"

[strategy]
kind = "{kind}"

[strategy.params]
{params}

[federation]
workers = 2

[checkpoint]
every = 1
keep = 3
{extra}
"""
    )
    return path


def final_arrays(job_dir: Path) -> Arrays:
    return load_arrays(job_dir / FINAL_MODEL)


def assert_same_model(got: Arrays, expected: Arrays) -> None:
    assert list(got) == list(expected)
    for key in expected:
        assert got[key].dtype == expected[key].dtype, key
        np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=1e-6, err_msg=key)


def store_rounds(job_dir: Path) -> list[dict[str, Any]]:
    store = RunStore(job_dir / RUNS_DB)
    try:
        (run,) = store.runs()
        return store.rounds(run["run_id"])
    finally:
        store.close()


def store_state(job_dir: Path) -> RunState:
    store = RunStore(job_dir / RUNS_DB)
    try:
        (run,) = store.runs()
        return RunState(run["state"])
    finally:
        store.close()


def decisions(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What each round decided: who was asked, who counted, the tier, the accuracy."""
    return [
        (
            r["round"],
            r["selected"],
            r["on_time"],
            r["late"],
            r["tier"],
            r["stale_folded"],
            round(r["eval_metrics"]["accuracy"], 6),
        )
        for r in rows
    ]


def recorded_rounds(job_dir: Path) -> list[int]:
    """Rounds in the run store, read without creating anything (the runner owns runs.db)."""
    path = job_dir / RUNS_DB
    if not path.exists():
        return []
    conn = sqlite3.connect(path, timeout=5.0)
    try:
        return [int(r[0]) for r in conn.execute("SELECT round FROM rounds ORDER BY round")]
    finally:
        conn.close()


def halt_after(job_dir: Path, server_round: int) -> Callable[[int, int, float | None], None]:
    def progress(done: int, total: int, accuracy: float | None) -> None:
        if done == server_round:
            assert halt_job(job_dir) is RunState.RUNNING  # the job is live: a request
            assert (job_dir / HALT_REQUEST).exists()

    return progress


# ---------------------------------------------------------------- the uninterrupted run


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiered job run straight through (the job directory)."""
    folder = tmp_path_factory.mktemp("reference")
    seen: list[tuple[int, int, float | None]] = []
    result = run_job(write_job(folder), folder / "job", progress=lambda *args: seen.append(args))
    assert result.state is RunState.COMPLETED
    assert seen[0] == (0, ROUNDS, None)
    assert [done for done, _, _ in seen] == list(range(ROUNDS + 1))
    return folder / "job"


@pytest.mark.slow
def test_uninterrupted_run_records_checkpoints_and_saves_the_model(reference: Path) -> None:
    rows = store_rounds(reference)
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert store_state(reference) is RunState.COMPLETED
    assert rows[0]["tier"] is None and len(rows[0]["selected"]) == 10  # profiling round
    assert all(r["tier"] in (0, 1) and len(r["selected"]) == 3 for r in rows[1:])
    # keep = 3: the newest three checkpoints stay; the last is the final model.
    assert checkpoint_rounds(reference) == [ROUNDS - 2, ROUNDS - 1, ROUNDS]
    latest = latest_checkpoint(reference)
    assert latest is not None and latest.round == ROUNDS
    assert_same_model(final_arrays(reference), latest.arrays)
    assert set(latest.strategy_state) >= {"rng", "elapsed_s", "profiles", "tiers", "selection"}
    assert latest.sim["seed"] == SEED and latest.sim["rounds"] == ROUNDS
    (status,) = job_status(reference)
    assert status.state is RunState.COMPLETED and not status.live
    assert (status.last_round, status.rounds, status.checkpoint_round) == (ROUNDS, ROUNDS, ROUNDS)
    assert status.accuracy == pytest.approx(rows[-1]["eval_metrics"]["accuracy"])
    assert status.accuracy is not None and status.accuracy > 0.5
    assert (reference / "job.toml").exists() and (reference / "scenario.toml").exists()
    with pytest.raises(JobError, match="already completed"):
        resume_job(reference)
    with pytest.raises(JobError, match="nothing to halt"):
        halt_job(reference)


@pytest.mark.slow
def test_a_job_directory_holds_one_job(reference: Path) -> None:
    with pytest.raises(JobError, match="already holds a job"):
        run_job(reference / "job.toml", reference)


@pytest.mark.slow
def test_halt_between_rounds_then_resume_ends_with_the_same_model(
    tmp_path: Path, reference: Path
) -> None:
    job_dir = tmp_path / "job"
    halt = halt_after(job_dir, 4)

    def progress(done: int, total: int, accuracy: float | None) -> None:
        if done == 2:  # the job is live: nobody else may run it meanwhile
            with pytest.raises(JobError, match="another process is running the job"):
                resume_job(job_dir)
            (status,) = job_status(job_dir)
            assert status.live and status.state is RunState.RUNNING
        halt(done, total, accuracy)

    halted = run_job(write_job(tmp_path), job_dir, progress=progress)
    assert halted.state is RunState.HALTED
    assert (halted.last_round, halted.final_model, halted.resumed_from) == (4, None, 0)
    assert store_state(job_dir) is RunState.HALTED
    assert [r["round"] for r in store_rounds(job_dir)] == [1, 2, 3, 4]
    assert checkpoint_rounds(job_dir)[-1] == 4
    assert not (job_dir / HALT_REQUEST).exists()
    assert not (job_dir / FINAL_MODEL).exists()
    with pytest.raises(JobError, match="is halted; there is nothing to halt"):
        halt_job(job_dir)

    resumed = resume_job(job_dir)
    assert resumed.state is RunState.COMPLETED
    assert (resumed.resumed_from, resumed.last_round) == (4, ROUNDS)
    assert resumed.final_model == job_dir / FINAL_MODEL
    assert_same_model(final_arrays(job_dir), final_arrays(reference))
    assert decisions(store_rounds(job_dir)) == decisions(store_rounds(reference))
    assert store_state(job_dir) is RunState.COMPLETED


@pytest.mark.slow
def test_late_replies_held_for_staleness_survive_a_resume(tmp_path: Path) -> None:
    rounds = 6
    straight = tmp_path / "straight"
    run_job(write_job(tmp_path / "a", kind="fedavg", params=STALE, rounds=rounds), straight)
    job_dir = tmp_path / "halted"
    manifest = write_job(tmp_path / "b", kind="fedavg", params=STALE, rounds=rounds)
    assert run_job(manifest, job_dir, progress=halt_after(job_dir, 3)).state is RunState.HALTED
    # The checkpoint holds round 3's late replies: round 4 folds them in.
    latest = latest_checkpoint(job_dir)
    assert latest is not None and latest.round == 3
    assert len(latest.late) == 3 and {late.origin_round for late in latest.late} == {3}
    assert all(list(late.arrays) == list(latest.arrays) for late in latest.late)

    assert resume_job(job_dir).state is RunState.COMPLETED
    rows = store_rounds(job_dir)
    assert rows[3]["stale_folded"] == 3
    assert_same_model(final_arrays(job_dir), final_arrays(straight))
    assert decisions(rows) == decisions(store_rounds(straight))


DISTILL = (
    'tiers = 2\nprofiling_rounds = 1\ntier_archs = ["mlp-large", "mlp-small"]\ndistill_epochs = 2'
)


@pytest.mark.slow
def test_a_distillation_job_halts_and_resumes_to_the_same_models(tmp_path: Path) -> None:
    rounds = 4
    straight = tmp_path / "straight"
    manifest = write_job(tmp_path / "a", kind="distill", params=DISTILL, rounds=rounds)
    assert run_job(manifest, straight).state is RunState.COMPLETED
    job_dir = tmp_path / "halted"
    manifest = write_job(tmp_path / "b", kind="distill", params=DISTILL, rounds=rounds)
    assert run_job(manifest, job_dir, progress=halt_after(job_dir, 2)).state is RunState.HALTED
    latest = latest_checkpoint(job_dir)
    assert latest is not None and latest.round == 2
    assert set(latest.extra) == {"mlp-large", "mlp-small"}  # both architectures' models

    assert resume_job(job_dir).state is RunState.COMPLETED
    final = final_arrays(job_dir)
    assert final["0.weight"].shape == (256, 64)  # the global model is the largest arch
    assert_same_model(final, final_arrays(straight))
    assert decisions(store_rounds(job_dir)) == decisions(store_rounds(straight))


def test_a_distillation_job_names_its_bad_parameter(tmp_path: Path) -> None:
    bad = DISTILL.replace('"mlp-small"', '"mlp-huge"')
    with pytest.raises(ManifestError, match=r"strategy\.params.*mlp-huge"):
        run_job(write_job(tmp_path, kind="distill", params=bad), tmp_path / "job")
    assert not (tmp_path / "job").exists()


@pytest.mark.slow
def test_resume_refuses_a_changed_scenario(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    run_job(write_job(tmp_path, rounds=3), job_dir, progress=halt_after(job_dir, 1))
    scenario = job_dir / "scenario.toml"
    scenario.write_text(scenario.read_text().replace("lr = 0.2", "lr = 0.3"))
    with pytest.raises(JobError, match="scenario_sha256"):
        resume_job(job_dir)


def test_commands_on_a_directory_without_a_job(tmp_path: Path) -> None:
    calls: list[Callable[[Path], object]] = [job_status, halt_job, resume_job]
    for call in calls:
        with pytest.raises(JobError, match="no job in"):
            call(tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()


# ---------------------------------------------------------------- checkpoint files


def tiered_strategy() -> TieredFedAvg:
    strategy, _ = build_strategy(
        "tiered",
        {"kind": "tiered", "tiers": 2, "late_policy": "stale"},
        per_round=2,
        seed=11,
        clock=ClockMode.VIRTUAL,
    )
    assert isinstance(strategy, TieredFedAvg)
    return strategy


def model() -> ArrayRecord:
    rng = np.random.default_rng(0)
    return to_array_record(
        {
            "0.weight": rng.random((4, 3)).astype(np.float32),
            "0.bias": rng.random(4).astype(np.float32),
            "steps": np.array(7, dtype=np.int64),
        }
    )


def busy(strategy: StreamingFedAvg) -> None:
    """Give a strategy state in every corner: profiles, tiers, selection, RNG, late replies."""
    assert isinstance(strategy, TieredFedAvg)
    strategy.profiles = {
        1000 + i: LatencyProfile(mean_s=1.0 + i, count=2, last_s=0.5 + i) for i in range(6)
    }
    strategy.elapsed_s = 42.5
    strategy._form_tiers()
    strategy.candidates(3, sorted(strategy.profiles))
    strategy.rng.random(17)
    strategy._late = [_Late({"0.bias": np.full(4, 0.25, dtype=np.float32)}, 12.0, 2, "")]


def test_checkpoint_restores_the_strategy_exactly(tmp_path: Path) -> None:
    strategy = tiered_strategy()
    busy(strategy)
    path = save_checkpoint(tmp_path, 3, model(), strategy, sim={"seed": 11}, keep=None)
    assert path.name == "round-000003.npz"
    loaded = load_checkpoint(path)
    assert loaded.round == 3 and loaded.sim == {"seed": 11}
    assert list(loaded.arrays) == ["0.weight", "0.bias", "steps"]  # keys and order kept
    assert loaded.arrays["steps"].dtype == np.int64
    for key, value in model().items():
        np.testing.assert_array_equal(loaded.arrays[key], value.numpy())
    # The model file is a plain npz: its own keys, plus the reserved entries.
    with np.load(path) as npz:
        assert {"0.weight", "0.bias", "steps", "__checkpoint__"} <= set(npz.files)

    fresh = tiered_strategy()
    restore_strategy(fresh, loaded)
    assert json.dumps(fresh.state_dict(), sort_keys=True, default=str) == json.dumps(
        strategy.state_dict(), sort_keys=True, default=str
    )
    np.testing.assert_array_equal(fresh.rng.random(8), strategy.rng.random(8))
    assert fresh.candidates(4, sorted(fresh.profiles)) == strategy.candidates(
        4, sorted(strategy.profiles)
    )
    assert [(late.weight, late.origin_round) for late in fresh._late] == [(12.0, 2)]
    np.testing.assert_array_equal(fresh._late[0].arrays["0.bias"], np.full(4, 0.25))


def test_checkpoints_are_pruned_and_the_newest_readable_one_wins(tmp_path: Path) -> None:
    strategy = tiered_strategy()
    for server_round in range(1, 6):
        save_checkpoint(tmp_path, server_round, model(), strategy, keep=2)
    assert checkpoint_rounds(tmp_path) == [4, 5]
    (tmp_path / "checkpoints" / "round-000009.npz").write_bytes(b"not a zip")
    (tmp_path / "checkpoints" / ".round-000010.npz.abc.tmp").write_bytes(b"half")
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.round == 5
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "checkpoints" / "round-000009.npz")
    assert latest_checkpoint(tmp_path / "elsewhere") is None


def test_a_crash_while_writing_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    strategy = tiered_strategy()
    save_checkpoint(tmp_path, 1, model(), strategy)

    def crash(file: Any, *args: Any, **kwargs: Any) -> None:
        file.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, model(), strategy)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["round-000001.npz"]
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.round == 1


def test_reserved_array_keys_are_refused(tmp_path: Path) -> None:
    arrays = to_array_record({"__checkpoint__": np.zeros(2, dtype=np.float32)})
    with pytest.raises(CheckpointError, match="reserved"):
        save_checkpoint(tmp_path, 1, arrays, tiered_strategy())


# ---------------------------------------------------------------- the CLI


def cli(*args: str) -> Result:
    """``fedge ARGS`` in this process (the quick commands; runs use real processes)."""
    from fedge.cli.main import app

    return CliRunner().invoke(app, list(args))


def test_every_command_has_help_with_an_example() -> None:
    result = cli("aggregator", "--help")
    assert result.exit_code == 0, result.output
    for command in ("run", "status", "halt", "resume"):
        result = cli("aggregator", command, "--help")
        assert result.exit_code == 0, result.output
        assert f"Example: fedge aggregator {command}" in " ".join(result.output.split())


@pytest.mark.integration
def test_cli_bad_manifest_exits_1_naming_the_field(tmp_path: Path, processes: Processes) -> None:
    manifest = write_job(tmp_path)
    manifest.write_text(manifest.read_text().replace('kind = "tiered"', 'kind = "fedsgd"'))
    job_dir = tmp_path / "job"
    result = processes.cli("aggregator", "run", str(manifest), "--dir", str(job_dir), expect=1)
    stderr = " ".join(result.stderr.split())
    known = "(known: fedavg, fedprox, tiered, distill, nested)"
    assert f"strategy.kind: unknown strategy 'fedsgd' {known}" in stderr
    assert not job_dir.exists()
    status = cli("aggregator", "status", "--dir", str(job_dir))
    assert status.exit_code == 1 and "no job in" in status.stderr
    assert not job_dir.exists()


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_sigkill_mid_run_then_resume_ends_with_the_same_model(
    tmp_path: Path, reference: Path, processes: Processes
) -> None:
    job_dir = tmp_path / "job"
    manifest = write_job(tmp_path)

    # 1. Run the job as `fedge aggregator run` and SIGKILL it once two rounds are recorded.
    run = processes.start("run", "aggregator", "run", str(manifest), "--dir", str(job_dir))
    wait_until(
        lambda: recorded_rounds(job_dir),
        TIMEOUT_S,
        "two recorded rounds",
        expect=lambda rounds: len(rounds) >= 2 or not run.running(),
    )
    processes.signal(run, signal.SIGKILL)
    assert run.popen.wait(timeout=30) == -signal.SIGKILL, run.output()
    killed_at = max(recorded_rounds(job_dir))
    assert killed_at < ROUNDS, "the run finished before it could be killed"
    # Killed: the store still says running, but nobody runs it.
    (status,) = job_status(job_dir)
    assert status.state is RunState.RUNNING and not status.live
    assert status.checkpoint_round is not None and status.checkpoint_round >= killed_at - 1

    # 2. Resume it, and halt the resumed process (a live job) a round past the kill.
    resumed = processes.start("resume", "aggregator", "resume", "--dir", str(job_dir))
    wait_until(
        lambda: recorded_rounds(job_dir),
        TIMEOUT_S,
        f"a round past round {killed_at}",
        expect=lambda rounds: max(rounds) > killed_at or not resumed.running(),
    )
    assert halt_job(job_dir) is RunState.RUNNING, resumed.output()
    assert resumed.popen.wait(timeout=TIMEOUT_S) == 0, resumed.output()
    assert store_state(job_dir) is RunState.HALTED, resumed.output()
    halted_at = max(recorded_rounds(job_dir))
    assert killed_at < halted_at < ROUNDS
    assert "halted after round" in resumed.stdout_path.read_text()

    # 3. The CLI: halting a halted job is an error; resuming it finishes the job.
    halt = cli("aggregator", "halt", "--dir", str(job_dir))
    assert halt.exit_code == 1 and "nothing to halt" in halt.stderr
    result = processes.cli("aggregator", "resume", "--dir", str(job_dir), timeout_s=TIMEOUT_S)
    assert f"completed after round {ROUNDS}/{ROUNDS}" in result.stdout

    # Same final model, every round recorded exactly once, with the same decisions.
    assert_same_model(final_arrays(job_dir), final_arrays(reference))
    rows = store_rounds(job_dir)
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert decisions(rows) == decisions(store_rounds(reference))
    shown = cli("aggregator", "status", "--dir", str(job_dir), "--json")
    assert shown.exit_code == 0, shown.output
    (status_json,) = json.loads(shown.stdout)
    assert status_json["state"] == "completed" and status_json["last_round"] == ROUNDS
    assert status_json["live"] is False
    assert status_json["accuracy"] == pytest.approx(rows[-1]["eval_metrics"]["accuracy"])
