"""DP-SGD's clipped, noised gradient in one forward and one backward pass (book-keeping).

DP-SGD (Abadi et al., CCS 2016) steps along ``(sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)) / B``
where ``g_i`` is example ``i``'s gradient, ``clip_C(g) = g * min(1, C / ||g||)`` and ``B``
the expected batch size. Opacus builds every ``g_i`` with per-layer hooks and its
optimizer then clips, sums and noises them, parameter by parameter: on the fleet's small
models that Python-level work costs several plain steps (BENCHMARKS §15a: a station's MLP
round 5.4x a plain one).

Here the clipped sum comes from the activations and output gradients that one ordinary
backward pass gives, without a second backward (book-keeping, Bu, Mao and Wang, ICML
2023, "Differentially Private Optimization on Large Model at Small Cost"):

- a linear layer ``y = W a + b`` on one vector per example has ``g_i = o_i a_i^T`` (``o_i``
  the gradient at its output), so ``||g_i||^2 = ||o_i||^2 ||a_i||^2`` without forming
  ``g_i`` (the ghost norm: Goodfellow 2015; Li, Tramèr, Liang and Hashimoto, ICLR 2022),
  and ``sum_i f_i g_i = (f o)^T a`` is one matrix product;
- a convolution's (and a linear layer's on sequences) per-example gradients are formed,
  where that is the cheaper of the two (mixed ghost clipping, Bu et al., 2022, "Scalable
  and Efficient Training of Large Convolutional Neural Networks with Differential
  Privacy": for the fleet's CNN the kernels are small and the feature maps large, so
  instantiating is cheaper), by torch's convolution weight-gradient vectorised over the
  batch (``torch.func.vmap``), not Opacus' unfold-and-einsum.

The result is the same clipped sum Opacus' ``DPOptimizer`` computes (to float rounding,
with its ``C / (||g_i|| + 1e-6)`` factor), so the mechanism -- and what Opacus' accountant
counts for it -- is unchanged. Models with any other trainable layer (GroupNorm,
embeddings, a layer used twice in one forward pass) are left to Opacus
(:func:`supported`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap
from torch.nn.grad import conv2d_weight

from fedge.privacy.settings import PrivacyError

CLIP_EPSILON = 1e-6  # Opacus' clip factor C / (||g_i|| + 1e-6): the same factor, the same sum


def unsupported(model: nn.Module) -> list[str]:
    """Why book-keeping cannot clip ``model``'s gradients (empty: it can)."""
    found: list[str] = []
    for name, module in model.named_modules():
        trainable = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not trainable:
            continue
        label = f"{name or '<model>'} ({type(module).__name__})"
        if type(module) is nn.Linear:
            continue
        if type(module) is nn.Conv2d:
            if module.groups != 1:
                found.append(f"{label}: grouped convolution")
            elif module.padding_mode != "zeros" or isinstance(module.padding, str):
                found.append(f"{label}: padding {module.padding!r} ({module.padding_mode})")
            continue
        found.append(f"{label}: no book-keeping rule for this layer")
    return found


def supported(model: nn.Module) -> bool:
    return not unsupported(model)


@dataclass(frozen=True)
class _Layer:
    """One layer's share of a step: its examples' squared gradient norms, and how to set
    its parameters' ``.grad`` to the clipped sum once the clip factors are known."""

    squared_norms: torch.Tensor
    assign: Callable[[torch.Tensor], None]


