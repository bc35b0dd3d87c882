"""SecAgg+ (Flower's) composed with our strategies, on Flower's simulation runtime.

One simulation (Ray, 6 parties, a 2-array model) runs every phase the tests check, each
with its own strategy: plain SecAgg+ rounds, a party killed before its masked vector, a
party killed before unmasking, TiFL tiers over SecAgg+ (two tiers of three), and rounds of
three parties one of which is killed (abandoned: two must never be unmasked, issue 24).
The server side records what its strategy received (``SecAggRound.aggregate_fit``) and
every reply the server got off the grid. Bad input is refused before anything is sent
(no simulation needed).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import FitRes, bytes_to_ndarray, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.serverapp import Grid, ServerApp

from fedge.aggregator.fleet.grids import NODE_ID_BASE
from fedge.aggregator.fleet.identity import PartitionOrderedGrid
from fedge.aggregator.fleet.manifest import parse_fleet_manifest
from fedge.aggregator.jobs.spec import ManifestError
from fedge.aggregator.privacy.secagg import SecAggSettings, quantization_error_bound, run_secagg
from fedge.aggregator.privacy.secagg_round import (
    ABANDONED,
    SecAggRound,
    StageRecorder,
    _DeadlineWorkflow,
    check_survivors,
)
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.deadline import DeadlineConfig
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.aggregator.strategies.tiered import TieredFedAvg
from fedge.bench import secagg_apps
from fedge.bench.secagg_apps import examples_of, local_accuracy_of, party_update, secagg_app
from fedge.party.secagg import is_secagg_message, secagg_mod
from fedge.privacy.settings import PrivacyError, PrivacySpec
from fedge.sim.flower_backend import launch_simulation
from fedge.sim.grid import InProcessGrid

PARTIES = 6
SETTINGS = SecAggSettings(reconstruction_threshold=0.5, max_weight=16.0, key_stage_timeout_s=30)


def initial() -> ArrayRecord:
    rng = np.random.default_rng(3)
    return ArrayRecord(
        {
            "weight": Array(rng.standard_normal((6, 5)).astype(np.float32)),
            "bias": Array(np.linspace(-1, 1, 5).astype(np.float32)),
        }
    )


def as_dict(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in record.items()}


def plain_mean(arrays: dict[str, np.ndarray], partitions: list[int]) -> dict[str, np.ndarray]:
    weights = np.array([examples_of(p) for p in partitions], dtype=np.float64)
    updates = [party_update(arrays, p) for p in partitions]
    return {
        k: sum(w * u[k].astype(np.float64) for w, u in zip(weights, updates, strict=True))
        / weights.sum()
        for k in arrays
    }


def bound_for(arrays: dict[str, np.ndarray], partitions: list[int]) -> float:
    updates = [party_update(arrays, p) for p in partitions]
    largest = max(float(np.abs(v).max()) for u in updates for v in u.values())
    return quantization_error_bound(
        [examples_of(p) for p in partitions],
        largest,
        clipping_range=SETTINGS.clipping_range,
        quantization_range=SETTINGS.quantization_range,
        max_weight=SETTINGS.max_weight,
    )


class RecordingGrid(StageRecorder):
    """Keeps every reply the server pulled off the grid (what the server ever held)."""

    def __init__(self, inner: Grid, into: list[Message]) -> None:
        super().__init__(inner)
        self.into = into

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        self.into.extend(replies)
        return replies


@dataclass
class Phase:
    sent: dict[str, np.ndarray]
    model: dict[str, np.ndarray]
    records: list[RoundRecord] = field(default_factory=list)
    fit_results: list[list[FitRes]] = field(default_factory=list)
    replies: list[Message] = field(default_factory=list)


class FirstThree(StreamingFedAvg):
    """Asks partitions 0, 1 and 2 only (the grid shows them first)."""

    def trainable(self, grid: Grid) -> list[int]:
        return super().trainable(grid)[:3]


@dataclass
class Observed:
    phases: dict[str, Phase] = field(default_factory=dict)
    tiered: TieredFedAvg | None = None
    accuracies: list[tuple[int, float | None]] = field(default_factory=list)


def _run_phase(
    observed: Observed,
    name: str,
    grid: Grid,
    strategy: StreamingFedAvg,
    config: dict[str, int | str],
    rounds: int = 1,
) -> None:
    arrays = initial()
    phase = Phase(sent=as_dict(arrays), model={})
    observed.phases[name] = phase
    strategy.observers.append(phase.records.append)
    original = SecAggRound.aggregate_fit

    def spy(self: SecAggRound, server_round: int, results: Any, failures: Any) -> Any:
        phase.fit_results.append([res for _, res in results])
        return original(self, server_round, results, failures)

    SecAggRound.aggregate_fit = spy  # type: ignore[method-assign]
    try:
        result = run_secagg(
            grid,
            strategy,
            arrays,
            SETTINGS,
            num_rounds=rounds,
            train_config=ConfigRecord(dict(config)),
            timeout=30,
            recorder=lambda wire: RecordingGrid(wire, phase.replies),
        )
    finally:
        SecAggRound.aggregate_fit = original  # type: ignore[method-assign]
    phase.model = as_dict(result.arrays) if result.arrays is not None else {}


@pytest.fixture(scope="module")
def observed() -> Iterator[Observed]:
    observed = Observed()
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        ordered = PartitionOrderedGrid(grid)
        wait_for_parties(ordered, PARTIES)
        _run_phase(observed, "plain", ordered, StreamingFedAvg(per_round=PARTIES), {})
        killed: dict[str, int | str] = {
            secagg_apps.DROP_PARTITION: 1,
            secagg_apps.DROP_STAGE: "collect",
        }
        _run_phase(observed, "collect", ordered, StreamingFedAvg(per_round=PARTIES), killed)
        killed = {secagg_apps.DROP_PARTITION: 2, secagg_apps.DROP_STAGE: "unmask"}
        _run_phase(observed, "unmask", ordered, StreamingFedAvg(per_round=PARTIES), killed)
        killed = {secagg_apps.DROP_PARTITION: 1, secagg_apps.DROP_STAGE: "collect"}
        _run_phase(observed, "three", ordered, FirstThree(per_round=3), killed, rounds=2)
        # min_tier_size left at 1: run_secagg raises it to SecAgg+'s 3.
        tiered = TieredFedAvg(
            n_tiers=3, per_round=3, seed=2, adaptive=False, clock=ClockMode.VIRTUAL
        )
        tiered.observers.append(
            lambda r: observed.accuracies.append(
                (r.server_round, None if tiered.selection is None else _tier_acc(tiered, r))
            )
        )
        observed.tiered = tiered
        _run_phase(observed, "tiered", ordered, tiered, {}, rounds=4)

    launch_simulation(server_app, secagg_app, PARTIES, {"seed": 1})
    yield observed


def wait_for_parties(grid: Grid, count: int, wait_s: float = 60.0) -> None:
    """Flower's simulation registers its nodes while the ServerApp starts."""
    end = time.monotonic() + wait_s
    while len(list(grid.get_node_ids())) < count:
        assert time.monotonic() < end, f"fewer than {count} parties joined in {wait_s} s"
        time.sleep(0.2)


