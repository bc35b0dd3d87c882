"""Atomic per-round checkpoints of a job: the model, the strategy, and what else resumes it.

One checkpoint is one file, ``<job_dir>/checkpoints/round-000042.npz`` (``np.savez``):

=======================  ==============================================================
``<key>``                the global model after the round: the ArrayRecord's arrays
                         under their own keys (``0.weight``, ...), dtypes preserved
``__late__.<i>.<key>``   late replies held for staleness folding (``late_policy =
                         "stale"``): they are folded into the NEXT round, so a resumed
                         job needs them to continue identically
``__extra__.<n>.<key>``  models the strategy keeps besides the global one
                         (``StreamingFedAvg.extra_arrays``: FedDF's one model per
                         architecture)
``__opt__.<m|v>.<key>``  the server optimizer's moments (FedAdam/FedYogi/FedAdagrad/
                         FedAvgM, ``StreamingFedAvg.server_opt_arrays``), so a resumed
                         job steps exactly as an uninterrupted one would
``__checkpoint__``       UTF-8 JSON (as uint8): format, round, key order, the strategy's
                         ``state_dict()`` (numpy RNG state, latency profiles, tiers, tier
                         selection, virtual clock), each late reply's weight, origin
                         round and fold group, the extra models' names, and the
                         caller's sim-side state (seed, scenario hash...)
=======================  ==============================================================

It is written to a temporary file in the same directory, flushed and fsync'd, then
``os.replace``d onto its name and the directory fsync'd: a process killed at any instant
(SIGKILL, power loss after the fsync) leaves either the previous checkpoint set or the new
one, never a half-written file. :func:`latest_checkpoint` skips temporary files and any
file that does not load.

Not covered: a wall-clock strategy's in-flight messages (replies a dead process was still
waiting for belong to its grid); a resumed job simply asks again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
from flwr.app import ArrayRecord

from fedge.aggregator.errors import AggregatorError
from fedge.aggregator.jobs.directory import halt_requested
from fedge.aggregator.rounds.replies import arrays_of, to_array_record
from fedge.aggregator.strategies.streaming import StreamingFedAvg

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
FORMAT = 1
META_KEY = "__checkpoint__"
LATE_PREFIX = "__late__."
EXTRA_PREFIX = "__extra__."
OPT_PREFIX = "__opt__."
_RESERVED = ("file", "allow_pickle")  # np.savez's own keyword arguments
_NAME = re.compile(r"^round-(\d{6,})\.npz$")

Arrays = dict[str, npt.NDArray[Any]]


class CheckpointError(AggregatorError):
    """A checkpoint cannot be written, read, or applied."""


@dataclass(frozen=True)
class LateReply:
    """A reply that missed its round, held to be folded into a later one."""

    arrays: Arrays = field(repr=False)
    weight: float
    origin_round: int
    group: str = ""


@dataclass(frozen=True)
class Checkpoint:
    """Everything a job needs to continue after ``round``."""

    round: int
    path: Path
    arrays: Arrays = field(repr=False)
    strategy_state: dict[str, Any] = field(repr=False)
    late: tuple[LateReply, ...] = ()
    extra: dict[str, Arrays] = field(default_factory=dict, repr=False)
    sim: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    server_opt: dict[str, Arrays] = field(default_factory=dict, repr=False)
    """The server optimizer's moments (``m``, ``v``); empty without one."""

    def array_record(self) -> ArrayRecord:
        """The model as the strategy takes it (keys in their original order)."""
        return to_array_record(self.arrays)


