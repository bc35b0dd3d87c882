"""Sufficient statistics of good parts' features, their sum, and the Gaussian fit.

Pure functions over frozen dataclasses (NumPy only). Per location ``l`` of the feature
grid a station keeps ``count``, ``sum_l = sum_i x_il`` and ``outer_l = sum_i x_il x_il^T``
in float64; statistics from several stations add, and the fit from the sum is the fit
on the pooled parts up to float64 rounding (the order of the additions), since the
unbiased covariance is ``(outer - n mu mu^T) / (n - 1)`` (PaDiM's model, Defard et al.,
ICPR 2021). Sums are also what SecAgg+ adds without seeing any station's share.

Shrinkage: a station or fleet with fewer good parts than feature dimensions has a
singular sample covariance. The fit shrinks it towards the scaled identity ``tau I``
(``tau`` = mean variance, the target of Ledoit & Wolf, J. Multivariate Anal. 2004) with
a fixed intensity ``prior / (n - 1 + prior)`` -- the posterior mean under a conjugate
inverse-Wishart prior of ``prior`` pseudo-parts (Gelman et al., *Bayesian Data Analysis*,
3.6), which fades as parts accumulate -- and adds PaDiM's ridge ``eps I`` (eps = 0.01) so
a location whose features never vary stays invertible. Ledoit-Wolf's *estimated*
intensity needs fourth moments of centred features, which are no per-station sums; a
fixed intensity keeps the fit a function of the summed statistics, so federated = pooled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedge.models.anomaly import StatisticsError

Float64Array = npt.NDArray[np.float64]

DEFAULT_RIDGE = 0.01
"""PaDiM's regularisation term eps (Defard et al., 2021, eq. 1)."""
DEFAULT_PRIOR_PARTS = 8.0
"""Pseudo-parts of the shrinkage target: half its weight at 9 parts, 1 % at 800."""


@dataclass(frozen=True, eq=False)
class SufficientStatistics:
    """``count`` good parts' features per location: ``total`` (L, d), ``outer`` (L, d, d)."""

    count: int
    total: Float64Array
    outer: Float64Array
    grid: tuple[int, int]
    """The feature map's (h, w); ``L = h * w`` locations in row-major order."""

    def __post_init__(self) -> None:
        locations = self.grid[0] * self.grid[1]
        if self.total.ndim != 2 or self.total.shape[0] != locations:
            raise StatisticsError(
                f"total must be [{locations}, d] for a {self.grid} grid, got {self.total.shape}"
            )
        dims = self.total.shape[1]
        if self.outer.shape != (locations, dims, dims):
            raise StatisticsError(
                f"outer must be {(locations, dims, dims)}, got {self.outer.shape}"
            )
        if self.total.dtype != np.float64 or self.outer.dtype != np.float64:
            raise StatisticsError("statistics are accumulated in float64")

    @property
    def dims(self) -> int:
        return int(self.total.shape[1])


@dataclass(frozen=True, eq=False)
class GaussianFit:
    """Per-location ``mean`` (L, d) and shrunk ``covariance`` (L, d, d), from ``count`` parts."""

    count: int
    mean: Float64Array
    covariance: Float64Array
    grid: tuple[int, int]


def station_statistics(features: Float64Array, grid: tuple[int, int]) -> SufficientStatistics:
    """The statistics of one station's good parts' ``features`` ``(n, L, d)``."""
    if features.ndim != 3 or features.shape[1] != grid[0] * grid[1]:
        raise StatisticsError(f"features must be [n, {grid[0] * grid[1]}, d], got {features.shape}")
    if features.shape[0] == 0:
        raise StatisticsError(
            "no good parts: a station needs at least one part labelled good to contribute"
        )
    if not np.all(np.isfinite(features)):
        raise StatisticsError("features hold NaN or infinity; check the backbone and images")
    x = np.asarray(features, dtype=np.float64)
    return SufficientStatistics(
        count=int(x.shape[0]),
        total=x.sum(axis=0),
        outer=np.einsum("nld,nle->lde", x, x),
        grid=grid,
    )


def add_statistics(parts: Sequence[SufficientStatistics]) -> SufficientStatistics:
    """The sum of several stations' statistics (what the aggregator computes)."""
    if not parts:
        raise StatisticsError("no statistics to add: no station answered with good parts")
    first = parts[0]
    for other in parts[1:]:
        if other.grid != first.grid or other.dims != first.dims:
            raise StatisticsError(
                f"statistics of a {other.grid} grid with {other.dims} dims cannot be added "
                f"to {first.grid} with {first.dims}: the stations ran different backbones"
            )
    return SufficientStatistics(
        count=sum(p.count for p in parts),
        total=np.sum([p.total for p in parts], axis=0),
        outer=np.sum([p.outer for p in parts], axis=0),
        grid=first.grid,
    )


