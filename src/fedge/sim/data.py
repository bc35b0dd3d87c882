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

At fleet scale (``data.samples_per_party`` > 0, issue 29) step 3 changes: a party draws
its samples from the pool *with replacement* (its Dirichlet mix, its group's share of
the data), from its own random stream, the first time it is asked -- so 10,000 parties
cost nothing until they train, a party's data is the same whoever asks and in whatever
order, and only the parties asked lately are kept (:class:`_Draws`).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

import numpy as np
import numpy.typing as npt

from fedge.datasets.tables import (
    IndexArray,
    LabelArray,
    Partitions,
    Source,
    Split,
    frozen,
    load_dataset,
)
from fedge.sim.scenario import DataSpec, FleetSpec, Scenario, ScenarioError

VALIDATION_FRACTION = 0.1
"""Share of each party's samples kept for local validation (TiFL's per-client test data)."""

# Independent random streams, so changing one step never reshuffles another.
_TEST_STREAM, _PROXY_STREAM, _LABEL_STREAM, _VALIDATION_STREAM, _DRAW_STREAM = range(5)
# Parties whose drawn indices are kept at fleet scale: a round's worth and then some.
DRAWS_KEPT = 512
_T = TypeVar("_T")


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
    if data.samples_per_party:
        return _streamed(data, fleet, seed, features, labels, test_indices, proxy_indices, pool)
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
        validation_shards.append(frozen(np.sort(shuffled[:n_validation])))
        train_shards.append(frozen(np.sort(shuffled[n_validation:])))

    test_indices, proxy_indices = np.sort(test_indices), np.sort(proxy_indices)

    def rows(indices: IndexArray) -> Split:
        return frozen(features[indices]), frozen(labels[indices])

    return Partitions(
        test=rows(test_indices),
        proxy_X=frozen(features[proxy_indices]),
        parties=tuple(rows(indices) for indices in train_shards),
        validation=tuple(rows(indices) for indices in validation_shards),
        test_indices=frozen(test_indices),
        proxy_indices=frozen(proxy_indices),
        party_indices=tuple(train_shards),
        validation_indices=tuple(validation_shards),
    )


def _streamed(
    data: DataSpec,
    fleet: FleetSpec,
    seed: int,
    features: npt.NDArray[np.float32],
    labels: LabelArray,
    test_indices: IndexArray,
    proxy_indices: IndexArray,
    pool: IndexArray,
) -> Partitions:
    """Fleet scale: the same test and proxy splits, each party's data drawn lazily."""
    sizes = party_sizes(fleet, fleet.parties * data.samples_per_party)
    if min(sizes) < 1:
        raise ScenarioError(
            f"data.samples_per_party = {data.samples_per_party} gives some of the "
            f"{fleet.parties} parties no sample (their group's data_share is too small); "
            "raise data.samples_per_party"
        )
    draws = _Draws(pool, labels, sizes, data.alpha, seed)

    def rows(indices: IndexArray) -> Split:
        return frozen(features[indices]), frozen(labels[indices])

    test_indices, proxy_indices = np.sort(test_indices), np.sort(proxy_indices)
    return Partitions(
        test=rows(test_indices),
        proxy_X=frozen(features[proxy_indices]),
        parties=_Lazy(len(sizes), lambda p: rows(draws(p)[0])),
        validation=_Lazy(len(sizes), lambda p: rows(draws(p)[1])),
        test_indices=frozen(test_indices),
        proxy_indices=frozen(proxy_indices),
        party_indices=_Lazy(len(sizes), lambda p: draws(p)[0]),
        validation_indices=_Lazy(len(sizes), lambda p: draws(p)[1]),
        sizes=sizes,
    )


class _Draws:
    """Each party's (training, validation) indices, drawn when first asked and kept for
    the :data:`DRAWS_KEPT` parties asked most recently (thread-safe: the in-process grid
    runs parties on a pool)."""

    def __init__(
        self,
        pool: IndexArray,
        labels: LabelArray,
        sizes: tuple[int, ...],
        alpha: float,
        seed: int,
    ) -> None:
        classes = np.unique(labels[pool])
        self._pools = [np.sort(pool[labels[pool] == label]) for label in classes]
        self._sizes = sizes
        self._alpha = alpha
        self._seed = seed
        self._kept: OrderedDict[int, tuple[IndexArray, IndexArray]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, party: int) -> tuple[IndexArray, IndexArray]:
        with self._lock:
            if party in self._kept:
                self._kept.move_to_end(party)
                return self._kept[party]
        drawn = self._draw(party)  # outside the lock: a pure function of the party
        with self._lock:
            self._kept[party] = drawn
            while len(self._kept) > DRAWS_KEPT:
                self._kept.popitem(last=False)
        return drawn

    def _draw(self, party: int) -> tuple[IndexArray, IndexArray]:
        if not 0 <= party < len(self._sizes):
            raise IndexError(f"party {party} of {len(self._sizes)}")
        rng = np.random.default_rng([self._seed, _DRAW_STREAM, party])
        mix = rng.dirichlet(np.full(len(self._pools), self._alpha))
        if not np.all(np.isfinite(mix)) or mix.sum() <= 0:
            mix = np.full(len(self._pools), 1.0 / len(self._pools))
        counts = rng.multinomial(self._sizes[party], mix / mix.sum())
        chosen = np.concatenate(
            [
                rng.choice(pool, size=n, replace=True)
                for pool, n in zip(self._pools, counts, strict=True)
            ]
        ).astype(np.int64)
        shuffled = rng.permutation(chosen)
        n_validation = validation_size(len(shuffled))
        return frozen(np.sort(shuffled[n_validation:])), frozen(np.sort(shuffled[:n_validation]))


class _Lazy(Sequence[_T]):
    """A read-only sequence whose items are made when read (a party's data at fleet scale)."""

    def __init__(self, length: int, make: Callable[[int], _T]) -> None:
        self._length = length
        self._make = make

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> _T: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[_T]: ...

    def __getitem__(self, index: int | slice) -> _T | Sequence[_T]:
        if isinstance(index, slice):
            return [self._make(i) for i in range(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"index {index} of {self._length}")
        return self._make(index)

    def __iter__(self) -> Iterator[_T]:
        return (self._make(i) for i in range(self._length))


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


def source(scenario: Scenario, seed: int) -> Source:
    """``scenario``'s split for ``seed``, named for lineage: what students train on."""
    return Source(make_partitions(scenario, seed), f"{scenario.name} seed {seed}", seed)
