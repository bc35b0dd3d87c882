"""The one trainer every party runs (issue 32): local SGD or Adam, FedProx, the time cap,
threads, evaluation, and refusals -- on simulated digits partitions and literal arrays."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedge.models.digits import make_model
from fedge.party import trainer
from fedge.party.errors import PartyError, StationDataError
from fedge.sim.data import make_partitions
from fedge.sim.scenario import load_scenario

SGD = trainer.TrainSettings(lr=0.1, epochs=2, batch_size=4, seed=9, optimizer="sgd")


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def partition(scenario: str, party: int) -> trainer.Examples:
    return trainer.Examples(*make_partitions(load_scenario(scenario), 0).parties[party])


@pytest.mark.slow
def test_local_sgd_improves_accuracy_on_a_simulated_partition() -> None:
    examples = partition("tifl-digits", 45)  # a slow-group party: about 35 samples
    model = make_model("mlp", 0)
    before = trainer.accuracy(model, examples)
    settings = trainer.TrainSettings(lr=0.2, epochs=20, batch_size=10, optimizer="sgd")
    result = trainer.train(model, examples, settings, on=torch.device("cpu"))
    after = trainer.accuracy(model, examples)
    assert before < 0.4 < 0.9 < after
    assert 0 < result.loss < 2.5 and not result.stopped_early
    assert result.steps == 20 * -(-len(examples) // 10)
    eval_loss, eval_acc = trainer.evaluate(model, examples)
    assert eval_acc == after and eval_loss < result.loss
    assert not model.training and next(model.parameters()).device.type == "cpu"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_training_is_reproducible_for_a_seed(optimizer: trainer.Optimizer) -> None:
    examples = partition("tifl-digits", 3)
    settings = trainer.TrainSettings(lr=0.05, epochs=2, batch_size=4, seed=9, optimizer=optimizer)
    first, second = make_model("mlp", 0), make_model("mlp", 0)
    one = trainer.train(first, examples, settings)
    two = trainer.train(second, examples, settings)
    assert torch.equal(flat(first), flat(second)) and one.loss == two.loss
    third = make_model("mlp", 0)
    trainer.train(third, examples, dataclasses.replace(settings, seed=10))
    assert not torch.equal(flat(first), flat(third))


@pytest.mark.slow
def test_the_proximal_term_pulls_weights_towards_the_global_model() -> None:
    examples = partition("tifl-digits-noniid", 40)
    global_model = make_model("mlp", 0)
    anchor = flat(global_model)

    def drift(mu: float) -> float:
        local = make_model("mlp", 0)
        settings = trainer.TrainSettings(
            lr=0.1, epochs=10, batch_size=8, optimizer="sgd", proximal_mu=mu
        )
        trainer.train(local, examples, settings, anchor=list(global_model.parameters()))
        return float(torch.linalg.vector_norm(flat(local) - anchor))

    plain, prox, strong = drift(0.0), drift(1.0), drift(10.0)
    assert strong < prox < plain


def test_the_time_cap_stops_training_and_says_so() -> None:
    examples = partition("tifl-digits", 0)
    settings = trainer.TrainSettings(lr=0.1, epochs=50, batch_size=1, max_seconds=1e-9)
    result = trainer.train(make_model("mlp", 0), examples, settings)
    assert result.stopped_early and result.steps == 1


def test_threads_are_set_for_the_training_and_put_back() -> None:
    examples = trainer.Examples(
        np.random.default_rng(0).random((8, 64), dtype=np.float32), np.arange(8) % 10
    )
    before = torch.get_num_threads()
    seen: list[int] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            return self.linear(x)  # type: ignore[no-any-return]

    trainer.train(Probe(), examples, trainer.TrainSettings(epochs=1, batch_size=8, threads=1))
    assert seen == [1] and torch.get_num_threads() == before
    trainer.train(Probe(), examples, trainer.TrainSettings(epochs=1, batch_size=8, threads=None))
    assert seen == [1, before]


def test_bad_settings_and_nothing_to_train_on_are_refused() -> None:
    for bad, match in [
        ({"epochs": 0}, "epochs >= 1"),
        ({"batch_size": 0}, "batch_size >= 1"),
        ({"lr": 0.0}, "learning rate > 0"),
        ({"proximal_mu": -1.0}, "proximal_mu"),
        ({"optimizer": "lbfgs"}, "optimizer"),
        ({"max_seconds": 0.0}, "max_seconds"),
        ({"threads": 0}, "threads"),
    ]:
        with pytest.raises(PartyError, match=match):
            trainer.TrainSettings(**bad)  # type: ignore[arg-type]
    empty = trainer.Examples(np.zeros((0, 64), np.float32), np.zeros(0, np.int64))
    with pytest.raises(StationDataError, match="no labelled training examples"):
        trainer.train(make_model(), empty, SGD)
    loss, acc = trainer.evaluate(make_model(), empty)
    assert np.isnan(loss) and np.isnan(acc) and np.isnan(trainer.accuracy(make_model(), empty))
    with pytest.raises(PartyError, match="anchor has 1 tensors"):
        trainer.train(
            make_model(),
            partition("tifl-digits", 0),
            trainer.TrainSettings(optimizer="sgd", proximal_mu=0.5),
            anchor=[torch.zeros(3)],
        )


def test_dp_sgd_refuses_the_proximal_term_before_touching_a_ledger(tmp_path: Path) -> None:
    from fedge.privacy.settings import PrivacyMode, PrivacySpec

    settings = trainer.TrainSettings(optimizer="sgd", proximal_mu=0.5)
    spec = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=8.0)
    with pytest.raises(PartyError, match="proximal term"):
        trainer.train_private(
            make_model(),
            partition("tifl-digits", 0),
            settings,
            spec,
            ledger_path=tmp_path / "never.db",
            job="j",
            server_round=1,
        )
    assert not (tmp_path / "never.db").exists()