def fit(
    stats: SufficientStatistics,
    *,
    prior_parts: float = DEFAULT_PRIOR_PARTS,
    ridge: float = DEFAULT_RIDGE,
) -> GaussianFit:
    """Per-location mean and shrunk covariance from summed statistics (module docstring)."""
    if stats.count < 1:
        raise StatisticsError(f"cannot fit from {stats.count} parts; at least 1 is needed")
    if prior_parts < 0 or ridge <= 0:
        raise StatisticsError(f"need prior_parts >= 0 and ridge > 0, got {prior_parts}, {ridge}")
    n = float(stats.count)
    mean = stats.total / n
    scatter = stats.outer - n * np.einsum("ld,le->lde", mean, mean)
    scatter = 0.5 * (scatter + np.swapaxes(scatter, 1, 2))  # exact symmetry for Cholesky
    dims = stats.dims
    eye = np.eye(dims)
    tau = np.clip(np.trace(scatter, axis1=1, axis2=2) / max(n - 1.0, 1.0) / dims, 0.0, None)
    covariance = (scatter + prior_parts * tau[:, None, None] * eye) / max(
        n - 1.0 + prior_parts, 1.0
    )
    covariance = _positive_semidefinite(covariance) + ridge * eye
    return GaussianFit(count=stats.count, mean=mean, covariance=covariance, grid=stats.grid)


def _positive_semidefinite(covariance: Float64Array) -> Float64Array:
    """``covariance`` unchanged when PSD, else its eigenvalues clipped at 0 (noisy DP sums)."""
    eigenvalues = np.linalg.eigvalsh(covariance)
    if np.all(eigenvalues >= 0):
        return covariance
    values, vectors = np.linalg.eigh(covariance)
    clipped: Float64Array = np.einsum(
        "lij,lj,lkj->lik", vectors, np.clip(values, 0.0, None), vectors
    )
    return clipped


def whitening(model: GaussianFit) -> Float64Array:
    """``W_l = chol(cov_l)^-1`` (L, d, d): Mahalanobis distance = ``||W_l (x - mu_l)||``."""
    cholesky = np.linalg.cholesky(model.covariance)
    eye = np.broadcast_to(np.eye(model.mean.shape[1]), cholesky.shape)
    result: Float64Array = np.linalg.solve(cholesky, eye)
    return result


def mahalanobis(model: GaussianFit, features: Float64Array) -> Float64Array:
    """Distance map ``(n, L)`` of ``features`` ``(n, L, d)`` in float64 (the reference)."""
    white = whitening(model)
    z = np.einsum("lde,nle->nld", white, features - model.mean[None])
    result: Float64Array = np.sqrt(np.sum(z * z, axis=2))
    return result


FLEET_KEY = "anomaly-fleet"
"""The record of a threshold request holding the fleet's pooled moments and count."""
COUNT_KEY = "anomaly-count"
TOTAL_KEY = "anomaly-total"
OUTER_KEY = "anomaly-outer"
GRID_KEY = "anomaly-grid"
MEAN_KEY = "anomaly-mean"
COVARIANCE_KEY = "anomaly-covariance"


def statistics_to_arrays(stats: SufficientStatistics) -> dict[str, Float64Array]:
    """Plain float64 arrays for a message (a Flower ArrayRecord, an npz file)."""
    return {
        COUNT_KEY: np.array([stats.count], dtype=np.float64),
        TOTAL_KEY: stats.total,
        OUTER_KEY: stats.outer,
        GRID_KEY: np.array(stats.grid, dtype=np.float64),
    }


def statistics_from_arrays(arrays: Mapping[str, npt.NDArray[np.generic]]) -> SufficientStatistics:
    """:func:`statistics_to_arrays` undone; arrays of another shape are an error."""
    count, grid = _header(arrays, (COUNT_KEY, TOTAL_KEY, OUTER_KEY, GRID_KEY))
    return SufficientStatistics(
        count=count,
        total=np.asarray(arrays[TOTAL_KEY], dtype=np.float64),
        outer=np.asarray(arrays[OUTER_KEY], dtype=np.float64),
        grid=grid,
    )