def _tier_acc(strategy: TieredFedAvg, record: RoundRecord) -> float | None:
    if record.tier is None or strategy.selection is None:
        return None
    history = strategy.selection.accuracy_history[record.tier]
    rounds = strategy.selection.accuracy_rounds[record.tier]
    return history[-1] if rounds and rounds[-1] == record.server_round else None


@pytest.mark.integration
def test_aggregate_equals_the_plain_mean_within_the_quantization_bound(observed: Observed) -> None:
    phase = observed.phases["plain"]
    partitions = list(range(PARTIES))
    expected = plain_mean(phase.sent, partitions)
    bound = bound_for(phase.sent, partitions)
    assert bound < 1e-3  # the test is in the regime the bound covers (no clipping)
    error = max(float(np.abs(phase.model[k] - expected[k]).max()) for k in expected)
    assert error <= bound
    assert phase.model["weight"].dtype == np.float32 and phase.model["weight"].shape == (6, 5)
    (record,) = phase.records
    assert sorted(record.on_time) == [NODE_ID_BASE + p for p in partitions]
    assert record.failed == () and record.quorum_met
    assert record.train_metrics["local-acc"] == pytest.approx(0.15, abs=0.1)


@pytest.mark.integration
def test_the_strategy_only_ever_sees_the_aggregate(observed: Observed) -> None:
    phase = observed.phases["plain"]
    (results,) = phase.fit_results
    assert len(results) == PARTIES
    received = [parameters_to_ndarrays(res.parameters) for res in results]
    for arrays in received[1:]:  # every FitRes carries the same aggregate ...
        assert all(np.array_equal(a, b) for a, b in zip(arrays, received[0], strict=True))
    expected = plain_mean(phase.sent, list(range(PARTIES)))
    weight = received[0][0]
    assert np.abs(weight - expected["weight"]).max() <= bound_for(phase.sent, list(range(4)))
    for partition in range(PARTIES):  # ... which is no party's own update
        own = party_update(phase.sent, partition)["weight"]
        assert np.abs(weight - own).max() > 1e-3


