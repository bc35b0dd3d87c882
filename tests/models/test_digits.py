"""Digits models: registry, ArrayRecord round trip, local training and the FedProx term."""

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
    train_local,
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


@pytest.mark.slow
def test_local_training_improves_accuracy_on_a_partition() -> None:
    scenario = load_scenario("tifl-digits")
    parts = make_partitions(scenario, 0)
    X, y = parts.parties[45]  # a slow-group party: about 35 training samples
    model = make_model("mlp", 0)
    before = accuracy(model, X, y, "cpu")
    loss = train_local(model, X, y, epochs=20, lr=0.2, batch_size=10, seed=0, device="cpu")
    after = accuracy(model, X, y, "cpu")
    assert before < 0.4 < 0.9 < after
    assert 0 < loss < 2.5
    eval_loss, eval_acc = evaluate(model, X, y, "cpu")
    assert eval_acc == after and eval_loss < loss


def test_training_is_reproducible_for_a_seed() -> None:
    parts = make_partitions(load_scenario("tifl-digits"), 0)
    X, y = parts.parties[3]
    first, second = make_model("mlp", 0), make_model("mlp", 0)
    train_local(first, X, y, epochs=2, lr=0.1, batch_size=4, seed=9, device="cpu")
    train_local(second, X, y, epochs=2, lr=0.1, batch_size=4, seed=9, device="cpu")
    assert torch.equal(flat(first), flat(second))


@pytest.mark.slow
def test_the_proximal_term_pulls_weights_towards_the_global_model() -> None:
    parts = make_partitions(load_scenario("tifl-digits-noniid"), 0)
    X, y = parts.parties[40]
    global_model = make_model("mlp", 0)
    anchor = flat(global_model)

    def drift(mu: float) -> float:
        local = make_model("mlp", 0)
        train_local(
            local,
            X,
            y,
            epochs=10,
            lr=0.1,
            batch_size=8,
            proximal_mu=mu,
            global_params=list(global_model.parameters()),
            seed=0,
            device="cpu",
        )
        return float(torch.linalg.vector_norm(flat(local) - anchor))

    plain, prox, strong = drift(0.0), drift(1.0), drift(10.0)
    assert strong < prox < plain


def test_bad_arguments_and_empty_data() -> None:
    model = make_model()
    empty_X = np.zeros((0, 64), dtype=np.float32)
    empty_y = np.zeros(0, dtype=np.int64)
    assert train_local(model, empty_X, empty_y, epochs=1, lr=0.1, batch_size=1) == 0.0
    assert evaluate(model, empty_X, empty_y) == (0.0, 0.0)
    with pytest.raises(ModelError, match="epochs >= 1"):
        train_local(model, empty_X, empty_y, epochs=0, lr=0.1, batch_size=1)
