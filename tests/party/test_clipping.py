"""Book-keeping's clipped sum: the naive per-example loop's, Opacus', bounded by C; the noise."""

from collections.abc import Callable

import numpy as np
import pytest
import torch
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from fedge.models.inspection import InspectionNet
from fedge.party import clipping, dp_sgd
from fedge.privacy.settings import PrivacyError


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return InspectionNet(n_classes=3, width=4)  # the stations' CNN, narrow: 3 conv + linear


class _Sequence(nn.Module):
    """A linear layer over a sequence per example (per-example gradients instantiated)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mix = nn.Linear(6, 8)
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.mix(x)).mean(dim=1))
        return out


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "mlp": (_mlp, (12,), 5),
    "cnn": (_cnn, (1, 16, 16), 3),
    "sequence": (_Sequence, (7, 6), 4),
}


def _batch(shape: tuple[int, ...], classes: int, n: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.rand((n, *shape), generator=generator) * 3
    return x, torch.randint(0, classes, (n,), generator=generator)


def _naive(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[list[torch.Tensor]]:
    """Each example's gradient, one backward pass per example."""
    grads = []
    for i in range(len(y)):
        model.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        loss.backward()  # type: ignore[no-untyped-call]
        grads.append([p.grad.detach().clone() for p in model.parameters()])  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return grads


def _norm(grads: list[torch.Tensor]) -> float:
    return float(torch.sqrt(torch.stack([(g.double() ** 2).sum() for g in grads]).sum()))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("clip", [1e9, 0.5])
def test_the_clipped_sum_is_the_naive_loops(case: str, clip: float) -> None:
    build, shape, classes = CASES[case]
    model = build()
    x, y = _batch(shape, classes)
    naive = _naive(model, x, y)
    norms = [_norm(g) for g in naive]
    factors = [min(1.0, clip / (n + clipping.CLIP_EPSILON)) for n in norms]
    expected = [
        torch.stack([f * g[k] for g, f in zip(naive, factors, strict=True)]).sum(0)
        for k in range(len(naive[0]))
    ]
    clipper = clipping.BookKeeping(model)
    loss, got_norms = clipper.clipped_sum(x, y, clip)
    clipper.close()
    assert np.allclose(got_norms.numpy(), norms, rtol=1e-4, atol=1e-6)  # per-example norms
    assert clip == 1e9 or max(norms) > clip  # the finite bound does clip something
    for got, want in zip(model.parameters(), expected, strict=True):
        assert got.grad is not None
        torch.testing.assert_close(got.grad, want, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        mean_loss = float(nn.functional.cross_entropy(model(x), y))
    assert loss == pytest.approx(mean_loss, rel=1e-5)
    assert all(not m._forward_hooks for m in model.modules())  # close() took the hooks off


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_examples_clipped_gradient_is_within_the_bound(case: str) -> None:
    build, shape, classes = CASES[case]
    model = build()
    x, y = _batch(shape, classes)
    clip = 0.05
    clipper = clipping.BookKeeping(model)
    for i in range(len(y)):  # a batch of one: the clipped sum is that example's clipped gradient
        _, norms = clipper.clipped_sum(x[i : i + 1], y[i : i + 1], clip)
        assert float(norms[0]) > clip
        clipped = [p.grad for p in model.parameters() if p.grad is not None]
        assert _norm(clipped) <= clip * (1 + 1e-5)
    clipper.close()


def test_the_clipped_sum_is_opacus_dp_optimizers() -> None:
    """Opacus' GradSampleModule + DPOptimizer with no noise: the same clipped mean."""
    model = _cnn()
    x, y = _batch((1, 16, 16), 3)
    clipper = clipping.BookKeeping(model)
    clipper.clipped_sum(x, y, 0.3)
    clipper.close()
    ours = [p.grad.detach().clone() / len(y) for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    private = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=0.3,
        expected_batch_size=len(y),
        loss_reduction="mean",
    )
    nn.functional.cross_entropy(private(x), y).backward()  # type: ignore[no-untyped-call]
    optimizer.pre_step()  # clip, sum, (no) noise, scale: what step() applies
    theirs = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
    private.to_standard_module()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_noise_has_the_configured_std_and_is_scaled_by_the_expected_batch() -> None:
    weight = nn.Parameter(torch.zeros(400, 500))
    bias = nn.Parameter(torch.zeros(3))
    bias.grad = torch.ones(3) * 8
    std, batch = 2.5, 4
    clipping.add_noise([weight, bias], std, batch, torch.Generator().manual_seed(0))
    assert weight.grad is not None and bias.grad is not None
    noise = weight.grad.double() * batch  # undo the mean's scaling
    assert abs(float(noise.mean())) < 0.02
    assert float(noise.std()) == pytest.approx(std, rel=0.01)
    assert bias.grad.shape == (3,) and abs(float(bias.grad.mean()) - 2.0) < 2.0  # (8 + n) / 4
    again = nn.Parameter(torch.zeros(400, 500))
    clipping.add_noise([again], std, batch, torch.Generator().manual_seed(0))
    assert torch.equal(again.grad, weight.grad)  # type: ignore[arg-type]  # seeded


def test_layers_without_a_rule_are_named_and_left_to_opacus() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.GroupNorm(2, 6), nn.Linear(6, 2))
    assert clipping.unsupported(model) == ["1 (GroupNorm): no book-keeping rule for this layer"]
    grouped = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2))
    assert "grouped convolution" in clipping.unsupported(grouped)[0]
    with pytest.raises(PrivacyError, match="GroupNorm"):
        clipping.BookKeeping(model)
    # DP-SGD still trains it, through Opacus' hooks, and hands it back clean.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    done = dp_sgd.train_private(
        model, x, y, epochs=1, lr=0.1, batch_size=10, noise_multiplier=1.0,
        clipping_norm=1.0, seed=0,
    )  # fmt: skip
    assert done.steps == 4
    assert all(not hasattr(p, "grad_sample") and p.grad is None for p in model.parameters())


def test_a_layer_run_twice_in_one_pass_is_refused() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.layer(torch.relu(self.layer(x)))
            return out

    clipper = clipping.BookKeeping(Twice())
    with pytest.raises(PrivacyError, match="ran twice"):
        clipper.clipped_sum(torch.ones(2, 3), torch.zeros(2, dtype=torch.int64), 1.0)
    clipper.close()
