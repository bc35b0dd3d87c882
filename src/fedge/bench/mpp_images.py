"""The images the MPP benchmark (:mod:`fedge.bench.mpp`) scores: its scenarios, fresh
generated images each (:mod:`fedge.datasets.defects`), relit (:mod:`fedge.monitoring.relight`)
or with a new defect shape, and the re-lit copies of the gate set a station reports.
"""

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from fedge.datasets.defects import make_defect_images
from fedge.monitoring.relight import (
    from_uint8,
    relight_linear,
    relight_spot,
    relit_copies,
    to_uint8,
)

Images = npt.NDArray[np.uint8]
Labels = npt.NDArray[np.int64]


SCENARIOS: dict[str, Callable[[int, int], tuple[Images, Labels]]] = {}
"""Scenario name -> ``(n, seed) -> (images, labels)``; filled below."""


def _in_distribution(n: int, seed: int) -> tuple[Images, Labels]:
    return make_defect_images(n, seed=seed)


def _lighting_gradient(n: int, seed: int) -> tuple[Images, Labels]:
    images, labels = make_defect_images(n, seed=seed)
    rng = np.random.default_rng(seed + 1)
    relit = relight_linear(from_uint8(images), rng, gain=1.0, offset=0.0, gradient=0.6)
    return to_uint8(relit), labels


def _lighting_spot(n: int, seed: int) -> tuple[Images, Labels]:
    images, labels = make_defect_images(n, seed=seed)
    rng = np.random.default_rng(seed + 1)
    relit = relight_spot(from_uint8(images), rng, gain=0.7, amplitude=0.5, sigma=0.25)
    return to_uint8(relit), labels


def _new_defect_dents(n: int, seed: int) -> tuple[Images, Labels]:
    return make_defect_images(n, seed=seed, dent_fraction=1.0)


def _new_defect_mixed(n: int, seed: int) -> tuple[Images, Labels]:
    return make_defect_images(n, seed=seed, dent_fraction=0.5)


SCENARIOS.update(
    in_distribution=_in_distribution,
    lighting_gradient=_lighting_gradient,
    lighting_spot=_lighting_spot,
    new_defect_dents=_new_defect_dents,
    new_defect_mixed=_new_defect_mixed,
)
STREAM_SHIFTS = ("lighting_gradient", "lighting_spot", "new_defect_dents")


def gate_relit(images: Images, base: int, copies: int) -> Images:
    """``copies`` re-lit copies of each gate image, image by image (copy 1, 2, ... of
    image 0 first), keyed like held-out images on a station."""
    relit = [
        copy
        for index, image in enumerate(images)
        for copy in relit_copies(from_uint8(image), f"g{base}-{index:05d}", copies)
    ]
    return to_uint8(np.stack(relit))
