"""The party side of SecAgg+: ``secagg_mod`` lets our Message-API ClientApps take part.

Translation is checked on literal messages; the simulator's real party app (digits MLP,
three parties) then runs one plain round and one SecAgg+ round through the same
``ClientApp`` object on the in-process grid, and the two models agree within SecAgg+'s
quantization error.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common import parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.task_identity import TaskIdentity

from fedge.aggregator.privacy import secagg_round
from fedge.aggregator.privacy.secagg import SecAggSettings, quantization_error_bound, run_secagg
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.models import digits
from fedge.party.secagg import (
    ARRAY_NAMES_KEY,
    FITINS_CONFIG,
    FITINS_PARAMETERS,
    SECAGG_CONFIGS_KEY,
    SecAggPartyError,
    array_names,
    check_threshold,
    secagg_mod,
    to_legacy_fitres,
    to_message_api,
)
from fedge.privacy.settings import PrivacyError
from fedge.sim.data import make_partitions
from fedge.sim.grid import InProcessGrid
from fedge.sim.party_app import app as sim_party_app
from fedge.sim.scenario import load_scenario

NAMES = ["layer.weight", "layer.bias"]


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """What Flower's runtimes set in a process before Messages are built."""
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)


def model() -> dict[str, np.ndarray]:
    return {
        "layer.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "layer.bias": np.array([0.5, -0.5], dtype=np.float32),
    }


def legacy_fitins(names: list[str] | None = NAMES) -> Message:
    parameters = ArrayRecord()
    for index, values in enumerate(model().values()):
        array = Array(values)
        parameters[str(index)] = Array(data=array.data, dtype="", stype=array.stype, shape=())
    config = ConfigRecord({"server-round": 3, "lr": 0.1})
    if names is not None:
        config[ARRAY_NAMES_KEY] = json.dumps(names)
    content = RecordDict({FITINS_PARAMETERS: parameters, FITINS_CONFIG: config})
    return Message(content=content, dst_node_id=1001, message_type=MessageType.TRAIN)


def test_a_legacy_fitins_reaches_the_app_as_named_arrays_and_our_config() -> None:
    legacy = legacy_fitins()
    request = to_message_api(legacy, array_names(legacy))
    arrays = request.content.array_records["arrays"]
    assert list(arrays) == NAMES
    for name, values in model().items():
        np.testing.assert_array_equal(arrays[name].numpy(), values)
        assert arrays[name].numpy().dtype == np.float32
    assert dict(request.content.config_records["config"]) == {"server-round": 3, "lr": 0.1}
    assert request.metadata.message_type == MessageType.TRAIN


def test_the_apps_reply_becomes_the_legacy_fitres_secaggplus_reads() -> None:
    legacy = legacy_fitins()
    request = to_message_api(legacy, NAMES)
    trained = {k: v + 1 for k, v in reversed(model().items())}  # any order of arrays
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in trained.items()}),
            "metrics": MetricRecord({"num-examples": 42, "local-acc": 0.75}),
        }
    )
    fitres = compat.recorddict_to_fitres(
        to_legacy_fitres(Message(content, reply_to=request), NAMES, legacy).content, True
    )
    assert fitres.num_examples == 42
    assert fitres.metrics == {"num-examples": 42, "local-acc": 0.75}
    values = parameters_to_ndarrays(fitres.parameters)
    for got, name in zip(values, NAMES, strict=True):  # in the order the server sent
        np.testing.assert_array_equal(got, trained[name])


def test_replies_it_cannot_translate_are_refused_with_the_reason() -> None:
    legacy = legacy_fitins()
    request = to_message_api(legacy, NAMES)
    arrays = ArrayRecord({k: Array(v) for k, v in model().items()})
    no_weight = RecordDict({"arrays": arrays, "metrics": MetricRecord({"local-acc": 1.0})})
    with pytest.raises(SecAggPartyError, match="num-examples"):
        to_legacy_fitres(Message(no_weight, reply_to=request), NAMES, legacy)
    other_model = RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(np.zeros(2, np.float32))}),
            "metrics": MetricRecord({"num-examples": 1}),
        }
    )
    with pytest.raises(SecAggPartyError, match="not the model sent"):
        to_legacy_fitres(Message(other_model, reply_to=request), NAMES, legacy)
    with pytest.raises(SecAggPartyError, match="names 1 arrays"):
        array_names(legacy_fitins(["only-one"]))
    assert array_names(legacy_fitins(None)) == ["0", "1"]