@pytest.mark.integration
def test_no_reply_the_server_received_holds_a_raw_update(observed: Observed) -> None:
    phase = observed.phases["plain"]
    updates = [party_update(phase.sent, p) for p in range(PARTIES)]
    assert len(phase.replies) == 4 * PARTIES  # four stages, every party answered each
    decoded = 0
    for reply in phase.replies:
        assert not reply.has_error()
        for arrays in reply.content.array_records.values():
            assert len(arrays) == 0  # secaggplus_mod emptied the update it masked
        for config in reply.content.config_records.values():
            for value in config.values():
                for blob in value if isinstance(value, list) else [value]:
                    if not isinstance(blob, bytes) or not blob.startswith(b"\x93NUMPY"):
                        continue
                    vector = bytes_to_ndarray(blob)
                    decoded += 1
                    for update in updates:
                        for raw in update.values():
                            if vector.shape == raw.shape:
                                assert not np.allclose(vector, raw, atol=1e-2)
    assert decoded == PARTIES * 3  # the masked vectors: a factor and two arrays each


@pytest.mark.integration
def test_a_party_killed_before_its_masked_vector_leaves_the_aggregate_of_the_rest(
    observed: Observed,
) -> None:
    phase = observed.phases["collect"]
    rest = [p for p in range(PARTIES) if p != 1]
    expected = plain_mean(phase.sent, rest)
    error = max(float(np.abs(phase.model[k] - expected[k]).max()) for k in expected)
    assert error <= bound_for(phase.sent, rest)
    (record,) = phase.records
    assert record.failed == (NODE_ID_BASE + 1,)
    assert sorted(record.on_time) == [NODE_ID_BASE + p for p in rest]
    assert "collect_masked_vectors" in record.failures[NODE_ID_BASE + 1]


@pytest.mark.integration
def test_a_party_killed_before_unmasking_does_not_stop_the_round(observed: Observed) -> None:
    phase = observed.phases["unmask"]
    everyone = list(range(PARTIES))  # its masked vector is in the sum: SecAgg+ unmasks it
    expected = plain_mean(phase.sent, everyone)
    error = max(float(np.abs(phase.model[k] - expected[k]).max()) for k in expected)
    assert error <= bound_for(phase.sent, everyone)
    (record,) = phase.records
    assert len(record.on_time) == PARTIES
    unmask_replies = [r for r in phase.replies if r.has_error()]
    assert len(unmask_replies) == 1 and "unmask" in str(unmask_replies[0].error.reason)


