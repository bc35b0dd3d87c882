"""The architectures a distilling strategy may give its tiers: a name -> a fresh network.

FedDF (Lin et al., NeurIPS 2020) fuses models of different architectures; which
architectures exist depends on the task. The simulator's digits parties train the MLPs of
:mod:`fedge.models.digits` (:data:`DIGITS`); a fleet's stations train a registry model's
family at several sizes (built by :func:`fedge.party.families.architectures`, which the
aggregator cannot import: it is handed the catalogue). The distillation itself
(:mod:`fedge.aggregator.strategies.feddf` and ``ensemble``) is one code path for both and
sees only this catalogue.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from fedge.models import digits


@dataclass(frozen=True)
class Architectures:
    """``names``: the architectures known; ``build(arch, seed)``: a freshly initialised
    network of ``arch`` returning logits (the same seed, the same weights);
    ``sample_shape``: one input sample's shape (the proxy set's rows)."""

    names: frozenset[str]
    build: Callable[[str, int], nn.Module]
    sample_shape: tuple[int, ...]
    what: str = "architecture"
    """How errors name the catalogue (e.g. "inspection-cnn architecture")."""

    def check(self, archs: tuple[str, ...]) -> None:
        """ValueError naming the unknown ones and the known ones."""
        unknown = sorted(set(archs) - self.names)
        if unknown:
            known = ", ".join(sorted(self.names))
            raise ValueError(f"tier_archs: unknown {self.what}(s) {unknown} (known: {known})")

    def parameters(self, arch: str) -> int:
        return digits.count_parameters(self.build(arch, 0))


DIGITS = Architectures(
    names=frozenset(digits.ARCHITECTURES),
    build=lambda arch, seed: digits.make_model(arch, seed=seed),
    sample_shape=(digits.N_FEATURES,),
    what="architecture",
)
"""The simulator's digits MLPs on 64 features."""
