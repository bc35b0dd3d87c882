"""The party's ClientApp, called directly with a Message and a Context (no Flower processes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    ConfigRecordValues,
    Context,
    Message,
    MessageType,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity

from fedge.models.digits import accuracy, load_arrays, make_model, model_bytes, to_arrays
from fedge.party import trainer
from fedge.sim import party_app
from fedge.sim.data import make_partitions
from fedge.sim.party_app import EVALUATE_METRICS, TRAIN_METRICS, app
from fedge.sim.party_inputs import PartyConfigError
from fedge.sim.profiles import (
    PartyDroppedOutError,
    PartyUnavailableError,
    drops_out,
    is_available,
    profiles_for,
    round_rng,
    virtual_round_time,
)
from fedge.sim.scenario import load_scenario, scenario_path

SEED = 0


@pytest.fixture(autouse=True)
def _server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """What Flower's ServerApp runtime sets for its process: new Messages read it."""
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)


def context(partition_id: int, scenario: str = "tifl-digits", num_partitions: int = 50) -> Context:
    return Context(
        run_id=1,
        node_id=partition_id + 100,
        node_config={"partition-id": partition_id, "num-partitions": num_partitions},
        state=RecordDict(),
        run_config={"scenario": scenario, "seed": SEED},
    )


def message(
    arrays: ArrayRecord,
    config: dict[str, ConfigRecordValues] | None = None,
    message_type: str = MessageType.TRAIN,
) -> Message:
    round_config = ConfigRecord({"server-round": 1, **(config or {})})
    content = RecordDict({"arrays": arrays, "config": round_config})
    return Message(content=content, dst_node_id=1, message_type=message_type)


def metrics_of(reply: Message) -> dict[str, float]:
    assert not reply.has_error()
    record = reply.content.metric_records["metrics"]
    values: dict[str, float] = {}
    for key, value in record.items():
        assert isinstance(value, int | float), (key, value)
        values[key] = value
    return values


def flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([array.numpy().ravel() for array in arrays.values()])


def scenario_file(tmp_path: Path, **device: float) -> str:
    text = scenario_path("tifl-digits").read_text()
    for key, value in device.items():
        text = text.replace(f"\n{key} = ", f"\n{key} = {value}\n# was: ", 1)
    path = tmp_path / "flaky.toml"
    path.write_text(text)
    return str(path)


def test_train_replies_with_new_arrays_and_every_metric() -> None:
    global_model = make_model("mlp", 42)
    sent = to_arrays(global_model)
    reply = app(message(sent, {"lr": 0.1}), context(partition_id=7))

    assert set(reply.content.keys()) == {"arrays", "metrics"}
    metrics = metrics_of(reply)
    assert set(metrics) == set(TRAIN_METRICS)
    received = reply.content.array_records["arrays"]
    assert list(received.keys()) == list(sent.keys())
    assert not np.allclose(flat(received), flat(sent))

    scenario = load_scenario("tifl-digits")
    parts = make_partitions(scenario, SEED)
    _, y = parts.parties[7]
    assert metrics["num-examples"] == len(y) and isinstance(metrics["num-examples"], int)
    assert metrics["partition-id"] == 7
    X_val, y_val = parts.validation[7]
    # Before training (the trainer counts right answers, digits.accuracy a float32 mean).
    assert metrics["local-acc"] == pytest.approx(accuracy(global_model, X_val, y_val))
    assert metrics["train-loss"] > 0 and metrics["train-time-s"] > 0
    expected_virtual = virtual_round_time(
        profiles_for(scenario, SEED)[7],
        len(y),
        scenario.training.local_epochs,
        model_bytes(global_model),
        scenario.device.seconds_per_example,
        round_rng(SEED, 7, 1),
    )
    assert metrics["virtual-time-s"] == pytest.approx(expected_virtual)


def test_round_config_overrides_the_scenario_defaults() -> None:
    sent = to_arrays(make_model("mlp", 0))
    one = metrics_of(app(message(sent, {"local-epochs": 1}), context(45)))
    three = metrics_of(app(message(sent, {"local-epochs": 3}), context(45)))
    # Same round, same jitter draw: compute triples, the transfer stays.
    transfer = 2 * model_bytes(make_model("mlp")) * 8 / 10e6
    compute_one = one["virtual-time-s"] - transfer
    assert three["virtual-time-s"] - transfer == pytest.approx(3 * compute_one)
    # A slow party (0.1 CPU, ~35 examples) takes far longer than a fast one (4 CPUs).
    fast = metrics_of(app(message(sent), context(0)))
    assert one["virtual-time-s"] > 40 * fast["virtual-time-s"]

    small = to_arrays(make_model("mlp-small", 0))
    reply = app(message(small, {"arch": "mlp-small", "proximal-mu": 0.5}), context(3))
    assert set(reply.content.array_records["arrays"].keys()) == set(small.keys())


