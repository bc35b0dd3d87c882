"""A station's anomaly statistics under its privacy floor and ledger (issue 28).

The same rules as a classifier round (:mod:`fedge.party.private_round`,
:func:`fedge.party.station_app.train_round`), for one Gaussian release instead of DP-SGD:

1. :func:`check_round`: the round's ``dp-*`` settings against the station's floor
   (:func:`~fedge.privacy.floor.round_refusal`): a round without DP at a station with a
   floor, a fixed noise below the floor's minimum or a job epsilon above its bound is
   refused before any feature is computed; a round without DP at a station whose manager
   set a lifetime budget is refused too. The job's settings become the station's own
   (:func:`~fedge.privacy.floor.effective_spec`: the floor's epsilon and smaller delta).
2. :func:`plan_release`: the release is one Gaussian mechanism on the station's whole
   data, ``DpRelease(sigma, sample_rate=1, steps=1)``; ``sigma`` is the job's fixed noise
   multiplier, or the smallest one whose single release stays within the job's epsilon
   (the same search DP-SGD's plan uses, Mironov's RDP, CSF 2017). A planned noise below
   the floor's minimum is refused (:func:`~fedge.privacy.floor.plan_refusal`, in
   :func:`fedge.party.budget.reserve_release`, the check a classifier round makes too).
3. :func:`release_statistics`: the release is reserved in the ledger -- checked against
   the job's and the station's lifetime bound and recorded in one transaction, so two
   jobs cannot both pass a check only one fits (:class:`BudgetExhaustedError` otherwise,
   an error reply) -- then the noise is drawn from a secret seed
   (:func:`fedge.models.anomaly.private.noisy_statistics`). A failure between the two
   cancels the reservation: nothing left the station.

What leaves the station under DP is the noisy release: its moments and its noisy count
(``num-examples``) and the epsilon it spent. Counts of unreadable images are left out (a
number about the station's images that no ledger accounts).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedge.models.anomaly.private import noisy_statistics
from fedge.models.anomaly.statistics import SufficientStatistics
from fedge.party import budget
from fedge.privacy import accounting
from fedge.privacy.floor import (
    PrivacyFloor,
    PrivacyFloorError,
    effective_spec,
    round_refusal,
)
from fedge.privacy.settings import (
    BudgetExhaustedError,
    DpRelease,
    PrivacyError,
    PrivacyMode,
    PrivacySpec,
)


@dataclass(frozen=True, eq=False)
class Released:
    """The statistics as they leave the station, and what the release cost."""

    stats: SufficientStatistics
    release: DpRelease
    epsilon_job: float
    epsilon_total: float

    def metrics(self, delta: float) -> dict[str, int | float]:
        return {
            "num-examples": self.stats.count,  # the noisy count: part of the release
            "dp-epsilon-job": self.epsilon_job,
            "dp-epsilon-total": self.epsilon_total,
            "dp-noise-multiplier": self.release.noise_multiplier,
            "dp-delta": delta,
        }


def check_round(
    edge: str, asked: PrivacySpec, floor: PrivacyFloor | None, manager_bound: float | None
) -> PrivacySpec:
    """The round's privacy as this station will honour it, or a refusal (module docstring).

    ``manager_bound``: the lifetime epsilon the manager set in the ledger (None: none)."""
    refusal = round_refusal(floor, asked)
    if refusal is not None:
        raise PrivacyFloorError(f"station {edge} refuses: {refusal}")
    if asked.mode is PrivacyMode.CENTRAL:
        raise PrivacyError(
            f"station {edge}: central DP would show the server this station's raw "
            'statistics; an anomaly job\'s DP is mode = "local"'
        )
    if asked.mode is not PrivacyMode.LOCAL and manager_bound is not None:
        raise BudgetExhaustedError(
            f"station {edge} has a lifetime privacy budget (epsilon {manager_bound:g}) and "
            'releases its statistics only with DP; run the job with [privacy] mode = "local", '
            f"or clear the station's budget (`fedge edge set-privacy {edge} --clear`)"
        )
    return effective_spec(floor, asked)


def plan_release(privacy: PrivacySpec) -> DpRelease:
    """One Gaussian mechanism on the station's whole data (sample rate 1, one step); the
    floor's minimum noise is checked when it is reserved (:func:`budget.reserve_release`)."""
    return accounting.plan_round(privacy, examples=1, batch_size=1, epochs=1, planned_rounds=1)


def release_statistics(
    stats: SufficientStatistics,
    *,
    privacy: PrivacySpec,
    floor: PrivacyFloor | None,
    clip: float,
    ledger_path: Path,
    job: str,
    server_round: int,
    rng: np.random.Generator | None = None,
) -> Released:
    """``stats`` (of features clipped to ``clip``) released with the Gaussian mechanism,
    the release recorded in the station's ledger first (module docstring).

    ``rng`` is for tests; a station draws its noise from a secret seed (noise from a seed
    the server knew could be subtracted)."""
    if privacy.mode is not PrivacyMode.LOCAL:
        raise PrivacyError(f"a DP release needs dp-mode 'local', got {privacy.mode.value!r}")
    if not job:
        raise PrivacyError("a DP release needs the job's id (config['job-id']) to account it")
    release = plan_release(privacy)
    reservation = budget.reserve_release(
        ledger_path, release, spec=privacy, floor=floor, job=job, server_round=server_round
    )
    try:
        noisy = noisy_statistics(
            stats,
            clip=clip,
            noise_multiplier=release.noise_multiplier,
            rng=rng if rng is not None else np.random.default_rng(secrets.randbits(128)),
        )
    except BaseException:
        reservation.cancel()  # nothing left the station
        raise
    epsilon_job, epsilon_total = reservation.spent()
    return Released(
        stats=noisy, release=release, epsilon_job=epsilon_job, epsilon_total=epsilon_total
    )
