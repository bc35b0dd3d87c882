"""A job with a server optimizer halted after round k and resumed ends with the same arrays,
bit for bit, as an uninterrupted one: the optimizer's moments are in the checkpoint
(issue 29). An in-process fleet of plain ClientApps (no training, no processes)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedge.aggregator.jobs.checkpoint import (
    OPT_PREFIX,
    CheckpointError,
    latest_checkpoint,
    load_arrays,
    restore_strategy,
)
from fedge.aggregator.jobs.directory import FINAL_MODEL, HALT_REQUEST
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.aggregator.jobs.runner import JobRounds, JobRun, execute_job
from fedge.aggregator.jobs.spec import CheckpointSpec
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.fold import StreamingMean
from fedge.aggregator.rounds.loop import EvaluateFn
from fedge.aggregator.rounds.replies import arrays_of
from fedge.aggregator.strategies.factory import build_strategy
from fedge.aggregator.strategies.server_opt import server_step
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.sim.grid import InProcessGrid

ROUNDS = 6
HALT_AFTER = 3
PARTIES = 6
RUN_ID = "job-opt"

# Each party moves the model its own, non-linear way and takes its own (virtual) time, so
# the folded means -- and the optimizer's moments -- differ from round to round.
mover = ClientApp()


@mover.train()
def _train(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    server_round = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
    sent = msg.content.array_records["arrays"]
    scale = np.float32((partition + 1) / 10)
    moved = {
        k: Array((v.numpy() + scale * np.sin(v.numpy() * (partition + 1) + server_round)).astype(
            np.float32
        ))
        for k, v in sent.items()
    }  # fmt: skip
    metrics = MetricRecord({"num-examples": partition + 1, "virtual-time-s": 1.0 + 2.0 * partition})
    return Message(
        content=RecordDict({"arrays": ArrayRecord(moved), "metrics": metrics}), reply_to=msg
    )


PARAMS: dict[str, dict[str, object]] = {
    "fedadam": {"kind": "fedavg", "server_opt": "fedadam", "server_lr": 0.05},
    "tiered-stale-fedyogi": {
        "kind": "tiered", "tiers": 2, "adaptive": False, "server_opt": "fedyogi",
        "server_lr": 0.05, "over_selection": 0.5, "deadline_factor": 1.0,
        "late_policy": "stale",
    },
    "fedavgm": {"kind": "fedprox", "server_opt": "fedavgm", "server_lr": 1.0, "beta1": 0.8},
}  # fmt: skip


def initial() -> ArrayRecord:
    rng = np.random.default_rng(1)
    return ArrayRecord(
        {
            "w": Array(rng.standard_normal((4, 3)).astype(np.float32)),
            "b": Array(np.linspace(-1, 1, 3).astype(np.float32)),
        }
    )


def _job(job_dir: Path, params: dict[str, object]) -> tuple[JobRun, Any]:
    job_dir.mkdir(parents=True)
    store = RunStore(job_dir / "runs.db")
    store.create_run(RUN_ID, "[job]\n", RunState.QUEUED)
    run = JobRun(
        job_dir=job_dir,
        store=store,
        run_id=RUN_ID,
        rounds=ROUNDS,
        checkpoint=CheckpointSpec(every=1, keep=10),
        resume_state={"run_id": RUN_ID},
    )

    def build() -> JobRounds:
        strategy, _ = build_strategy("s", params, per_round=2, seed=5, clock=ClockMode.VIRTUAL)

        @contextmanager
        def open_grid() -> Iterator[Grid]:
            grid = InProcessGrid(mover, PARTIES, workers=1)
            try:
                yield grid
            finally:
                grid.close()

        def evaluation(grid: Grid) -> EvaluateFn:
            return lambda server_round, arrays: MetricRecord({"accuracy": 0.5})

        return JobRounds(
            strategy=strategy,
            initial_arrays=initial,
            open_grid=open_grid,
            evaluation=evaluation,
            train_config=ConfigRecord({"lr": 0.1}),
            round_timeout_s=30,
            max_weight=10.0,
        )

    return run, build


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_a_halted_and_resumed_job_ends_bit_identical_to_an_uninterrupted_one(
    tmp_path: Path, name: str
) -> None:
    straight, build = _job(tmp_path / "straight", PARAMS[name])
    assert execute_job(straight, build).state is RunState.COMPLETED

    halted, build = _job(tmp_path / "halted", PARAMS[name])

    def halt_after(done: int, total: int, accuracy: float | None) -> None:
        if done == HALT_AFTER:
            (halted.job_dir / HALT_REQUEST).write_text("{}")

    first = execute_job(halted, build, progress=halt_after)
    assert first.state is RunState.HALTED and first.last_round == HALT_AFTER
    checkpoint = latest_checkpoint(halted.job_dir)
    assert checkpoint is not None and checkpoint.round == HALT_AFTER
    assert checkpoint.strategy_state["server_opt"]["step"] == HALT_AFTER
    assert set(checkpoint.server_opt["m"]) == {"w", "b"}
    with np.load(checkpoint.path) as npz:
        assert f"{OPT_PREFIX}m.w" in npz.files

    resumed = execute_job(halted, build)
    assert resumed.state is RunState.COMPLETED and resumed.resumed_from == HALT_AFTER
    ours, theirs = (
        load_arrays(halted.job_dir / FINAL_MODEL),
        load_arrays(straight.job_dir / FINAL_MODEL),
    )
    if name == "tiered-stale-fedyogi":  # late replies were held across the halt and folded
        assert any(row["stale_folded"] for row in halted.store.rounds(RUN_ID))
    assert list(ours) == list(theirs)
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype
        assert ours[key].tobytes() == theirs[key].tobytes(), key
    straight.store.close()
    halted.store.close()


def test_without_its_moments_a_resume_would_not_be_identical(tmp_path: Path) -> None:
    """The check above means something: the moments change the next step."""
    checkpoint_dir_run, build2 = _job(tmp_path / "job", PARAMS["fedadam"])

    def halt_after(done: int, total: int, accuracy: float | None) -> None:
        if done == 2:
            (checkpoint_dir_run.job_dir / HALT_REQUEST).write_text("{}")

    execute_job(checkpoint_dir_run, build2, progress=halt_after)
    checkpoint = latest_checkpoint(checkpoint_dir_run.job_dir)
    assert checkpoint is not None
    strategy = build2().strategy
    restore_strategy(strategy, checkpoint)
    sent = arrays_of(checkpoint.array_record())
    mean = {k: v + np.float32(0.1) for k, v in sent.items()}
    assert strategy.server_opt is not None
    with_moments, _ = server_step(strategy.server_opt, strategy.server_opt_state, sent, mean)
    fresh = type(strategy.server_opt_state)()
    without, _ = server_step(strategy.server_opt, fresh, sent, mean)
    assert not np.array_equal(with_moments["w"], without["w"])
    # A checkpoint whose moments were lost is refused, not resumed from zeros.
    broken = type(checkpoint)(**{**checkpoint.__dict__, "server_opt": {}})
    with pytest.raises(CheckpointError, match="moments are missing"):
        restore_strategy(build2().strategy, broken)
    # ... and so is one resumed under another optimizer.
    other, _ = build_strategy(
        "s", {"kind": "fedavg", "server_opt": "fedyogi"}, per_round=2, seed=5,
        clock=ClockMode.VIRTUAL,
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="'fedadam', the strategy's 'fedyogi'"):
        restore_strategy(other, checkpoint)
    checkpoint_dir_run.store.close()


class _Recording(StreamingFedAvg):
    """Notes each round's sent model and folded mean (what the optimizer steps on)."""

    seen: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]

    def aggregate(
        self,
        server_round: int,
        arrays: ArrayRecord,
        folds: dict[str, StreamingMean],
        metrics: dict[str, float],
    ) -> ArrayRecord:
        mean = super().aggregate(server_round, arrays, folds, metrics)
        self.seen.append((arrays_of(arrays), arrays_of(mean)))
        return mean


def test_the_loop_steps_from_the_model_sent_along_the_folded_mean() -> None:
    reference, _ = build_strategy(
        "s", PARAMS["fedadam"], per_round=2, seed=5, clock=ClockMode.VIRTUAL
    )
    strategy = _Recording(
        per_round=2, seed=5, clock=ClockMode.VIRTUAL, server_opt=reference.server_opt
    )
    strategy.seen = []
    grid = InProcessGrid(mover, PARTIES, workers=1)
    try:
        result = strategy.start(grid, initial(), num_rounds=3, timeout=30)
    finally:
        grid.close()
    assert reference.server_opt is not None
    state = reference.server_opt_state
    model = arrays_of(initial())
    for sent, mean in strategy.seen:
        assert all(np.array_equal(sent[k], model[k]) for k in model)
        model, state = server_step(reference.server_opt, state, sent, mean)
    final = arrays_of(result.arrays)
    assert all(np.array_equal(final[k], model[k]) for k in model)
    assert strategy.server_opt_state.step == 3