FIRST_MOMENT_KEY = "anomaly-first-moment"
SECOND_MOMENT_KEY = "anomaly-second-moment"


def statistics_to_moments(stats: SufficientStatistics) -> dict[str, Float64Array]:
    """Per-part moments ``total / count`` and ``outer / count`` (and the grid).

    What a fleet job's station sends with ``count`` as its weight: FedAvg's weighted mean
    of the moments is then the pooled moments, so the fleet's statistics are exactly the
    sums (:func:`statistics_from_moments`), up to float64 rounding.
    """
    if stats.count < 1:
        raise StatisticsError(f"moments of {stats.count} parts are undefined; need at least 1")
    return {
        FIRST_MOMENT_KEY: stats.total / stats.count,
        SECOND_MOMENT_KEY: stats.outer / stats.count,
        GRID_KEY: np.array(stats.grid, dtype=np.float64),
    }


def statistics_from_moments(
    arrays: Mapping[str, npt.NDArray[np.generic]], count: int
) -> SufficientStatistics:
    """The sums back from pooled moments of ``count`` parts (:func:`statistics_to_moments`)."""
    missing = sorted({FIRST_MOMENT_KEY, SECOND_MOMENT_KEY, GRID_KEY} - set(arrays))
    if missing:
        raise StatisticsError(f"anomaly moments lack {missing} (got {sorted(arrays)})")
    if count < 1:
        raise StatisticsError(f"cannot rebuild statistics of {count} parts; need at least 1")
    grid = np.asarray(arrays[GRID_KEY], dtype=np.float64)
    if grid.shape != (2,):
        raise StatisticsError(f"bad anomaly moments: grid {grid.shape}")
    return SufficientStatistics(
        count=count,
        total=np.asarray(arrays[FIRST_MOMENT_KEY], dtype=np.float64) * count,
        outer=np.asarray(arrays[SECOND_MOMENT_KEY], dtype=np.float64) * count,
        grid=(round(float(grid[0])), round(float(grid[1]))),
    )


def zero_moments(grid: tuple[int, int], dims: int) -> dict[str, Float64Array]:
    """Moments of the right shapes, all zero: what a fleet job sends before any station
    answered (the shapes every reply must have)."""
    locations = grid[0] * grid[1]
    return {
        FIRST_MOMENT_KEY: np.zeros((locations, dims)),
        SECOND_MOMENT_KEY: np.zeros((locations, dims, dims)),
        GRID_KEY: np.array(grid, dtype=np.float64),
    }


def fit_to_arrays(model: GaussianFit) -> dict[str, Float64Array]:
    """The fitted model as plain float64 arrays (what a station needs to score)."""
    return {
        COUNT_KEY: np.array([model.count], dtype=np.float64),
        MEAN_KEY: model.mean,
        COVARIANCE_KEY: model.covariance,
        GRID_KEY: np.array(model.grid, dtype=np.float64),
    }


def fit_from_arrays(arrays: Mapping[str, npt.NDArray[np.generic]]) -> GaussianFit:
    """:func:`fit_to_arrays` undone."""
    count, grid = _header(arrays, (COUNT_KEY, MEAN_KEY, COVARIANCE_KEY, GRID_KEY))
    mean = np.asarray(arrays[MEAN_KEY], dtype=np.float64)
    covariance = np.asarray(arrays[COVARIANCE_KEY], dtype=np.float64)
    if mean.ndim != 2 or covariance.shape != (mean.shape[0], mean.shape[1], mean.shape[1]):
        raise StatisticsError(f"bad model arrays: mean {mean.shape}, covariance {covariance.shape}")
    return GaussianFit(count=count, mean=mean, covariance=covariance, grid=grid)


def _header(
    arrays: Mapping[str, npt.NDArray[np.generic]], keys: tuple[str, ...]
) -> tuple[int, tuple[int, int]]:
    missing = sorted(set(keys) - set(arrays))
    if missing:
        raise StatisticsError(f"anomaly arrays lack {missing} (got {sorted(arrays)})")
    count = np.asarray(arrays[COUNT_KEY], dtype=np.float64)
    grid = np.asarray(arrays[GRID_KEY], dtype=np.float64)
    if count.shape != (1,) or grid.shape != (2,):
        raise StatisticsError(f"bad anomaly arrays: count {count.shape}, grid {grid.shape}")
    return round(float(count[0])), (round(float(grid[0])), round(float(grid[1])))
