"""DP-SGD through Opacus: it learns, the noise and clipping act, the caller's model stays clean."""

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest
import torch
from torch import nn

from fedge.party.dp_sgd import train_private, unsupported_layers
from fedge.privacy.accounting import plan_round
from fedge.privacy.settings import DpRelease, PrivacyError, PrivacyMode, PrivacySpec

FEATURES = 20


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _toy(n: int = 400, seed: int = 0) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Linearly separable in 20 dimensions: a random direction scores about 50%."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    w = np.random.default_rng(99).normal(size=FEATURES)
    return x, (x @ w > 0).astype(np.int64)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 2))


def _accuracy(model: nn.Module, x: npt.NDArray[np.float32], y: npt.NDArray[np.int64]) -> float:
    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(dim=1).numpy()
    return float(np.mean(predicted == y))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_dp_sgd_learns_and_huge_noise_does_not() -> None:
    x, y = _toy()
    x_test, y_test = _toy(seed=1)
    settings = {"epochs": 6, "lr": 0.5, "batch_size": 40, "clipping_norm": 1.0, "seed": 3}
    model = _mlp()
    parameters = list(model.parameters())
    training = train_private(model, x, y, noise_multiplier=0.8, **settings)  # type: ignore[arg-type]
    # The caller's own parameter objects were trained (Opacus' wrapper shares them).
    assert [id(p) for p in model.parameters()] == [id(p) for p in parameters]
    assert _accuracy(model, x_test, y_test) > 0.85
    assert training.release == DpRelease(0.8, 0.1, 60)
    assert training.steps == 60
    assert 0 < training.loss < 0.7
    assert training.seconds > 0
    noisy = _mlp()
    train_private(noisy, x, y, noise_multiplier=1000.0, **settings)  # type: ignore[arg-type]
    assert _accuracy(noisy, x_test, y_test) < _accuracy(model, x_test, y_test) - 0.2


def test_clipping_bounds_how_far_parameters_move() -> None:
    x, y = _toy()
    start = _flat(_mlp())
    moved = {}
    for clipping_norm in (1e-3, 1e3):
        model = _mlp()
        train_private(
            model, x, y, epochs=2, lr=0.2, batch_size=40, noise_multiplier=1e-6,
            clipping_norm=clipping_norm, seed=0,
        )  # fmt: skip
        moved[clipping_norm] = float((_flat(model) - start).norm())
    assert moved[1e-3] < moved[1e3] / 10
    # Each step moves at most lr * clipping norm (a mean of clipped gradients), 20 steps.
    assert moved[1e-3] <= 0.2 * 1e-3 * 20 * 1.01


def test_a_seed_reproduces_a_round_and_another_seed_does_not() -> None:
    x, y = _toy(n=200)
    results = []
    for seed in (5, 5, 6):
        model = _mlp()
        training = train_private(
            model, x, y, epochs=1, lr=0.1, batch_size=20, noise_multiplier=1.0,
            clipping_norm=1.0, seed=seed, optimizer="adam",
        )  # fmt: skip
        results.append((_flat(model), training.loss))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]
    assert not torch.equal(results[0][0], results[2][0])


