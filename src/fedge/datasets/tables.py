"""The project's data sets as arrays, and one seed's split of one into its parts.

``digits`` is scikit-learn's bundled 8x8 digits, ``inspection`` the generated surfaces of
:mod:`fedge.datasets.defects`. Nothing is downloaded. How a data set is split across a
fleet's parties is the simulator's (:func:`fedge.sim.data.make_partitions`); what a split
*is* lives here, so students and models can take one without knowing any scenario.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from fedge.datasets.defects import make_defect_images
from fedge.datasets.errors import DatasetError

FloatArray = npt.NDArray[np.float32]
LabelArray = npt.NDArray[np.int64]
IndexArray = npt.NDArray[np.int64]
Split = tuple[FloatArray, LabelArray]
_ArrayT = TypeVar("_ArrayT", bound=npt.NDArray[Any])

DATASETS: tuple[str, ...] = ("digits", "inspection")


class UnknownDataset(DatasetError, ValueError):
    """A data set name none of :data:`DATASETS`."""


@dataclass(frozen=True, eq=False)
class Partitions:
    """One seed's split of a dataset. ``parties[i]`` and ``validation[i]`` are partition ``i``.

    The ``*_indices`` arrays index the rows of :func:`load_dataset`'s output, so tests and
    reports can check that the splits are disjoint and where each sample went.
    """

    test: Split
    proxy_X: FloatArray
    parties: Sequence[Split]
    """Each party's local training data (a tuple, or a lazy sequence at fleet scale)."""
    validation: Sequence[Split]
    """Each party's local validation split (possibly empty for a 1-sample party)."""
    test_indices: IndexArray
    proxy_indices: IndexArray
    party_indices: Sequence[IndexArray]
    validation_indices: Sequence[IndexArray]
    sizes: tuple[int, ...] = ()
    """Training plus validation samples of each party, where known without drawing its
    data (fleet scale); empty: read from the index arrays."""

    @property
    def num_parties(self) -> int:
        return len(self.parties)

    def party_size(self, partition_id: int) -> int:
        """Training plus validation samples of one party."""
        if self.sizes:
            return self.sizes[partition_id]
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
    raise UnknownDataset(f"data.dataset must be one of {list(DATASETS)}, got {name!r}")


@functools.cache
def _digits() -> Split:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    features = np.asarray(bunch.data, dtype=np.float32) / np.float32(16.0)
    labels = np.asarray(bunch.target, dtype=np.int64)
    return frozen(features), frozen(labels)


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
    return frozen(features.astype(np.float32)), frozen(labels.astype(np.int64))


def frozen(array: _ArrayT) -> _ArrayT:
    """``array``, made read-only (the cached data sets are shared by every caller)."""
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False)
class Source:
    """One seed's split of a data set, with the name lineage records for it.

    What students and teachers train on (:mod:`fedge.students.edge`): they need the split,
    not the scenario that made it (:func:`fedge.sim.data.source` builds one from a scenario).
    """

    partitions: Partitions
    name: str
    """E.g. ``tifl-digits seed 0``: the registry lineage's data field names it."""
    seed: int
