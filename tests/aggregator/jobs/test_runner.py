"""The one job runner with an in-process fleet of plain ClientApps (no training, no
processes): states, resume, the past-last-round shortcut, records and checkpoints."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedge.aggregator.jobs.checkpoint import (
    checkpoint_rounds,
    latest_checkpoint,
    load_arrays,
)
from fedge.aggregator.jobs.directory import FINAL_MODEL, HALT_REQUEST, JobError
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.aggregator.jobs.runner import JobResult, JobRounds, JobRun, execute_job
from fedge.aggregator.jobs.spec import CheckpointSpec
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.loop import EvaluateFn
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.sim.grid import InProcessGrid

ROUNDS = 4
RUN_ID = "job-1"

# A plain Flower ClientApp: adds (partition + 1) / 10 to the weights at once.
adder = ClientApp()


@adder.train()
def _train(msg: Message, context: Context) -> Message:
    step = (int(context.node_config["partition-id"]) + 1) / 10
    arrays = msg.content.array_records["arrays"]
    updated = {k: Array(v.numpy() + np.float32(step)) for k, v in arrays.items()}
    content = RecordDict(
        {"arrays": ArrayRecord(array_dict=updated), "metrics": MetricRecord({"num-examples": 1})}
    )
    return Message(content=content, reply_to=msg)


def _value(arrays: ArrayRecord) -> float:
    return float(arrays["w"].numpy()[0])


class Job:
    """A job directory, its run store and what trains it; counts what the runner opens."""

    def __init__(self, job_dir: Path, *, resume_state: dict[str, object] | None = None) -> None:
        self.job_dir = job_dir
        job_dir.mkdir(parents=True, exist_ok=True)
        self.store = RunStore(job_dir / "runs.db")
        if self.store.run(RUN_ID) is None:
            self.store.create_run(RUN_ID, "[job]\n", RunState.QUEUED)
        self.resume_state = resume_state or {"run_id": RUN_ID, "seed": 0}
        self.grids_opened = 0
        self.evaluated: list[int] = []
        self.progress: list[tuple[int, int, float | None]] = []
        self.strategy: StreamingFedAvg | None = None
        self.fail_in_round: int | None = None

    def run(self) -> JobRun:
        return JobRun(
            job_dir=self.job_dir,
            store=self.store,
            run_id=RUN_ID,
            rounds=ROUNDS,
            checkpoint=CheckpointSpec(every=2, keep=10),
            resume_state=self.resume_state,
        )

    def build(self) -> JobRounds:
        self.strategy = StreamingFedAvg(per_round=3, seed=0, clock=ClockMode.VIRTUAL)

        @contextmanager
        def open_grid() -> Iterator[Grid]:
            self.grids_opened += 1
            grid = InProcessGrid(adder, 3, workers=1)
            try:
                yield grid
            finally:
                grid.close()

        def evaluation(grid: Grid) -> EvaluateFn:
            assert list(grid.get_node_ids())  # the grid it is given is the open one

            def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
                if server_round == self.fail_in_round:
                    raise RuntimeError("the test set is gone")
                self.evaluated.append(server_round)
                return MetricRecord({"accuracy": _value(arrays) / 10})

            return evaluate

        return JobRounds(
            strategy=self.strategy,
            initial_arrays=lambda: ArrayRecord({"w": Array(np.zeros(2, dtype=np.float32))}),
            open_grid=open_grid,
            evaluation=evaluation,
            train_config=ConfigRecord({"lr": 0.1}),
            round_timeout_s=30,
            max_weight=1.0,
        )

    def execute(self) -> JobResult:
        return execute_job(
            self.run(), self.build, progress=lambda *seen: self.progress.append(seen)
        )

    def state(self) -> tuple[RunState, str]:
        run = self.store.run(RUN_ID)
        assert run is not None
        return RunState(run["state"]), str(run["error"])


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    made = Job(tmp_path / "job")
    yield made
    made.store.close()


def _final(job_dir: Path) -> float:
    return float(load_arrays(job_dir / FINAL_MODEL)["w"][0])


def test_a_job_runs_to_completion_recording_and_checkpointing_each_round(job: Job) -> None:
    result = job.execute()
    assert result.state is RunState.COMPLETED and job.state() == (RunState.COMPLETED, "")
    assert (result.last_round, result.rounds, result.resumed_from) == (ROUNDS, ROUNDS, 0)
    assert result.final_model == job.job_dir / FINAL_MODEL
    # Each round adds the mean step, 0.2: the final model is the fourth round's.
    assert _final(job.job_dir) == pytest.approx(0.8)
    assert result.accuracy == pytest.approx(0.08)
    assert job.evaluated == [0, 1, 2, 3, 4]
    rows = job.store.rounds(RUN_ID)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["eval_metrics"]["accuracy"] == pytest.approx(0.08)
    assert checkpoint_rounds(job.job_dir) == [2, 4]  # every 2, and the last
    assert [p[0] for p in job.progress] == [0, 1, 2, 3, 4]
    assert job.strategy is not None and job.strategy.job_id == RUN_ID
    assert job.grids_opened == 1


def test_a_halted_job_resumes_after_its_checkpoint_to_the_same_model(tmp_path: Path) -> None:
    straight = Job(tmp_path / "straight")
    straight.execute()
    halted = Job(tmp_path / "halted")

    def halt_after_1(*seen: object) -> None:
        halted.progress.append(seen)  # type: ignore[arg-type]
        if seen[0] == 1:
            (halted.job_dir / HALT_REQUEST).write_text("{}")

    result = execute_job(halted.run(), halted.build, progress=halt_after_1)
    assert result.state is RunState.HALTED and result.last_round == 1
    assert halted.state()[0] is RunState.HALTED
    assert not (halted.job_dir / HALT_REQUEST).exists()
    assert checkpoint_rounds(halted.job_dir) == [1]  # a halt checkpoints off cadence
    assert not (halted.job_dir / FINAL_MODEL).exists() and result.final_model is None

    halted.evaluated.clear()
    resumed = halted.execute()
    assert resumed.state is RunState.COMPLETED and resumed.resumed_from == 1
    assert halted.evaluated == [2, 3, 4]  # no round 0 on a resume
    assert halted.progress[-4][0] == 1  # it reports where it resumed
    assert [r["round"] for r in halted.store.rounds(RUN_ID)] == [1, 2, 3, 4]
    assert _final(halted.job_dir) == _final(straight.job_dir)
    straight.store.close()
    halted.store.close()


def test_a_halt_requested_before_the_first_round_opens_no_grid(job: Job) -> None:
    (job.job_dir / HALT_REQUEST).write_text("{}")
    result = job.execute()
    assert result.state is RunState.HALTED and result.last_round == 0
    assert job.grids_opened == 0 and job.store.rounds(RUN_ID) == []
    assert not (job.job_dir / HALT_REQUEST).exists()


def test_a_job_killed_after_its_last_checkpoint_only_writes_its_final_model(job: Job) -> None:
    job.execute()
    (job.job_dir / FINAL_MODEL).unlink()
    job.store.set_state(RUN_ID, RunState.RUNNING)  # as a SIGKILL before completing leaves it
    job.evaluated.clear()
    result = job.execute()
    assert result.state is RunState.COMPLETED and result.resumed_from == ROUNDS
    assert job.grids_opened == 1 and job.evaluated == []  # the second run opened nothing
    assert _final(job.job_dir) == pytest.approx(0.8)
    assert result.accuracy == pytest.approx(0.08)  # read back from the run store


def test_a_checkpoint_of_another_job_is_refused_before_anything_changes(tmp_path: Path) -> None:
    first = Job(tmp_path / "job")
    first.execute()
    first.store.set_state(RUN_ID, RunState.HALTED)
    first.store.close()
    other = Job(tmp_path / "job", resume_state={"run_id": RUN_ID, "seed": 1})
    with pytest.raises(JobError, match=r"written with seed = 0, but the job now has 1"):
        other.execute()
    assert other.state()[0] is RunState.HALTED and other.grids_opened == 0
    assert latest_checkpoint(other.job_dir) is not None
    other.store.close()


def test_a_failing_round_fails_the_job_saying_after_which_round(job: Job) -> None:
    job.fail_in_round = 3
    with pytest.raises(JobError, match=r"failed after round 2: RuntimeError: the test set is gone"):
        job.execute()
    assert job.state() == (RunState.FAILED, "RuntimeError: the test set is gone")
    job.fail_in_round = None
    resumed = job.execute()  # resumed from round 2's checkpoint
    assert resumed.state is RunState.COMPLETED and resumed.resumed_from == 2
    assert _final(job.job_dir) == pytest.approx(0.8)


def test_a_job_that_cannot_be_built_fails(job: Job) -> None:
    def build() -> JobRounds:
        raise ValueError("no such data set")

    with pytest.raises(JobError, match="failed after round 0: ValueError: no such data set"):
        execute_job(job.run(), build)
    assert job.state() == (RunState.FAILED, "ValueError: no such data set")


def test_the_callers_verdict_fails_a_job_whose_rounds_all_ran(job: Job) -> None:
    result = execute_job(job.run(), job.build, verdict=lambda: "nobody trained")
    assert result.state is RunState.FAILED and result.final_model is None
    assert job.state() == (RunState.FAILED, "nobody trained")


def test_an_interrupted_job_is_halted_and_resumable(job: Job) -> None:
    def interrupt(*seen: object) -> None:
        if seen[0] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute_job(job.run(), job.build, progress=interrupt)
    assert job.state() == (RunState.HALTED, "interrupted (resume to continue)")
    assert job.execute().state is RunState.COMPLETED
