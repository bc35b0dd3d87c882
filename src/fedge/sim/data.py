"""Offline datasets and their split into a held-out test set, a proxy set and party shards.

The split follows ../shared/research/fl-algorithms.md section 9.1:

1. a stratified held-out **test** set (``data.test_fraction`` of the whole dataset);
2. an unlabeled server-side **proxy** set, stratified, ``data.proxy_fraction`` of what is
   left (FedDF-style ensemble distillation needs unlabeled data the parties never see);
3. everything else goes to the **parties**. A party's sample count comes from its group's
   ``data_share`` (TiFL's data-quantity heterogeneity), split evenly inside the group; its
   label mix is drawn from Dirichlet(``data.alpha``) and filled from per-class pools
   without replacement, falling back to other classes when a pool runs dry. Every pool
   sample is used exactly once;
4. each party keeps 10 % of its samples (at least one when it has two or more) as a local
   **validation** split: TiFL's per-tier test data ``TestData_t`` (Chai et al. 2020, Alg. 2).

Everything is deterministic for ``(scenario, seed)`` and cached per process, because every
ClientApp call needs the partition of its party. The cached arrays are read-only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from fedge.datasets.defects import make_defect_images
from fedge.sim.scenario import DATASETS, DataSpec, FleetSpec, Scenario, ScenarioError

FloatArray = npt.NDArray[np.float32]
LabelArray = npt.NDArray[np.int64]
IndexArray = npt.NDArray[np.int64]
Split = tuple[FloatArray, LabelArray]
_ArrayT = TypeVar("_ArrayT", bound=npt.NDArray[Any])

VALIDATION_FRACTION = 0.1
"""Share of each party's samples kept for local validation (TiFL's per-client test data)."""

# Independent random streams, so changing one step never reshuffles another.
_TEST_STREAM, _PROXY_STREAM, _LABEL_STREAM, _VALIDATION_STREAM = range(4)


@dataclass(frozen=True, eq=False)
class Partitions:
    """One seed's split of a dataset. ``parties[i]`` and ``validation[i]`` are partition ``i``.

    The ``*_indices`` arrays index the rows of :func:`load_dataset`'s output, so tests and
    reports can check that the splits are disjoint and where each sample went.
    """

    test: Split
    proxy_X: FloatArray
    parties: tuple[Split, ...]
    """Each party's local training data."""
    validation: tuple[Split, ...]
    """Each party's local validation split (possibly empty for a 1-sample party)."""
    test_indices: IndexArray
    proxy_indices: IndexArray
    party_indices: tuple[IndexArray, ...]
    validation_indices: tuple[IndexArray, ...]

    @property
    def num_parties(self) -> int:
        return len(self.parties)

    def party_size(self, partition_id: int) -> int:
        """Training plus validation samples of one party."""
        return len(self.party_indices[partition_id]) + len(self.validation_indices[partition_id])


def load_dataset(name: str = "digits") -> Split:
    """``(X, y)``: X float32 ``[n, features]`` scaled to [0, 1], y int64. Read-only arrays.

    ``digits`` is scikit-learn's bundled 8x8 digits (1,797 images, 10 classes): offline,
    nothing is downloaded. ``inspection`` is :data:`INSPECTION_IMAGES` generated 8x8
    brushed-metal surfaces, clean or scratched (:mod:`fedge.datasets.defects`; labels 0/1 in
    the models' 10-way head): enough images for stations of over 1,000 each, which DP-SGD
    needs (its noise is amortised over a party's data; Abadi et al. 2016).
    """
    if name == "digits":
        return _digits()
    if name == "inspection":
        return _inspection()
    raise ScenarioError(f"data.dataset must be one of {list(DATASETS)}, got {name!r}")


@functools.cache
def _digits() -> Split:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    features = np.asarray(bunch.data, dtype=np.float32) / np.float32(16.0)
    labels = np.asarray(bunch.target, dtype=np.int64)
    return _frozen(features), _frozen(labels)


INSPECTION_IMAGES = 16_000
_INSPECTION_SEED = 20_201  # one fixed dataset; a run's seed only changes how it is split


@functools.cache
def _inspection() -> Split:
    images, labels = make_defect_images(INSPECTION_IMAGES, size=8, seed=_INSPECTION_SEED)
    flat = images.reshape(len(images), -1).astype(np.float32) / np.float32(255.0)
    # Per-image standardisation: the scratch is a local contrast, the surface's brightness
    # and gradient are not -- without it a small MLP stays near chance at 8x8.
    centred = flat - flat.mean(axis=1, keepdims=True)
    features = centred / (flat.std(axis=1, keepdims=True) + np.float32(1e-3))
    return _frozen(features.astype(np.float32)), _frozen(labels.astype(np.int64))


def make_partitions(scenario: Scenario, seed: int) -> Partitions:
    """The split of ``scenario``'s dataset for ``seed`` (cached on the data and fleet specs)."""
    return _partitions(scenario.data, scenario.fleet, seed)


def party_sizes(fleet: FleetSpec, total: int) -> tuple[int, ...]:
    """How many samples each partition holds when the parties share ``total`` samples.

    Groups get ``data_share * total`` samples (largest remainder, so the sizes add up to
    ``total``), split evenly among their parties, the first ones taking one extra.
    A lognormal fleet has no groups: every party gets an even share.
    """
    if fleet.speed_distribution == "lognormal":
        return _even(total, fleet.parties)
    group_totals = _largest_remainder(
        np.array([group.data_share for group in fleet.groups]) * total, total
    )
    sizes: list[int] = []
    for group, group_total in zip(fleet.groups, group_totals, strict=True):
        sizes.extend(_even(group_total, group.count))
    return tuple(sizes)