@pytest.mark.integration
def test_each_round_asks_the_tier_tifl_chose_and_updates_its_accuracy(
    observed: Observed,
) -> None:
    phase = observed.phases["tiered"]
    strategy = observed.tiered
    assert strategy is not None and strategy.tiers is not None
    assert len(phase.records) == 4
    assert phase.records[0].tier is None  # round 1 profiles everyone
    assert len(phase.records[0].selected) == PARTIES
    # virtual-time-s = 1 + partition: 3 tiers asked, but under SecAgg+ each holds at
    # least 3 parties: two tiers, the fast one partitions 0-2.
    assert strategy.min_tier_size == 3
    assert [sorted(t) for t in strategy.tiers.members] == [
        [NODE_ID_BASE + p for p in range(3)],
        [NODE_ID_BASE + p for p in range(3, 6)],
    ]
    for record, (server_round, accuracy) in zip(
        phase.records[1:], observed.accuracies[1:], strict=True
    ):
        assert record.tier is not None
        assert set(record.selected) == set(strategy.tiers.members[record.tier])
        partitions = [n - NODE_ID_BASE for n in record.selected]
        assert accuracy == pytest.approx(np.mean([local_accuracy_of(p) for p in partitions]))
        assert server_round == record.server_round


def test_too_few_parties_for_secagg_are_refused_before_anything_is_sent() -> None:
    grid = InProcessGrid(secagg_app, 3)
    pushed: list[Message] = []
    original_push = grid.push_messages

    def push(messages: Any) -> Any:
        messages = list(messages)
        pushed.extend(messages)
        return original_push(messages)

    grid.push_messages = push  # type: ignore[method-assign]
    try:
        for per_round in (1, 2):  # two would each learn the other's update
            with pytest.raises(PrivacyError, match="at least 3 parties per round"):
                run_secagg(
                    grid, StreamingFedAvg(per_round=per_round), initial(), SETTINGS, num_rounds=1
                )
        counted = SecAggSettings.from_privacy(
            PrivacySpec(secagg=True, secagg_threshold=5), max_weight=16
        )
        with pytest.raises(PrivacyError, match=r"threshold \(5\) is more than the 3 parties"):
            run_secagg(grid, StreamingFedAvg(per_round=3), initial(), counted, num_rounds=1)
        with pytest.raises(PrivacyError, match="secagg is off"):
            SecAggSettings.from_privacy(PrivacySpec())
        with pytest.raises(PrivacyError, match="threshold"):
            SecAggSettings(reconstruction_threshold=1.5)
        with pytest.raises(ValueError, match="clipping range"):  # no bound once values clip
            quantization_error_bound(
                [16], 9.0, clipping_range=8.0, quantization_range=2**22, max_weight=16.0
            )
    finally:
        grid.close()
    assert pushed == []


@pytest.mark.integration
def test_a_round_of_three_that_loses_one_is_abandoned_and_the_run_goes_on(
    observed: Observed,
) -> None:
    phase = observed.phases["three"]
    # Both rounds ran (the run went on), neither unmasked anything nor moved the model.
    assert len(phase.records) == 2 and phase.fit_results == []
    for key, sent in phase.sent.items():
        np.testing.assert_array_equal(phase.model[key], sent)
    three = tuple(NODE_ID_BASE + p for p in range(3))
    for record in phase.records:
        assert sorted(record.selected) == sorted(record.failed) == list(three)
        assert record.on_time == () and not record.quorum_met
        assert "collect_masked_vectors" in record.failures[NODE_ID_BASE + 1]
        for survivor in (NODE_ID_BASE, NODE_ID_BASE + 2):
            why = record.failures[survivor]
            assert why.startswith(ABANDONED) and "2 of 3 parties were left" in why, why
    # Nobody was asked for the shares that would unmask the two survivors' sum.
    assert len(phase.replies) == 2 * (3 + 3 + 3)  # setup, share keys, masked vectors


def test_the_round_threshold_is_never_below_three() -> None:
    # Flower resolves a share of the round's parties with a floor of 2; ours is 3.
    assert SecAggSettings(reconstruction_threshold=0.5).round_threshold(3) == 3
    assert SecAggSettings(reconstruction_threshold=0.5).round_threshold(4) == 3
    assert SecAggSettings(reconstruction_threshold=0.5).round_threshold(10) == 5
    assert SecAggSettings(reconstruction_threshold=1.0).round_threshold(4) == 4
    assert SecAggSettings(reconstruction_threshold=0.1).round_threshold(20) == 3
    # Neighbours as a share: 5 of 10 (odd, as Flower makes it), half of that rounds to 2.
    assert SecAggSettings(reconstruction_threshold=0.5, num_shares=0.5).round_threshold(10) == 3
    assert SecAggSettings(reconstruction_threshold=4).round_threshold(6) == 4
    for threshold in (2, 2.0, 1.5):
        with pytest.raises(PrivacyError, match="a count >= 3"):
            SecAggSettings(reconstruction_threshold=threshold)
    with pytest.raises(PrivacyError, match=r"at least 3 parties per round.*got 2"):
        SecAggSettings().check_round(2)