def test_server_and_party_agree_on_the_array_names_key() -> None:
    assert secagg_round.ARRAY_NAMES_KEY == ARRAY_NAMES_KEY


def test_plain_rounds_pass_through_untouched() -> None:
    message = Message(
        RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord()}),
        dst_node_id=1001,
        message_type=MessageType.TRAIN,
    )
    context = Context(run_id=1, node_id=1001, node_config={}, state=RecordDict(), run_config={})
    seen: list[Message] = []

    def app(msg: Message, ctxt: Context) -> Message:
        seen.append(msg)
        return Message(RecordDict(), reply_to=msg)

    secagg_mod(message, context, app)
    assert seen == [message]
    assert not context.state.config_records  # no SecAgg+ state was started


TINY = """
name = "tiny-secagg"
description = "3 digit parties for one plain and one SecAgg+ round"

[data]
dataset = "digits"
alpha = 5.0
test_fraction = 0.2
proxy_fraction = 0.1

[fleet]
parties = 3
per_round = 3

[[fleet.groups]]
count = 3
cpus = 1.0
data_share = 1.0

[device]
seconds_per_example = 0.001

[training]
rounds = 1
lr = 0.05
local_epochs = 1
batch_size = 32
target_accuracy = 0.5
arch = "mlp"
"""


def test_the_simulators_party_app_serves_plain_and_secagg_rounds(tmp_path: Path) -> None:
    path = tmp_path / "tiny-secagg.toml"
    path.write_text(TINY, encoding="utf-8")
    scenario = load_scenario(str(path))
    initial = digits.to_arrays(digits.make_model("mlp", seed=0))
    run_config: dict[str, str | int] = {"scenario": str(path), "seed": 0}
    settings = SecAggSettings(max_weight=2000.0, key_stage_timeout_s=30)
    grid = InProcessGrid(sim_party_app, scenario.fleet.parties, run_config=run_config)
    try:
        plain = StreamingFedAvg(per_round=3).start(grid, initial, num_rounds=1).arrays
        secure = run_secagg(grid, StreamingFedAvg(per_round=3), initial, settings, num_rounds=1)
    finally:
        grid.close()
    assert plain is not None and secure.arrays is not None
    examples = [len(y) for _, y in make_partitions(scenario, 0).parties]
    biggest = max(float(np.abs(a.numpy()).max()) for a in plain.values())
    bound = quantization_error_bound(
        examples,
        2 * biggest,  # the parties' own updates stay near the mean's scale
        clipping_range=settings.clipping_range,
        quantization_range=settings.quantization_range,
        max_weight=settings.max_weight,
    )
    for name, array in plain.items():
        error = np.abs(secure.arrays[name].numpy() - array.numpy()).max()
        assert error <= bound, name
    moved = max(float(np.abs(secure.arrays[k].numpy() - initial[k].numpy()).max()) for k in initial)
    assert moved > 10 * bound  # the round trained: the agreement is not trivial


def test_a_station_refuses_a_secagg_round_with_a_threshold_below_three() -> None:
    def setup(threshold: int) -> Message:
        configs = ConfigRecord({Key.STAGE: Stage.SETUP, Key.THRESHOLD: threshold})
        return Message(
            RecordDict({SECAGG_CONFIGS_KEY: configs}),
            dst_node_id=1001,
            message_type=MessageType.TRAIN,
        )

    context = Context(run_id=1, node_id=1001, node_config={}, state=RecordDict(), run_config={})

    def app(msg: Message, ctxt: Context) -> Message:
        raise AssertionError("nothing may reach the app")

    for threshold in (2, 1):
        with pytest.raises(PrivacyError, match=f"threshold is {threshold}, below the 3"):
            secagg_mod(setup(threshold), context, app)
    assert not context.state.config_records  # no SecAgg+ state was started
    check_threshold(setup(3))