def test_evaluate_measures_the_received_model_on_local_validation() -> None:
    model = make_model("mlp", 1)
    reply = app(message(to_arrays(model), message_type=MessageType.EVALUATE), context(12))
    metrics = metrics_of(reply)
    assert set(metrics) == set(EVALUATE_METRICS)
    X_val, y_val = make_partitions(load_scenario("tifl-digits"), SEED).validation[12]
    assert metrics["num-examples"] == len(y_val)
    assert metrics["eval-acc"] == pytest.approx(accuracy(model, X_val, y_val))


def test_a_simulated_party_trains_through_the_stations_trainer() -> None:
    # One trainer (issue 32): the party's round is fedge.party.trainer.train on its
    # generated partition, as local SGD; the same call gives the same weights and loss.
    sent = to_arrays(make_model("mlp", 5))
    reply = app(message(sent, {"lr": 0.1, "proximal-mu": 0.2}), context(7))
    scenario = load_scenario("tifl-digits")
    model = make_model("mlp", 5)
    load_arrays(model, sent)
    settings = trainer.TrainSettings(
        lr=0.1,
        epochs=scenario.training.local_epochs,
        batch_size=scenario.training.batch_size,
        max_seconds=None,
        threads=None,
        seed=party_app._train_seed(SEED, 7, 1),
        optimizer="sgd",
        proximal_mu=0.2,
    )
    examples = trainer.Examples(*make_partitions(scenario, SEED).parties[7])
    result = trainer.train(model, examples, settings)
    np.testing.assert_array_equal(
        flat(reply.content.array_records["arrays"]), flat(to_arrays(model))
    )
    assert metrics_of(reply)["train-loss"] == result.loss


def first_round(predicate: object, count: int = 200) -> int:
    assert callable(predicate)
    return next(r for r in range(1, count) if predicate(r))


def test_an_unavailable_party_raises_for_flower_to_turn_into_an_error_reply(
    tmp_path: Path,
) -> None:
    path = scenario_file(tmp_path, availability=0.5)
    profile = profiles_for(load_scenario(path), SEED)[4]
    down = first_round(lambda r: not is_available(profile, SEED, 4, r))
    up = first_round(lambda r: is_available(profile, SEED, 4, r))
    sent = to_arrays(make_model())

    # ClientApp.__call__ lets the exception out; Flower's runtime (supernode or simulation
    # backend) converts it into Message(Error(CLIENT_APP_RAISED_EXCEPTION, reason)).
    with pytest.raises(PartyUnavailableError, match=f"partition 4 is unavailable in round {down}"):
        app(message(sent, {"server-round": down}), context(4, path))
    reply = app(message(sent, {"server-round": up}), context(4, path))
    assert metrics_of(reply)["partition-id"] == 4


def test_a_dropout_raises_and_says_how_long_the_round_would_have_taken(tmp_path: Path) -> None:
    path = scenario_file(tmp_path, dropout=0.5)
    profile = profiles_for(load_scenario(path), SEED)[20]
    failing = first_round(lambda r: drops_out(profile, SEED, 20, r))
    with pytest.raises(PartyDroppedOutError, match=r"dropped out .* virtual-time-s=\d"):
        app(message(to_arrays(make_model()), {"server-round": failing}), context(20, path))


def test_misconfigured_parties_fail_with_a_clear_message() -> None:
    sent = to_arrays(make_model())
    with pytest.raises(PartyConfigError, match=r"num-partitions'\] is 10 .* fleet.parties = 50"):
        app(message(sent), context(1, num_partitions=10))
    with pytest.raises(PartyConfigError, match=r"config\['lr'\] must be > 0"):
        app(message(sent, {"lr": 0.0}), context(1))
    bare = Context(
        run_id=1, node_id=1, node_config={"partition-id": 1}, state=RecordDict(), run_config={}
    )
    with pytest.raises(PartyConfigError, match=r"run_config\['scenario'\]"):
        app(message(sent), bare)