class BookKeeping:
    """Hooks on ``model``'s linear and convolution layers; :meth:`clipped_sum` per step.

    Construct once per training, :meth:`close` after it (the model is then as before)."""

    def __init__(self, model: nn.Module) -> None:
        problems = unsupported(model)
        if problems:
            raise PrivacyError(f"book-keeping cannot clip this model: {'; '.join(problems)}")
        self.model = model
        self.layers = [
            m
            for m in model.modules()
            if isinstance(m, (nn.Linear, nn.Conv2d))
            and any(p.requires_grad for p in m.parameters(recurse=False))
        ]
        self._inputs: dict[nn.Module, torch.Tensor] = {}
        self._outputs: dict[nn.Module, torch.Tensor] = {}
        self._recording = False
        self._handles = [m.register_forward_hook(self._record) for m in self.layers]

    def _record(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: object) -> None:
        if not self._recording:
            return
        if module in self._outputs:
            raise PrivacyError(
                f"book-keeping needs each layer once per forward pass; {type(module).__name__} "
                "ran twice (shared weights): train this model with Opacus' hooks"
            )
        assert isinstance(output, torch.Tensor)
        self._inputs[module] = inputs[0].detach()
        self._outputs[module] = output

    def clipped_sum(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        clipping_norm: float,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[float, torch.Tensor]:
        """Set every trainable parameter's ``.grad`` to ``sum_i clip_C(g_i)`` over the batch.

        ``loss_fn(logits, labels)`` gives one loss per example (default: cross-entropy).
        Returns the batch's mean loss and the examples' gradient norms before clipping.
        """
        per_example = loss_fn or _cross_entropy
        self._inputs.clear()
        self._outputs.clear()
        self._recording = True
        try:
            logits = self.model(inputs)
        finally:
            self._recording = False
        losses = per_example(logits, labels)
        used = [m for m in self.layers if m in self._outputs]
        output_grads = torch.autograd.grad(losses.sum(), [self._outputs[m] for m in used])
        parts = [_layer(m, self._inputs[m], o) for m, o in zip(used, output_grads, strict=True)]
        self._inputs.clear()
        self._outputs.clear()
        squared = torch.zeros(len(labels), device=inputs.device, dtype=inputs.dtype)
        for part in parts:
            squared = squared + part.squared_norms
        norms = squared.sqrt()
        factors = (clipping_norm / (norms + CLIP_EPSILON)).clamp(max=1.0)
        for part in parts:
            part.assign(factors)
        for m in self.layers:  # a layer the forward pass skipped: its gradient is zero
            if m not in used:
                for p in m.parameters(recurse=False):
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
        return float(losses.detach().mean()), norms.detach()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._inputs.clear()
        self._outputs.clear()


def add_noise(
    parameters: list[nn.Parameter],
    std: float,
    expected_batch_size: int,
    generator: torch.Generator,
) -> None:
    """``grad <- (grad + N(0, std^2)) / expected_batch_size`` for each parameter (a missing
    grad is zero: an empty Poisson batch still releases noise), as Opacus'
    ``DPOptimizer.add_noise`` and its mean-reduction scaling do."""
    for p in parameters:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        noise = torch.normal(
            mean=0.0, std=std, size=p.shape, device=p.device, dtype=p.dtype, generator=generator
        )
        p.grad = (grad + noise) / expected_batch_size


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels, reduction="none")


def _layer(module: nn.Module, a: torch.Tensor, o: torch.Tensor) -> _Layer:
    if isinstance(module, nn.Conv2d):
        return _conv2d(module, a, o)
    assert isinstance(module, nn.Linear)
    if a.dim() == 2:
        return _linear_ghost(module, a, o)
    batch = a.shape[0]
    return _instantiated(
        module,
        torch.einsum("bto,bti->boi", o.reshape(batch, -1, o.shape[-1]),
                     a.reshape(batch, -1, a.shape[-1])),
        o.reshape(batch, -1, o.shape[-1]).sum(1),
    )  # fmt: skip


def _linear_ghost(module: nn.Linear, a: torch.Tensor, o: torch.Tensor) -> _Layer:
    """``||o_i a_i^T||^2 = ||o_i||^2 ||a_i||^2``; the clipped sum is ``(f o)^T a``."""
    o_sq = o.pow(2).sum(1)
    squared = torch.zeros_like(o_sq)
    if module.weight.requires_grad:
        squared = squared + o_sq * a.pow(2).sum(1)
    bias = module.bias
    if bias is not None and bias.requires_grad:
        squared = squared + o_sq

    def assign(factors: torch.Tensor) -> None:
        scaled = o * factors[:, None]
        if module.weight.requires_grad:
            module.weight.grad = scaled.T @ a
        if bias is not None and bias.requires_grad:
            bias.grad = scaled.sum(0)

    return _Layer(squared, assign)


def _conv2d(module: nn.Conv2d, a: torch.Tensor, o: torch.Tensor) -> _Layer:
    """Per-example weight gradients by torch's own convolution weight-gradient, vectorised
    over the batch (``vmap``): 2.6x faster here than Opacus' unfold-and-einsum."""
    weight_size = tuple(module.weight.shape)

    def one(a_i: torch.Tensor, o_i: torch.Tensor) -> torch.Tensor:
        grad: torch.Tensor = conv2d_weight(  # type: ignore[no-untyped-call]
            a_i[None],
            weight_size,
            o_i[None],
            stride=module.stride,
            padding=module.padding,  # ints: unsupported() refuses a str
            dilation=module.dilation,
        )
        return grad

    weight_grads = vmap(one)(a, o)  # [batch, out, in, kh, kw]
    return _instantiated(module, weight_grads, o.sum(dim=(2, 3)))


def _instantiated(
    module: nn.Linear | nn.Conv2d, weight_grads: torch.Tensor, bias_grads: torch.Tensor
) -> _Layer:
    """Per-example gradients formed (``[batch, *]``); the clipped sum weights them."""
    batch = weight_grads.shape[0]
    squared = torch.zeros(batch, device=weight_grads.device, dtype=weight_grads.dtype)
    if module.weight.requires_grad:
        squared = squared + weight_grads.reshape(batch, -1).pow(2).sum(1)
    bias = module.bias
    if bias is not None and bias.requires_grad:
        squared = squared + bias_grads.pow(2).sum(1)

    def assign(factors: torch.Tensor) -> None:
        if module.weight.requires_grad:
            summed = torch.tensordot(factors, weight_grads, dims=1)
            module.weight.grad = summed.reshape(module.weight.shape)
        if bias is not None and bias.requires_grad:
            bias.grad = factors @ bias_grads

    return _Layer(squared, assign)