def test_the_model_comes_back_without_opacus_and_trains_again() -> None:
    x, y = _toy(n=200)
    model = _mlp()
    threads = torch.get_num_threads()
    first = train_private(
        model, x, y, epochs=1, lr=0.1, batch_size=25, noise_multiplier=1.0,
        clipping_norm=1.0, seed=0, threads=1,
    )  # fmt: skip
    assert torch.get_num_threads() == threads  # set for the training, then put back
    assert not model.training  # handed back for evaluation, on the CPU
    assert all(p.device.type == "cpu" for p in model.parameters())
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not module._backward_hooks and not module._backward_pre_hooks
        assert "activations" not in vars(module)
        assert not hasattr(module, "autograd_grad_sample_hooks")
    for parameter in model.parameters():
        assert parameter.grad is None
        assert not hasattr(parameter, "grad_sample")
        assert not hasattr(parameter, "summed_grad")
    # A plain forward/backward: ordinary gradients, no per-sample ones.
    model.train()
    loss = nn.CrossEntropyLoss()(model(torch.from_numpy(x[:8])), torch.from_numpy(y[:8]))
    loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    # And a second private round on the same object, accounted on its own.
    before = _flat(model)
    second = train_private(
        model, x, y, epochs=1, lr=0.1, batch_size=25, noise_multiplier=1.0,
        clipping_norm=1.0, seed=1,
    )  # fmt: skip
    assert second.release == first.release == DpRelease(1.0, 1 / 8, 8)
    assert not torch.equal(before, _flat(model))


@pytest.mark.slow
def test_the_release_is_what_the_party_planned() -> None:
    x, y = _toy(n=230)
    spec = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=8.0, rounds_per_party=4)
    planned = plan_round(spec, examples=len(x), batch_size=32, epochs=2, planned_rounds=4)
    training = train_private(
        _mlp(), x, y, epochs=2, lr=0.1, batch_size=32,
        noise_multiplier=planned.noise_multiplier, clipping_norm=1.0, seed=0,
    )  # fmt: skip
    assert training.release == planned


def test_a_time_cap_stops_early_and_accounts_only_the_steps_taken() -> None:
    x, y = _toy(n=200)
    training = train_private(
        _mlp(), x, y, epochs=50, lr=0.1, batch_size=20, noise_multiplier=1.0,
        clipping_norm=1.0, seed=0, max_seconds=1e-9,
    )  # fmt: skip
    assert training.steps == 1
    assert training.release == DpRelease(1.0, 0.1, 1)


def test_batchnorm_is_refused_by_name_not_silently_replaced() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).eval()
    x, y = _toy(n=50)
    before = _flat(model)
    with pytest.raises(PrivacyError, match=r"1 \(BatchNorm1d\)") as refused:
        train_private(
            model, x, y, epochs=1, lr=0.1, batch_size=10, noise_multiplier=1.0,
            clipping_norm=1.0, seed=0,
        )  # fmt: skip
    assert "federation needs one architecture" in str(refused.value)
    assert isinstance(model[1], nn.BatchNorm1d)
    assert not model.training
    assert torch.equal(before, _flat(model))
    assert unsupported_layers(_mlp()) == []


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"x": np.empty((0, FEATURES), np.float32), "y": np.empty(0, np.int64)}, "no training"),
        ({"y": np.zeros(10, np.int64)}, "must pair up"),
        ({"epochs": 0}, "epochs >= 1"),
        ({"batch_size": 0}, "batch_size >= 1"),
        ({"lr": 0.0}, "learning rate must be > 0"),
        ({"noise_multiplier": 0.0}, "noise multiplier must be > 0"),
        ({"clipping_norm": -1.0}, "clipping norm must be > 0"),
        ({"clipping_norm": float("nan")}, "clipping norm must be > 0"),
        ({"optimizer": "rmsprop"}, "sgd or adam"),
        ({"max_seconds": 0.0}, "max_seconds must be > 0"),
        ({"threads": 0}, "threads must be >= 1"),
    ],
)
def test_bad_input_is_refused_before_training(change: dict[str, object], match: str) -> None:
    x, y = _toy(n=40)
    arguments: dict[str, object] = {
        "x": x, "y": y, "epochs": 1, "lr": 0.1, "batch_size": 10, "noise_multiplier": 1.0,
        "clipping_norm": 1.0, "seed": 0,
    }  # fmt: skip
    arguments.update(change)
    model = _mlp()
    before = _flat(model)
    with pytest.raises(PrivacyError, match=match):
        train_private(model, **arguments)  # type: ignore[arg-type]
    assert torch.equal(before, _flat(model))
