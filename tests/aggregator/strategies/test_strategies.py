"""Our strategies with ClientApps that know nothing of fedge, on a real Flower Grid."""

import threading
import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge.aggregator.fleet.grids import NODE_ID_BASE
from fedge.aggregator.rounds import latency
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.deadline import DeadlineConfig
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.aggregator.strategies.tiered import TieredFedAvg
from fedge.sim.grid import InProcessGrid

# A plain Flower ClientApp: it adds its partition id to the weights and takes a time that
# grows with its partition id. No fedge imports, no virtual time, no extra metrics.
plain = ClientApp()


@plain.train()
def _train(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    # Pairs of equally fast parties, 200 ms apart: far more than a busy CI machine's jitter.
    time.sleep(0.01 + 0.2 * (partition // 2))
    arrays = msg.content.array_records["arrays"]
    updated = {k: Array(v.numpy() + partition) for k, v in arrays.items()}
    content = RecordDict(
        {
            "arrays": ArrayRecord(array_dict=updated),
            "metrics": MetricRecord({"num-examples": partition + 1}),
        }
    )
    return Message(content=content, reply_to=msg)


def _initial() -> ArrayRecord:
    return ArrayRecord(array_dict={"w": Array(np.zeros(4, dtype=np.float32))})


@pytest.mark.slow
def test_plain_flower_clientapp_takes_part_in_a_tiered_run() -> None:
    grid = InProcessGrid(plain, 6, workers=2)
    records: list[RoundRecord] = []
    strategy = TieredFedAvg(
        per_round=2, n_tiers=3, profiling_rounds=1, adaptive=False, seed=3, clock=ClockMode.WALL
    )
    strategy.observers.append(records.append)
    try:
        result = strategy.start(grid, _initial(), num_rounds=6, train_config=ConfigRecord())
    finally:
        grid.close()
    assert [r.server_round for r in records] == [1, 2, 3, 4, 5, 6]
    assert len(records[0].selected) == 6  # profiling asks everyone
    assert strategy.tiers is not None
    # Latency was measured on the wall: the two fastest parties form the first tier.
    assert set(strategy.tiers.members[0]) == {NODE_ID_BASE, NODE_ID_BASE + 1}
    assert set(strategy.tiers.members[2]) == {NODE_ID_BASE + 4, NODE_ID_BASE + 5}
    for record in records[1:]:
        assert record.tier is not None
        assert set(record.selected) == set(strategy.tiers.members[record.tier])
        assert record.on_time and not record.failed
    # The model moved: every reply added its partition id.
    assert float(result.arrays["w"].numpy()[0]) > 0


@pytest.mark.slow
def test_round_ends_at_the_deadline_and_the_straggler_is_recorded_late() -> None:
    # The straggler answers only when the test lets it (after the round), so a round that
    # waited for it could not end at all before the 30 s fallback.
    release, answered = threading.Event(), threading.Event()
    straggler = ClientApp()

    @straggler.train()
    def _slow(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        if partition == 2:
            release.wait(30.0)
            answered.set()
        else:
            time.sleep(0.01)
        arrays = msg.content.array_records["arrays"]
        return Message(
            content=RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})}),
            reply_to=msg,
        )

    grid = InProcessGrid(straggler, 3, workers=3)
    strategy = StreamingFedAvg(
        per_round=3,
        seed=0,
        clock=ClockMode.WALL,
        deadline=DeadlineConfig(deadline_factor=3.0, quorum_fraction=1.0),
    )
    records: list[RoundRecord] = []
    strategy.observers.append(records.append)
    # Seed the latency profile so the first round already has a deadline (3 x 1 s): room
    # for the on-time parties on a loaded machine.
    for node in grid.get_node_ids():
        strategy.profiles[node] = latency.observe(None, 1.0)
    try:
        started = time.monotonic()
        strategy.start(grid, _initial(), num_rounds=1, train_config=ConfigRecord())
        elapsed = time.monotonic() - started
        straggler_had_answered = answered.is_set()
    finally:
        release.set()
        grid.close()
    (record,) = records
    assert record.late == (NODE_ID_BASE + 2,)
    assert set(record.on_time) == {NODE_ID_BASE, NODE_ID_BASE + 1}
    assert not record.quorum_met
    assert not straggler_had_answered, "the round waited for the straggler's reply"
    assert elapsed < 20.0, "the round waited for the straggler past its deadline"


def test_failed_party_is_data_not_a_hang() -> None:
    failing = ClientApp()

    @failing.train()
    def _fail(msg: Message, context: Context) -> Message:
        if int(context.node_config["partition-id"]) == 0:
            raise RuntimeError("camera unplugged")
        arrays = msg.content.array_records["arrays"]
        return Message(
            content=RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 2})}),
            reply_to=msg,
        )

    grid = InProcessGrid(failing, 3)
    strategy = StreamingFedAvg(per_round=3, seed=0, clock=ClockMode.WALL)
    records: list[RoundRecord] = []
    strategy.observers.append(records.append)
    try:
        strategy.start(grid, _initial(), num_rounds=2, train_config=ConfigRecord())
    finally:
        grid.close()
    for record in records:
        assert record.failed == (NODE_ID_BASE,)
        assert "camera unplugged" in record.failures[NODE_ID_BASE]
        assert len(record.on_time) == 2


def test_bad_deadline_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="quorum_fraction"):
        DeadlineConfig(quorum_fraction=0.0)
    with pytest.raises(ValueError, match="late_policy"):
        DeadlineConfig(late_policy="wait")


def test_malformed_replies_are_failed_parties_and_change_nothing() -> None:
    """A weight no party has, or arrays that are not the model sent: refused, recorded."""
    liar = ClientApp()

    @liar.train()
    def _reply(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        arrays = msg.content.array_records["arrays"]
        weight: float = 2
        if partition == 0:
            weight = float("inf")  # would outweigh everyone
        elif partition == 1:
            weight = -5
        elif partition == 2:
            arrays = ArrayRecord({"w": Array(np.ones((7, 7), np.float32))})  # not our model
        content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": weight})})
        return Message(content=content, reply_to=msg)

    grid = InProcessGrid(liar, 4)
    strategy = StreamingFedAvg(per_round=4, seed=0, clock=ClockMode.WALL)
    records: list[RoundRecord] = []
    strategy.observers.append(records.append)
    initial = _initial()
    try:
        result = strategy.start(grid, initial, num_rounds=1, train_config=ConfigRecord())
    finally:
        grid.close()
    (record,) = records
    assert set(record.failed) == {NODE_ID_BASE, NODE_ID_BASE + 1, NODE_ID_BASE + 2}

    assert all("malformed reply" in record.failures[n] for n in record.failed)
    assert record.on_time == (NODE_ID_BASE + 3,)
    for key in initial:  # only the honest party's echo was folded: the model is unchanged
        np.testing.assert_allclose(result.arrays[key].numpy(), initial[key].numpy())