def test_fewer_than_three_masked_vectors_are_never_unmasked() -> None:
    check_survivors(3)
    for survivors in (2, 1, 0):
        with pytest.raises(PrivacyError, match=f"only {survivors} parties' masked vectors"):
            check_survivors(survivors)

    class Untouchable:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the unmask stage used the grid ({name}) for two survivors")

    workflow = _DeadlineWorkflow(num_shares=1.0, reconstruction_threshold=2)
    state = type("State", (), {"active_node_ids": {7, 8}, "sampled_node_ids": {6, 7, 8}})()
    assert workflow.unmask_stage(Untouchable(), Untouchable(), state) is False  # type: ignore[arg-type]
    assert "only 2 parties' masked vectors arrived" in workflow.abandoned


def test_a_fleet_job_under_secagg_names_at_least_three_stations() -> None:
    manifest = """
[job]
name = "secagg"
rounds = 1
[task]
model = "inspect:1"
[strategy]
kind = "fedavg"
[privacy]
mode = "local"
epsilon = 8.0
secagg = true
[federation]
backend = "fleet"
fleet = "plant-a"
edges = EDGES
"""
    two = manifest.replace("EDGES", '["st-01", "st-02"]')
    with pytest.raises(ManifestError, match="at least 3 parties per round"):
        parse_fleet_manifest(two)
    three = manifest.replace("EDGES", '["st-01", "st-02", "st-03"]')
    assert len(parse_fleet_manifest(three).federation.edges) == 3
    # edges = "all" is counted against the fleet when the job is prepared; until then
    # SecAgg+'s 3 are assumed, or its threshold's count when that is more.
    assert parse_fleet_manifest(manifest.replace("EDGES", '"all"')).federation.edges == "all"
    counted = manifest.replace("EDGES", '"all"').replace("secagg = true", "secagg = true\n"
                                                          "secagg_threshold = 4")  # fmt: skip
    assert parse_fleet_manifest(counted).federation.edges == "all"


# -- the round's deadline at the masked-vector stage (issue 32, item 5)


class FixedExpectation(StreamingFedAvg):
    """Every party, with a deadline of ``expected_s`` (deadline_factor 1) from round 1."""

    def __init__(self, expected_s: float, clock: ClockMode) -> None:
        super().__init__(
            per_round=PARTIES, clock=clock, deadline=DeadlineConfig(deadline_factor=1.0)
        )
        self.expected_s = expected_s

    def expected_latency(self, server_round: int, tier: int | None) -> float | None:
        return self.expected_s


def _deadline_round(
    grid: Grid, strategy: StreamingFedAvg
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], RoundRecord]:
    arrays = initial()
    sent = as_dict(arrays)
    records: list[RoundRecord] = []
    strategy.observers.append(records.append)
    result = run_secagg(grid, strategy, arrays, SETTINGS, num_rounds=1, timeout=30)
    assert result.arrays is not None
    (record,) = records
    return sent, as_dict(result.arrays), record


