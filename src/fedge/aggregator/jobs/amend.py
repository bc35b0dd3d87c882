"""A stopped job continues with a corrected manifest (issue 15).

A job that failed because its tiers ran out of credits (or needs more rounds, or longer
timeouts) would fail the same way on every resume: the job directory's ``job.toml`` and
its newest checkpoint both carry the old values. ``fedge aggregator resume --dir D
--manifest NEW.toml`` amends both before the job continues:

* Only fields that do not change what has already been trained may differ
  (:data:`AMENDABLE`): the number of rounds, the tiers' credits, the checkpoint cadence
  and the fleet's timeouts. Any other difference (the model, the seed, the strategy, the
  data...) is refused with the field named -- that is a new job.
* The new manifest is validated in full by the caller's ``parse`` (the same loader a new
  job goes through: credits against rounds included).
* Credits are a budget the run spends (TiFL, Chai et al. HPDC'20): the checkpoint holds
  what is left per tier. Raising ``credits_per_tier`` from ``c`` to ``c'`` gives each tier
  ``c' - c`` more; lowering it below what was already spent is refused.

The previous manifest is kept beside the job as ``job.toml.N``. The caller holds no job
lock; this takes it, so a job that is running is refused (halt it first).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedge.aggregator.jobs.checkpoint import (
    META_KEY,
    atomic_write,
    atomic_write_text,
    latest_checkpoint,
)
from fedge.aggregator.jobs.directory import JOB_MANIFEST, job_lock
from fedge.aggregator.jobs.spec import ManifestError

AMENDABLE = frozenset(
    {
        "job.rounds",
        "strategy.params.credits_per_tier",
        "checkpoint.every",
        "checkpoint.keep",
        "federation.node_wait_s",
        "federation.round_timeout_s",
        "federation.eval_timeout_s",
    }
)
CREDITS = "strategy.params.credits_per_tier"
CREDITS_BASIS = "credits_basis"


@dataclass(frozen=True)
class Amended:
    """What changed: field -> (old, new) as TOML values (``None``: absent)."""

    changes: dict[str, tuple[object, object]]
    previous: Path | None  # the old manifest, kept (None: nothing changed)
    checkpoint_round: int | None  # the checkpoint whose state was amended


def amend_job(job_dir: Path, new_manifest: Path, parse: Callable[[str], object]) -> Amended:
    """Replace ``job_dir``'s manifest by ``new_manifest`` if only :data:`AMENDABLE`
    fields differ, and carry the changes into its newest checkpoint."""
    try:
        new_text = new_manifest.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"cannot read job manifest {new_manifest}: {exc}") from exc
    with job_lock(job_dir):
        old_text = (job_dir / JOB_MANIFEST).read_text(encoding="utf-8")
        changes = diff(_toml(old_text, job_dir / JOB_MANIFEST), _toml(new_text, new_manifest))
        refused = sorted(set(changes) - AMENDABLE)
        if refused:
            allowed = ", ".join(sorted(AMENDABLE))
            raise ManifestError(
                f"{new_manifest}: {', '.join(refused)} cannot change when a job resumes "
                f"(only {allowed} may); start a new job (`fedge aggregator run`) for that"
            )
        if not changes:
            return Amended({}, None, None)
        parse(new_text)
        checkpoint = latest_checkpoint(job_dir)
        rounds = changes.get("job.rounds", (None, None))[1]
        if checkpoint is not None and isinstance(rounds, int) and rounds < checkpoint.round:
            raise ManifestError(
                f"job.rounds = {rounds}, but the job has already run {checkpoint.round} "
                f"rounds; give at least {checkpoint.round}"
            )
        if checkpoint is not None:
            meta = _amended_meta(checkpoint.path, changes)
            if meta is not None:
                _rewrite_meta(checkpoint.path, meta)
        previous = _keep_previous(job_dir, old_text)
        atomic_write_text(job_dir / JOB_MANIFEST, new_text)
        return Amended(changes, previous, None if checkpoint is None else checkpoint.round)


def diff(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted field -> (old, new) for every value that differs (tables recursed into)."""
    changes: dict[str, tuple[object, object]] = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            changes |= diff(a, b, f"{name}.")
        elif a != b:
            changes[name] = (a, b)
    return changes


def regranted(remaining: list[int | None], old: object, new: object) -> list[int | None]:
    """Per-tier credits left once ``credits_per_tier`` goes from ``old`` to ``new``.

    Each tier gets the difference; ``None`` (unlimited) stays or becomes unlimited.
    """
    if new is None:
        return [None] * len(remaining)
    n = len(remaining)
    olds = _per_tier(old, n)
    news = _per_tier(new, n)
    left: list[int | None] = []
    for tier, (have, was, now) in enumerate(zip(remaining, olds, news, strict=True)):
        if have is None or was is None:
            raise ManifestError(
                f"{CREDITS}: tier {tier} had unlimited credits; a limit cannot be set on resume"
            )
        if now is None:
            left.append(None)
            continue
        spent = was - have
        if now < spent:
            raise ManifestError(
                f"{CREDITS}: tier {tier} has already been selected {spent} times; "
                f"give it at least {spent} credits, not {now}"
            )
        left.append(now - spent)
    return left


def _per_tier(value: object, n: int) -> list[int | None]:
    if value is None or isinstance(value, int):
        return [value] * n
    if isinstance(value, list) and len(value) == n and all(isinstance(v, int) for v in value):
        return list(value)
    raise ManifestError(f"{CREDITS}: expected one number or {n} (one per tier), got {value!r}")


def _amended_meta(path: Path, changes: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's metadata with the changes applied (None: nothing to change)."""
    with np.load(path, allow_pickle=False) as npz:
        meta: dict[str, Any] = json.loads(npz[META_KEY].tobytes().decode("utf-8"))
    touched = False
    sim = meta.get("sim", {})
    if "job.rounds" in changes and "rounds" in sim:
        sim["rounds"] = changes["job.rounds"][1]  # the sim job checks it on resume
        touched = True
    selection = (meta.get("strategy") or {}).get("selection")
    if CREDITS in changes and selection is not None:
        old, new = changes[CREDITS]
        # The checkpoint names the grant its remaining credits were counted against, so
        # an amend that rewrote the checkpoint but died before job.toml, run again, finds
        # them already regranted and changes nothing (no credits granted twice).
        basis = selection.get(CREDITS_BASIS, old)
        selection["credits"] = regranted(list(selection["credits"]), basis, new)
        selection[CREDITS_BASIS] = new
        touched = True
    return meta if touched else None


def _rewrite_meta(path: Path, meta: dict[str, Any]) -> None:
    with np.load(path, allow_pickle=False) as npz:
        entries = {key: npz[key] for key in npz.files}
    encoded = json.dumps(meta, allow_nan=True).encode("utf-8")
    entries[META_KEY] = np.frombuffer(encoded, dtype=np.uint8)
    atomic_write(path, lambda handle: np.savez(handle, allow_pickle=False, **entries))


def _keep_previous(job_dir: Path, text: str) -> Path:
    n = 1
    while (job_dir / f"{JOB_MANIFEST}.{n}").exists():
        n += 1
    kept = job_dir / f"{JOB_MANIFEST}.{n}"
    atomic_write_text(kept, text)
    return kept


def _toml(text: str, source: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"job manifest {source} is not valid TOML: {exc}") from exc
