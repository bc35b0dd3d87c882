"""One round of DP-SGD for any party, with its budget checked and recorded where the data is.

The order is what makes the budget hold (Abadi et al. 2016 account per step; we account
per round, which is the same composition):

1. plan the round: the noise for the job's target epsilon over the planned participation
   (:func:`fedge.privacy.accounting.plan_round`), or the job's fixed noise;
2. reserve the planned release in the party's ledger, checked and recorded in one
   transaction (two trainings on one ledger cannot both pass a check only one fits): a
   round that would take the job's or the party's lifetime epsilon past its bound is
   refused *before* training (:class:`BudgetExhaustedError`, which Flower turns into an
   error reply);
3. train with DP-SGD (:func:`fedge.party.dp_sgd.train_private`: clipped by book-keeping
   or Opacus' hooks, the noise Opacus' optimizer adds; accounted by Opacus' accountant);
4. settle the reservation to the release training made (the steps actually taken: a time
   cap may stop it early; an unchanged release is not written again), or cancel it if
   training failed (an error reply releases nothing). Every training is its own
   ``(job, round, attempt)``: a round trained again after a crash is a second release,
   counted as such; a party killed mid-training keeps its planned release counted.

Used by the simulated party (:mod:`fedge.sim.party_app`) and the station's ClientApp.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from torch import nn

from fedge.party import budget, dp_sgd
from fedge.privacy import accounting
from fedge.privacy.floor import PrivacyFloor
from fedge.privacy.settings import DpRelease, PrivacyError, PrivacyMode, PrivacySpec


@dataclass(frozen=True)
class PrivateRound:
    """What the round cost and what the party reports about it."""

    loss: float
    seconds: float
    release: DpRelease
    epsilon_round: float  # this round alone
    epsilon_job: float  # every round of this job on this party
    epsilon_total: float  # every job on this party (its lifetime spend, at the lifetime delta)

    def metrics(self) -> dict[str, int | float]:
        return {
            "dp-epsilon-round": self.epsilon_round,
            "dp-epsilon-job": self.epsilon_job,
            "dp-epsilon-total": self.epsilon_total,
            "dp-noise-multiplier": self.release.noise_multiplier,
            "dp-sample-rate": self.release.sample_rate,
            "dp-steps": self.release.steps,
        }


def train_round(
    model: nn.Module,
    x: npt.NDArray[np.float32],
    y: npt.NDArray[np.int64],
    *,
    spec: PrivacySpec,
    ledger_path: Path,
    job: str,
    server_round: int,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    optimizer: str = "sgd",
    max_seconds: float | None = None,
    threads: int | None = None,
    floor: PrivacyFloor | None = None,
) -> PrivateRound:
    """Plan, check, train and record one DP-SGD round (see the module docstring).

    ``floor``: the station's privacy floor; a plan whose noise is below its minimum is
    refused (:class:`PrivacyFloorError`) before anything is reserved or trained."""
    if spec.mode is not PrivacyMode.LOCAL:
        raise PrivacyError(f"train_round is DP-SGD (mode 'local'), got mode {spec.mode.value!r}")
    if not job:
        raise PrivacyError("a DP-SGD round needs the job's id (config['job-id']) to account it")
    planned = spec.rounds_per_party or 1
    release = accounting.plan_round(
        spec, examples=len(y), batch_size=batch_size, epochs=epochs, planned_rounds=planned
    )
    reservation = budget.reserve_release(
        ledger_path, release, spec=spec, floor=floor, job=job, server_round=server_round
    )
    try:
        trained = dp_sgd.train_private(
            model,
            x,
            y,
            epochs=epochs,
            lr=lr,
            batch_size=batch_size,
            noise_multiplier=release.noise_multiplier,
            clipping_norm=spec.clipping_norm,
            seed=seed,
            optimizer=optimizer,
            max_seconds=max_seconds,
            threads=threads,
        )
    except BaseException:
        reservation.cancel()  # an error reply: no update left
        raise
    if trained.release != release:  # a time cap stopped it early: fewer steps
        reservation.settle(trained.release)
    epsilon_job, epsilon_total = reservation.spent()
    return PrivateRound(
        loss=trained.loss,
        seconds=trained.seconds,
        release=trained.release,
        epsilon_round=accounting.epsilon_spent([trained.release], spec.delta, spec.accountant),
        epsilon_job=epsilon_job,
        epsilon_total=epsilon_total,
    )