# ---------------------------------------------------------------- atomic files


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` all-or-nothing: temp file, fsync, ``os.replace``, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o644)  # mkstemp's 0600 is for secrets, not job files
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_arrays(path: Path, arrays: Mapping[str, npt.NDArray[Any]]) -> None:
    """Atomically write ``arrays`` as an ``.npz`` under their own keys."""
    _check_keys(arrays)
    atomic_write(path, lambda handle: _savez(handle, arrays))


def load_arrays(path: Path) -> Arrays:
    """The arrays of an ``.npz`` written by :func:`save_arrays`, in file order."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"cannot read arrays from {path}: {exc}") from exc


# ---------------------------------------------------------------- checkpoints


def checkpoint_dir(job_dir: Path) -> Path:
    return Path(job_dir) / CHECKPOINT_DIR


def checkpoint_path(job_dir: Path, server_round: int) -> Path:
    return checkpoint_dir(job_dir) / f"round-{server_round:06d}.npz"


def checkpoint_rounds(job_dir: Path) -> list[int]:
    """Rounds with a checkpoint file in ``job_dir``, oldest first (temp files excluded)."""
    directory = checkpoint_dir(job_dir)
    if not directory.is_dir():
        return []
    rounds = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match:
            rounds.append(int(match.group(1)))
    return sorted(rounds)


def save_checkpoint(
    job_dir: Path,
    server_round: int,
    arrays: ArrayRecord,
    strategy: StreamingFedAvg,
    *,
    sim: Mapping[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Atomically checkpoint the state after ``server_round``; keep the newest ``keep``."""
    if server_round < 0:
        raise CheckpointError(f"server_round must be >= 0, got {server_round}")
    model = arrays_of(arrays)
    _check_keys(model)
    late = [
        LateReply(arrays, weight, origin, group)
        for arrays, weight, origin, group in strategy.late_replies()  # models: beside the JSON
    ]
    extra = strategy.extra_arrays()
    moments = strategy.server_opt_arrays()
    meta: dict[str, Any] = {
        "format": FORMAT,
        "round": server_round,
        "created_at": time.time(),
        "model_keys": list(model),
        "strategy": strategy.state_dict(),
        "late": [
            {
                "weight": entry.weight,
                "origin_round": entry.origin_round,
                "group": entry.group,
                "keys": list(entry.arrays),
            }
            for entry in late
        ],
        "extra": [{"name": name, "keys": list(kept)} for name, kept in extra.items()],
        "server_opt": {name: list(kept) for name, kept in moments.items()},
        "sim": dict(sim or {}),
    }
    try:
        meta_bytes = json.dumps(meta, default=_json_default, allow_nan=True).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"strategy state of round {server_round} is not JSON: {exc}") from exc
    entries: dict[str, npt.NDArray[Any]] = dict(model)
    for index, entry in enumerate(late):
        for key, value in entry.arrays.items():
            entries[f"{LATE_PREFIX}{index}.{key}"] = value
    for index, kept in enumerate(extra.values()):
        for key, value in kept.items():
            entries[f"{EXTRA_PREFIX}{index}.{key}"] = value
    for name, kept in moments.items():
        for key, value in kept.items():
            entries[f"{OPT_PREFIX}{name}.{key}"] = value
    entries[META_KEY] = np.frombuffer(meta_bytes, dtype=np.uint8)
    path = checkpoint_path(job_dir, server_round)
    atomic_write(path, lambda handle: _savez(handle, entries))
    _prune(job_dir, keep)
    return path


def checkpoint_round(
    job_dir: Path,
    server_round: int,
    arrays: ArrayRecord,
    strategy: StreamingFedAvg,
    *,
    total: int,
    every: int,
    keep: int,
    sim: Mapping[str, Any],
) -> bool:
    """A job's end-of-round step: checkpoint when due (every N rounds, the last one, or
    on a halt request); returns whether the job must halt now (a request, not the end)."""
    halt = halt_requested(job_dir)
    if halt or server_round == total or server_round % every == 0:
        save_checkpoint(job_dir, server_round, arrays, strategy, sim=sim, keep=keep)
    return halt and server_round < total


def load_checkpoint(path: Path) -> Checkpoint:
    """Read one checkpoint file; raises :class:`CheckpointError` if it is unusable."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            if META_KEY not in npz.files:
                raise CheckpointError(f"{path} is not a fedge checkpoint (no {META_KEY})")
            meta = json.loads(npz[META_KEY].tobytes().decode("utf-8"))
            if meta.get("format") != FORMAT:
                raise CheckpointError(
                    f"{path} has checkpoint format {meta.get('format')!r}, expected {FORMAT}"
                )
            model = {key: npz[key] for key in meta["model_keys"]}
            late = tuple(
                LateReply(
                    arrays={key: npz[f"{LATE_PREFIX}{index}.{key}"] for key in entry["keys"]},
                    weight=float(entry["weight"]),
                    origin_round=int(entry["origin_round"]),
                    group=str(entry.get("group", "")),
                )
                for index, entry in enumerate(meta["late"])
            )
            extra = {
                str(entry["name"]): {
                    key: npz[f"{EXTRA_PREFIX}{index}.{key}"] for key in entry["keys"]
                }
                for index, entry in enumerate(meta.get("extra", []))
            }
            moments = {
                str(name): {key: npz[f"{OPT_PREFIX}{name}.{key}"] for key in keys}
                for name, keys in meta.get("server_opt", {}).items()
            }
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    return Checkpoint(
        round=int(meta["round"]),
        path=path,
        arrays=model,
        strategy_state=meta["strategy"],
        late=late,
        extra=extra,
        sim=dict(meta.get("sim", {})),
        created_at=float(meta.get("created_at", 0.0)),
        server_opt=moments,
    )


def latest_checkpoint(job_dir: Path) -> Checkpoint | None:
    """The newest checkpoint of ``job_dir`` that loads (None when there is none)."""
    for server_round in reversed(checkpoint_rounds(job_dir)):
        path = checkpoint_path(job_dir, server_round)
        try:
            return load_checkpoint(path)
        except CheckpointError as exc:
            log.warning("skipping unreadable checkpoint: %s", exc)
    return None


def restore_strategy(strategy: StreamingFedAvg, checkpoint: Checkpoint) -> None:
    """Put ``strategy`` back in the state it was in when ``checkpoint`` was written."""
    try:
        # The extra models are checked in full before anything is applied.
        strategy.restore_extra_arrays(checkpoint.extra)
        strategy.load_state_dict(checkpoint.strategy_state)
        strategy.restore_server_opt_arrays(checkpoint.server_opt)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} does not fit a {type(strategy).__name__}: {exc}"
        ) from exc
    strategy.restore_late_replies(
        (entry.arrays, entry.weight, entry.origin_round, entry.group) for entry in checkpoint.late
    )


# ---------------------------------------------------------------- helpers


def _prune(job_dir: Path, keep: int | None) -> None:
    directory = checkpoint_dir(job_dir)
    for entry in directory.glob(".round-*.tmp"):  # left by a killed writer (jobs are locked)
        with contextlib.suppress(OSError):
            entry.unlink()
    if keep is None:
        return
    if keep < 1:
        raise CheckpointError(f"keep must be >= 1, got {keep}")
    for server_round in checkpoint_rounds(job_dir)[:-keep]:
        with contextlib.suppress(FileNotFoundError):
            checkpoint_path(job_dir, server_round).unlink()
    fsync_dir(directory)


def _savez(handle: IO[bytes], arrays: Mapping[str, npt.NDArray[Any]]) -> None:
    # Keys are checked by _check_keys: none collides with savez's own parameters.
    np.savez(handle, allow_pickle=False, **arrays)


def _check_keys(arrays: Mapping[str, object]) -> None:
    for key in arrays:
        if key in _RESERVED or key.startswith("__"):
            raise CheckpointError(f"array key {key!r} is reserved in checkpoint files")


def _json_default(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
