"""Digits models: registry, ArrayRecord round trip, test-set evaluation (training is
fedge.party.trainer's: tests/party/test_trainer.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedge.models.digits import (
    ARCHITECTURES,
    ModelError,
    accuracy,
    count_parameters,
    evaluate,
    load_arrays,
    make_model,
    model_bytes,
    to_arrays,
)
from fedge.sim.data import make_partitions
from fedge.sim.scenario import load_scenario


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_architectures_have_the_documented_sizes() -> None:
    assert count_parameters(make_model("mlp")) == 64 * 64 + 64 + 64 * 10 + 10
    assert count_parameters(make_model("mlp-small")) == 64 * 16 + 16 + 16 * 10 + 10
    assert count_parameters(make_model("mlp-large")) == (
        64 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
    )
    assert model_bytes(make_model("mlp")) == 4 * count_parameters(make_model("mlp"))
    out = make_model("mlp-large")(torch.zeros(3, 64))
    assert out.shape == (3, 10)
    with pytest.raises(ModelError, match=r"unknown architecture 'cnn' \(known: mlp, "):
        make_model("cnn")


def test_the_registry_is_open_for_new_architectures() -> None:
    ARCHITECTURES["linear-test"] = lambda: nn.Linear(64, 10)
    try:
        assert count_parameters(make_model("linear-test")) == 650
    finally:
        del ARCHITECTURES["linear-test"]


def test_same_seed_same_weights_and_arrays_round_trip() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    a, b, c = make_model("mlp", 1), make_model("mlp", 1), make_model("mlp", 2)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), before)  # the caller's RNG is left alone
    assert torch.equal(flat(a), flat(b)) and not torch.equal(flat(a), flat(c))
    arrays = to_arrays(a)
    assert list(arrays.keys()) == list(a.state_dict().keys())
    load_arrays(c, arrays)
    assert torch.equal(flat(c), flat(a))
    with pytest.raises(ModelError, match="do not fit"):
        load_arrays(make_model("mlp-small"), arrays)


def test_evaluation_on_a_partition_and_on_nothing() -> None:
    model = make_model()
    X, y = make_partitions(load_scenario("tifl-digits"), 0).parties[3]
    loss, acc = evaluate(model, X, y, "cpu")
    assert acc == accuracy(model, X, y, "cpu") and 0 <= acc <= 1 and loss > 0
    empty_X = np.zeros((0, 64), dtype=np.float32)
    empty_y = np.zeros(0, dtype=np.int64)
    assert evaluate(model, empty_X, empty_y) == (0.0, 0.0)