@functools.lru_cache(maxsize=16)
def _partitions(data: DataSpec, fleet: FleetSpec, seed: int) -> Partitions:
    features, labels = load_dataset(data.dataset)
    all_indices = np.arange(len(labels), dtype=np.int64)

    test_indices, pool = _stratified_take(
        all_indices, labels, data.test_fraction, _rng(seed, _TEST_STREAM)
    )
    proxy_indices, pool = _stratified_take(
        pool, labels, data.proxy_fraction, _rng(seed, _PROXY_STREAM)
    )
    sizes = party_sizes(fleet, len(pool))
    if min(sizes) < 1:
        raise ScenarioError(
            f"{len(pool)} samples cannot give each of fleet.parties ({fleet.parties}) at "
            "least one; lower fleet.parties or data.test_fraction / data.proxy_fraction"
        )
    shards = _dirichlet_shards(pool, labels, sizes, data.alpha, _rng(seed, _LABEL_STREAM))

    validation_rng = _rng(seed, _VALIDATION_STREAM)
    train_shards: list[IndexArray] = []
    validation_shards: list[IndexArray] = []
    for shard in shards:
        shuffled = validation_rng.permutation(shard)
        n_validation = validation_size(len(shuffled))
        validation_shards.append(_frozen(np.sort(shuffled[:n_validation])))
        train_shards.append(_frozen(np.sort(shuffled[n_validation:])))

    test_indices, proxy_indices = np.sort(test_indices), np.sort(proxy_indices)

    def rows(indices: IndexArray) -> Split:
        return _frozen(features[indices]), _frozen(labels[indices])

    return Partitions(
        test=rows(test_indices),
        proxy_X=_frozen(features[proxy_indices]),
        parties=tuple(rows(indices) for indices in train_shards),
        validation=tuple(rows(indices) for indices in validation_shards),
        test_indices=_frozen(test_indices),
        proxy_indices=_frozen(proxy_indices),
        party_indices=tuple(train_shards),
        validation_indices=tuple(validation_shards),
    )


def validation_size(n_samples: int) -> int:
    """Local validation samples for a party of ``n_samples``: 10 %, at least 1 from 2 up."""
    if n_samples < 2:
        return 0
    return max(1, round(VALIDATION_FRACTION * n_samples))


def _dirichlet_shards(
    pool: IndexArray,
    labels: LabelArray,
    sizes: tuple[int, ...],
    alpha: float,
    rng: np.random.Generator,
) -> list[IndexArray]:
    """Deal ``pool`` into shards of ``sizes`` with Dirichlet(alpha) label mixes.

    Parties are served in a random order so that the leftovers of drained pools (which
    make the last parties' mixes less skewed than drawn) do not always land on the same
    partition ids.
    """
    classes = np.unique(labels[pool])
    pools = [rng.permutation(pool[labels[pool] == label]) for label in classes]
    available = np.array([len(class_pool) for class_pool in pools], dtype=np.int64)
    taken_so_far = np.zeros_like(available)
    shards: list[IndexArray] = [np.empty(0, dtype=np.int64)] * len(sizes)

    for party in rng.permutation(len(sizes)):
        want = int(sizes[party])
        mix = rng.dirichlet(np.full(len(classes), alpha))
        if not np.all(np.isfinite(mix)) or mix.sum() <= 0:
            mix = np.full(len(classes), 1.0 / len(classes))
        counts = np.minimum(rng.multinomial(want, mix / mix.sum()), available)
        while (deficit := want - int(counts.sum())) > 0:
            # A pool ran dry: redraw the missing samples from classes that still have
            # some, keeping the party's mix where it can and the pool sizes where it cannot.
            capacity = available - counts
            weights = mix * (capacity > 0)
            if weights.sum() <= 0:
                weights = capacity.astype(np.float64)
            counts += np.minimum(rng.multinomial(deficit, weights / weights.sum()), capacity)
        parts = [
            pools[k][taken_so_far[k] : taken_so_far[k] + counts[k]] for k in range(len(classes))
        ]
        taken_so_far += counts
        available -= counts
        shards[party] = np.concatenate(parts).astype(np.int64)
    return shards


def _stratified_take(
    indices: IndexArray, labels: LabelArray, fraction: float, rng: np.random.Generator
) -> tuple[IndexArray, IndexArray]:
    """Split ``indices`` into (taken, rest) with ``round(fraction * n)`` taken per class mix."""
    if fraction <= 0:
        return np.empty(0, dtype=np.int64), indices
    classes, class_counts = np.unique(labels[indices], return_counts=True)
    quotas = _largest_remainder(class_counts * fraction, round(fraction * len(indices)))
    taken: list[IndexArray] = []
    for label, quota in zip(classes, quotas, strict=True):
        members = indices[labels[indices] == label]
        taken.append(rng.choice(members, size=quota, replace=False))
    chosen = np.concatenate(taken).astype(np.int64)
    rest = np.setdiff1d(indices, chosen, assume_unique=True).astype(np.int64)
    return chosen, rest


def _largest_remainder(ideal: npt.NDArray[np.floating[Any]], total: int) -> list[int]:
    """Round ``ideal`` to integers summing to ``total`` (Hamilton's method)."""
    floors = np.floor(ideal).astype(np.int64)
    remainders = ideal - floors
    short = total - int(floors.sum())
    # Stable sort: ties go to the earlier entry, so the result does not depend on an RNG.
    for position in np.argsort(-remainders, kind="stable")[: max(short, 0)]:
        floors[position] += 1
    return [int(value) for value in floors]


def _even(total: int, parts: int) -> tuple[int, ...]:
    base, extra = divmod(total, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _frozen(array: _ArrayT) -> _ArrayT:
    array.flags.writeable = False
    return array
