"""What every job manifest has, whatever runs it: ``[job]``, ``[checkpoint]``, the error.

Simulated jobs (:mod:`fedge.sim.job_manifest`) and fleet jobs
(:mod:`fedge.aggregator.fleet.manifest`) both read these tables the same way.
"""

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from fedge.aggregator.errors import AggregatorError

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ManifestError(AggregatorError):
    """A job manifest is missing, malformed, or holds a bad value (the field is named)."""


@dataclass(frozen=True)
class JobSpec:
    """``[job]``: what the job is called, how long it trains, and its seed."""

    name: str
    rounds: int
    seed: int


@dataclass(frozen=True)
class CheckpointSpec:
    """``[checkpoint]``: how often the job checkpoints, and how many it keeps."""

    every: int = 1
    keep: int = 3


# The strategies that draw one tier per round (TiFL) and their defaults (aggregator.tiered).
TIERED_KINDS = ("tiered", "distill", "nested")
_DEFAULT_TIERS = 5
_DEFAULT_PROFILING_ROUNDS = 1


def check_tier_credits(
    rounds: int, kind: str, params: Mapping[str, object], parties: int | None = None
) -> None:
    """Refuse a job whose rounds its tiers' credits cannot pay for (issue 15).

    TiFL (Chai et al., HPDC'20, Algorithm 2) gives each tier ``credits`` and spends one
    each time the tier is selected; every round after profiling selects one tier, so a run
    of ``rounds`` needs ``rounds - profiling_rounds`` credits in all. Without this check
    a job ran until the credits ran out (round 500 of 1000) and only then failed.
    ``parties``, when known, caps the tiers that can form (one party per tier at least).
    Params are those the strategy was already built with, so their types are checked.
    """
    credits = params.get("credits_per_tier")
    if kind not in TIERED_KINDS or credits is None:
        return  # unlimited credits
    profiling = int(str(params.get("profiling_rounds", _DEFAULT_PROFILING_ROUNDS)))
    n_tiers = int(str(params.get("tiers", _DEFAULT_TIERS)))
    if parties is not None:
        n_tiers = max(1, min(n_tiers, parties))
    selections = max(0, rounds - profiling)
    if isinstance(credits, list):
        total = sum(int(c) for c in credits)
        per_tier = f"[{', '.join(str(c) for c in credits)}]"
        fix = f"raise strategy.params.credits_per_tier to add {selections - total} in all"
    else:
        total = int(str(credits)) * n_tiers
        per_tier = f"{credits} per tier x {n_tiers} tiers"
        fix = f"raise strategy.params.credits_per_tier to {math.ceil(selections / n_tiers)} or more"
    if selections <= total:
        return
    raise ManifestError(
        f"job.rounds = {rounds} needs {selections} tier selections (after {profiling} "
        f"profiling round(s)), but strategy.params.credits_per_tier ({per_tier}) allows "
        f"{total}; {fix}, or lower job.rounds to {total + profiling}. A job already "
        "started continues with a corrected manifest: "
        "`fedge aggregator resume --dir DIR --manifest NEW.toml`"
    )


def take_privacy(document: dict[str, object], params: dict[str, object]) -> None:
    """Move a manifest's ``[privacy]`` (DP-SGD, central DP, SecAgg+) into the strategy's
    parameters, which the strategy factory validates; given twice is an error."""
    privacy = document.get("privacy")
    if privacy is None:
        return
    if not isinstance(privacy, dict):
        raise ManifestError(f"privacy must be a table, got {privacy!r}")
    if "privacy" in params:
        raise ManifestError(
            "give the privacy settings once: [privacy] or [strategy.params.privacy]"
        )
    params["privacy"] = privacy