def test_on_the_virtual_clock_a_party_past_the_deadline_is_late_and_left_out_of_the_sum() -> None:
    # virtual-time-s is 1 + partition: with a deadline of 4.5 s partitions 4 and 5 are late.
    grid = InProcessGrid(secagg_app, PARTIES)
    strategy = FixedExpectation(4.5, ClockMode.VIRTUAL)
    try:
        sent, model, record = _deadline_round(grid, strategy)
    finally:
        grid.close()
    on_time = [0, 1, 2, 3]
    expected = plain_mean(sent, on_time)
    error = max(float(np.abs(model[k] - expected[k]).max()) for k in expected)
    assert error <= bound_for(sent, on_time)
    everyone = plain_mean(sent, list(range(PARTIES)))  # the late vectors would show
    assert max(float(np.abs(model[k] - everyone[k]).max()) for k in everyone) > 1e-3
    assert record.deadline_s == 4.5
    assert record.late == (NODE_ID_BASE + 4, NODE_ID_BASE + 5)
    assert sorted(record.on_time) == [NODE_ID_BASE + p for p in on_time]
    assert record.failed == () and record.failures == {}
    assert record.round_time_s == 4.5  # the stage waited until the deadline
    # The late parties' virtual times are known: their latency profiles take them.
    assert strategy.profiles[NODE_ID_BASE + 5].last_s == 6.0
    assert strategy.profiles[NODE_ID_BASE + 5].timeouts == 0


def test_fewer_than_the_threshold_on_time_abandons_the_round_saying_so() -> None:
    # A deadline of 2.5 s leaves partitions 0 and 1: below the threshold of 3 (of 6 at 0.5).
    grid = InProcessGrid(secagg_app, PARTIES)
    try:
        sent, model, record = _deadline_round(grid, FixedExpectation(2.5, ClockMode.VIRTUAL))
    finally:
        grid.close()
    for key, values in sent.items():
        np.testing.assert_array_equal(model[key], values)  # nothing was unmasked
    assert record.late == tuple(NODE_ID_BASE + p for p in range(2, PARTIES))
    assert record.on_time == () and not record.quorum_met
    assert sorted(record.failed) == [NODE_ID_BASE, NODE_ID_BASE + 1]
    for survivor in record.failed:
        why = record.failures[survivor]
        assert why.startswith(ABANDONED), why
        assert "2 of 6 parties were left (4 past the round's deadline of 2.5 s)" in why, why
        assert "below the reconstruction threshold of 3" in why, why


def test_stale_late_replies_are_refused_under_secagg() -> None:
    grid = InProcessGrid(secagg_app, 3)
    strategy = StreamingFedAvg(per_round=3, deadline=DeadlineConfig(late_policy="stale"))
    try:
        with pytest.raises(PrivacyError, match="late_policy = 'stale'"):
            run_secagg(grid, strategy, initial(), SETTINGS, num_rounds=1)
    finally:
        grid.close()


SLOW_PARTITION = 5
SLOW_S = 3.0


def slow_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """The slow party takes SLOW_S seconds before its masked vector (a wall-clock straggler)."""
    if is_secagg_message(message) and context.node_config["partition-id"] == SLOW_PARTITION:
        stage = message.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE)
        if stage == Stage.COLLECT_MASKED_VECTORS:
            time.sleep(SLOW_S)
    return call_next(message, context)


slow_app = ClientApp(mods=[slow_mod, secagg_apps.drop_mod, secagg_mod])
slow_app.train()(secagg_apps.train)
slow_app.query()(secagg_apps.query)


@pytest.mark.integration
def test_on_the_wall_clock_a_party_still_working_at_the_deadline_is_late() -> None:
    grid = InProcessGrid(slow_app, PARTIES, workers=PARTIES)
    strategy = FixedExpectation(1.0, ClockMode.WALL)
    started = time.monotonic()
    try:
        sent, model, record = _deadline_round(grid, strategy)
        took = time.monotonic() - started
    finally:
        grid.close()
    assert took < SLOW_S  # the round did not wait for the straggler
    on_time = [p for p in range(PARTIES) if p != SLOW_PARTITION]
    expected = plain_mean(sent, on_time)
    error = max(float(np.abs(model[k] - expected[k]).max()) for k in expected)
    assert error <= bound_for(sent, on_time)
    assert record.late == (NODE_ID_BASE + SLOW_PARTITION,)
    assert record.failed == () and record.failures == {}
    assert record.round_time_s == 1.0
    # Still working, so no time is known: it is charged the deadline (TiFL's T_max).
    assert strategy.profiles[NODE_ID_BASE + SLOW_PARTITION].timeouts == 1
