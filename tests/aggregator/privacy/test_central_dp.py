"""Central DP accounts what it really released (issue 12, reviewer's defects).

A toy ClientApp on the in-process grid (no training: each party moves the model by a fixed
step) so every round's inputs are known: who folded, who failed, who sent junk.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from typer.testing import CliRunner

from fedge.aggregator.driver import start_rounds
from fedge.aggregator.fleet.grids import NODE_ID_BASE
from fedge.aggregator.jobs.control import job_status
from fedge.aggregator.jobs.directory import RUNS_DB
from fedge.aggregator.jobs.run_store import CENTRAL_DP_ROW, RunStore
from fedge.aggregator.privacy.central_dp import CentralDP, check_rounds, station_epsilon
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.strategies.factory import StrategyConfigError, build_strategy
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.cli.main import app as cli
from fedge.privacy.accounting import epsilon_spent
from fedge.privacy.settings import DpRelease, PrivacyError
from fedge.sim.grid import InProcessGrid

SIGMA = 1.0
PARTIES = 4


def party(
    *, junk: int | None = None, fails: dict[int, int] | None = None, calls: list[int] | None = None
) -> ClientApp:
    """Each party adds 0.1 to the model. Partition ``junk`` replies with the wrong shape;
    ``fails`` {partition: round} raises in that round."""
    client = ClientApp()

    @client.train()
    def _train(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        server_round = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
        if calls is not None:
            calls.append(partition)
        if (fails or {}).get(partition) == server_round:
            raise RuntimeError("camera unplugged")
        sent = msg.content.array_records["arrays"]
        arrays = ArrayRecord({k: Array(v.numpy() + 0.1) for k, v in sent.items()})
        if partition == junk:
            arrays = ArrayRecord({"w": Array(np.ones((7, 7), np.float32))})
        metrics = MetricRecord({"num-examples": 10 + partition, "virtual-time-s": 1.0 + partition})
        return Message(content=RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    return client


def central(*, epsilon: float | None = None, **params: object) -> StreamingFedAvg:
    privacy: dict[str, object] = {
        "mode": "central",
        "noise_multiplier": SIGMA,
        "clipping_norm": 0.5,
    }
    if epsilon is not None:
        privacy["epsilon"] = epsilon
    strategy, _ = build_strategy(
        "fedavg",
        {"privacy": privacy, **params},
        per_round=PARTIES,
        seed=0,
        clock=ClockMode.VIRTUAL,
    )
    return strategy


INITIAL = ArrayRecord({"w": Array(np.zeros(16, np.float32))})


def run(
    strategy: StreamingFedAvg, client: ClientApp, rounds: int
) -> tuple[CentralDP, list[RoundRecord], dict[int, np.ndarray]]:
    records: list[RoundRecord] = []
    strategy.observers.append(records.append)
    models: dict[int, np.ndarray] = {}

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        models[server_round] = arrays["w"].numpy().copy()
        return MetricRecord({"accuracy": 0.5})

    grid = InProcessGrid(client, PARTIES)
    try:
        _, wrapper = start_rounds(
            strategy, grid, INITIAL, num_rounds=rounds, timeout=30, evaluate_fn=evaluate
        )
    finally:
        grid.close()
    assert wrapper is not None
    return wrapper, records, models


def releases(*sigmas: float) -> float:
    return epsilon_spent([DpRelease(s, 1.0, 1) for s in sigmas], 1e-3, "rdp")


def test_a_malformed_reply_is_accounted_at_the_effective_noise() -> None:
    """3 of 4 updates folded: noise sized for 4 is sigma * 3/4 for the mean of 3."""
    strategy = central()
    wrapper, records, _ = run(strategy, party(junk=2), rounds=3)
    junk = NODE_ID_BASE + 2
    assert [len(r.on_time) for r in records] == [3, 3, 3]
    for record in records:
        assert junk in record.failed and "malformed reply" in record.failures[junk]
        assert record.train_metrics["dp-released"] == 1.0
        assert record.train_metrics["dp-noise-multiplier-effective"] == pytest.approx(0.75)
    assert wrapper.releases == {1: 0.75, 2: 0.75, 3: 0.75}
    spent = [r.train_metrics["dp-epsilon-station"] for r in records]
    assert spent == pytest.approx([releases(*[0.75] * n) for n in (1, 2, 3)])
    # More than the full-sigma figure the job was planned with.
    assert spent[-1] > station_epsilon(strategy.privacy, 3) * 1.2
    assert wrapper.epsilon_by_round[3] == spent[-1]


def test_every_update_folded_is_accounted_at_the_full_sigma() -> None:
    wrapper, records, _ = run(central(), party(), rounds=2)
    assert wrapper.releases == {1: SIGMA, 2: SIGMA}
    assert records[-1].train_metrics["dp-epsilon-station"] == station_epsilon(wrapper.spec, 2)


def test_a_round_with_an_error_reply_is_recorded_and_not_released() -> None:
    strategy = central()
    wrapper, records, models = run(strategy, party(fails={3: 2}), rounds=3)
    assert [r.server_round for r in records] == [1, 2, 3]  # the observers saw round 2
    failed = NODE_ID_BASE + 3
    second = records[1]
    assert second.failed == (failed,) and "camera unplugged" in second.failures[failed]
    assert second.train_metrics["dp-released"] == 0.0
    assert second.eval_metrics == {"accuracy": 0.5}
    np.testing.assert_array_equal(models[2], models[1])  # nothing released
    assert not np.array_equal(models[3], models[2])
    assert wrapper.releases == {1: SIGMA, 3: SIGMA}
    assert second.train_metrics["dp-epsilon-station"] == station_epsilon(wrapper.spec, 1)
    assert records[2].train_metrics["dp-epsilon-station"] == station_epsilon(wrapper.spec, 2)
    # The failed party's latency profile saw the round (charged as a timeout).
    assert strategy.profiles[failed].timeouts == 1
    assert strategy.profiles[failed].count == 3


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"late_policy": "stale"}, "late_policy"),
        ({"kind": "tiered", "tiers": 2, "profiling_deadline_s": 5.0}, "profiling_deadline_s"),
        ({"deadline_factor": 1.5}, "remove deadline_factor"),
    ],
)
def test_central_dp_refuses_what_would_fold_an_update_twice_or_cut_the_mean(
    params: dict[str, object], message: str
) -> None:
    kind = str(params.pop("kind", "fedavg"))
    with pytest.raises(StrategyConfigError, match=message):
        build_strategy(
            kind,
            {"privacy": {"mode": "central", "noise_multiplier": 1.0}, **params},
            per_round=2,
            seed=0,
            clock=ClockMode.VIRTUAL,
        )


def test_too_many_rounds_for_the_epsilon_are_refused_before_any_training() -> None:
    strategy = central(epsilon=10.0)
    spec = strategy.privacy
    affordable = max(r for r in range(1, 50) if station_epsilon(spec, r) <= 10.0)
    calls: list[int] = []
    grid = InProcessGrid(party(calls=calls), PARTIES)
    try:
        with pytest.raises(PrivacyError) as refused:
            start_rounds(strategy, grid, INITIAL, num_rounds=affordable + 1, timeout=30)
    finally:
        grid.close()
    assert calls == []  # no party was asked anything
    text = str(refused.value)
    cost = station_epsilon(spec, affordable + 1)
    for part in (
        f"{affordable + 1} rounds",
        "noise_multiplier = 1",
        f"{cost:.3f}",
        "privacy.epsilon = 10",
        f"at most {affordable} rounds",
        "raise privacy.noise_multiplier",
    ):
        assert part in text, text
    # The suggested noise does fit.
    sigma = float(text.rsplit("noise_multiplier to ", 1)[1].split()[0])
    check_rounds(dataclasses.replace(spec, noise_multiplier=sigma), affordable + 1)
    # A manifest that knows its rounds is refused when the strategy is built.
    with pytest.raises(StrategyConfigError, match=f"at most {affordable} rounds"):
        build_strategy(
            "fedavg",
            {"privacy": {"mode": "central", "noise_multiplier": 1.0, "epsilon": 10.0}},
            per_round=PARTIES,
            seed=0,
            clock=ClockMode.VIRTUAL,
            rounds=affordable + 1,
        )


def test_the_job_stops_before_a_release_would_pass_its_epsilon() -> None:
    """Planned at full sigma the rounds fit; folding 3 of 4 spends more, so the job stops
    where the next release would pass the bound and never releases past it."""
    plan = central().privacy
    rounds = 6
    bound = station_epsilon(plan, rounds)
    wrapper, records, _ = run(central(epsilon=bound), party(junk=0), rounds=rounds)
    assert wrapper.stopped
    released = len(wrapper.releases)
    assert 1 <= released < rounds
    assert wrapper.epsilon() <= bound
    assert releases(*[0.75] * (released + 1)) > bound  # one more would have passed it
    assert all(r.train_metrics["dp-epsilon-station"] <= bound for r in records)


def test_status_shows_the_station_epsilon_of_central_dp(tmp_path: Path) -> None:
    strategy = central()
    store = RunStore(tmp_path / RUNS_DB)
    store.create_run("run-1", '[job]\nname = "central"\nrounds = 3\n')
    strategy.observers.append(lambda record: store.record_round("run-1", record))
    try:
        wrapper, _, _ = run(strategy, party(fails={1: 2}), rounds=3)
    finally:
        store.close()
    (status,) = job_status(tmp_path)
    (row,) = status.privacy
    assert row["name"] == CENTRAL_DP_ROW
    assert (row["rounds"], row["last_round"]) == (2, 3)  # round 2 released nothing
    assert row["epsilon_job"] == pytest.approx(wrapper.epsilon())
    shown = CliRunner().invoke(cli, ["aggregator", "status", "--dir", str(tmp_path)])
    assert shown.exit_code == 0, shown.output
    assert "all stations" in shown.output
    assert f"{wrapper.epsilon():.3f}" in shown.output


def test_a_resumed_job_accounts_the_releases_of_its_checkpoint() -> None:
    """The effective sigmas are strategy state: a fresh strategy loaded from it goes on."""
    first = central()
    wrapper, _, _ = run(first, party(junk=1), rounds=2)
    state = first.state_dict()
    resumed = central()
    resumed.load_state_dict(state)
    again = CentralDP(resumed)
    assert again.releases == {1: 0.75, 2: 0.75}
    assert again.epsilon() == wrapper.epsilon()
