"""A sweep spec: which of a strategy's settings to search, over what ranges, and what the
best setting becomes (issue 31 item 5; Katib's Experiment, on the simulated fleet)::

    [sweep]
    name = "tiered-lr"        # names the trials' jobs (letters, digits, '.', '_', '-')
    trials = 8                # >= 1
    parallel = 1              # simulation slots the sweep's queue places trials on
    team = "sweeps"           # the team the trials are queued for (BE jobs)
    seed = 0                  # the sampler's seed (Optuna's TPE)

    [base]
    manifest = "../examples/jobs/tiered-digits.toml"  # a simulated job (inprocess)
    rounds = 5                # optional: override the manifest's rounds for every trial

    [space]                   # [low, high] (ints: an int range); {low, high, log = true};
    lr = { low = 0.01, high = 0.5, log = true }      # or {choices = [...]}
    local_epochs = [1, 3]
    tiers = [2, 5]
    deadline_factor = [1.5, 4.0]
    noise_multiplier = [0.5, 1.5]                    # DP sigma (the base needs [privacy])

    [fleet_job]               # the best setting, written as a fleet job manifest
    name = "retrain"
    model = "inspect:1"
    fleet = "plant-a"
    edges = "all"
    rounds = 4                # default: the base's

Every problem raises :class:`SweepError` naming the field, before anything is queued or
written. Pure: reads one TOML text, builds frozen values.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from fedge.sim.errors import SimError

# What a sweep may search, and where each setting goes in a simulated job manifest.
# lr and local_epochs are the strategy's local step (aggregator.strategies.factory);
# deadline_factor its deadline; tiers TiFL's tier count; noise_multiplier DP-SGD's sigma.
PARAMS = ("lr", "local_epochs", "tiers", "deadline_factor", "noise_multiplier")
_INT_PARAMS = frozenset({"local_epochs", "tiers"})
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,47}$")


class SweepError(SimError):
    """A sweep spec is malformed; nothing was queued or written."""


@dataclass(frozen=True)
class Range:
    """A numeric range (``low < high``; ints when the parameter is whole-numbered)."""

    low: float
    high: float
    integer: bool
    log: bool = False


@dataclass(frozen=True)
class Choices:
    values: tuple[float, ...]


Space = Range | Choices


@dataclass(frozen=True)
class FleetTarget:
    """Where the best setting is meant to run: a fleet job's model, fleet and stations."""

    name: str
    model: str
    fleet: str
    edges: str = "all"
    rounds: int | None = None


@dataclass(frozen=True)
class SweepSpec:
    name: str
    trials: int
    parallel: int
    team: str
    seed: int
    base_manifest: Path
    base_rounds: int | None
    space: dict[str, Space]
    fleet: FleetTarget


def parse_sweep(text: str, *, base_dir: Path, source: str = "sweep spec") -> SweepSpec:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SweepError(f"{source} is not TOML: {exc}") from None
    sweep = _table(doc, "sweep")
    base = _table(doc, "base")
    name = str(sweep.get("name", ""))
    if not _NAME.fullmatch(name):
        raise SweepError(f"sweep.name: {name!r} is not a name (letters, digits, '.', '_', '-')")
    trials = _int(sweep, "sweep.trials", sweep.get("trials", 8), minimum=1)
    parallel = _int(sweep, "sweep.parallel", sweep.get("parallel", 1), minimum=1)
    seed = _int(sweep, "sweep.seed", sweep.get("seed", 0), minimum=0)
    team = str(sweep.get("team", "sweeps"))
    if not team.strip():
        raise SweepError("sweep.team: give the team the trials are queued for")
    manifest = base.get("manifest")
    if not isinstance(manifest, str) or not manifest:
        raise SweepError("base.manifest: give the simulated job manifest the trials start from")
    rounds = base.get("rounds")
    base_rounds = None if rounds is None else _int(base, "base.rounds", rounds, minimum=1)
    space_table = _table(doc, "space")
    if not space_table:
        raise SweepError(f"space: name at least one setting to search ({', '.join(PARAMS)})")
    space = {key: _space(key, value) for key, value in space_table.items()}
    if "fleet_job" not in doc:
        raise SweepError("fleet_job: give name, model and fleet (the fleet job the best runs as)")
    fleet = _fleet(doc["fleet_job"])
    return SweepSpec(
        name,
        trials,
        parallel,
        team,
        seed,
        (base_dir / manifest).resolve(),
        base_rounds,
        space,
        fleet,
    )


def load_sweep(path: Path) -> SweepSpec:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SweepError(f"cannot read sweep spec {path}: {exc.strerror}") from None
    return parse_sweep(text, base_dir=path.parent, source=str(path))


def _table(doc: dict[str, object], key: str) -> dict[str, object]:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise SweepError(f"{key} must be a table, got {value!r}")
    return value


def _int(table: dict[str, object], field: str, value: object, *, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SweepError(f"{field}: expected a whole number >= {minimum}, got {value!r}")
    return value


def _number(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SweepError(f"{field}: expected a number, got {value!r}")
    return float(value)


def _space(key: str, value: object) -> Space:
    field = f"space.{key}"
    if key not in PARAMS:
        raise SweepError(f"{field}: not a searchable setting (known: {', '.join(PARAMS)})")
    integer = key in _INT_PARAMS
    log = False
    if isinstance(value, dict) and "choices" in value:
        raw = value["choices"]
        if not isinstance(raw, list) or not raw:
            raise SweepError(f"{field}.choices is empty: give at least one value")
        values = tuple(_number(f"{field}.choices", v) for v in raw)
        if integer and any(v != int(v) for v in values):
            raise SweepError(f"{field}.choices: {key} takes whole numbers")
        return Choices(tuple(int(v) for v in values) if integer else values)
    if isinstance(value, dict):
        log = bool(value.get("log", False))
        bounds: object = [value.get("low"), value.get("high")]
    else:
        bounds = value
    if not isinstance(bounds, list) or len(bounds) != 2:
        raise SweepError(f"{field}: give [low, high], {{low, high, log}} or {{choices = [...]}}")
    low, high = (_number(field, b) for b in bounds)
    if not low < high:
        raise SweepError(
            f"{field}: the range [{low:g}, {high:g}] is empty; give low < high "
            "(or {choices = [value]} for one value)"
        )
    if integer and (low != int(low) or high != int(high)):
        raise SweepError(f"{field}: {key} takes whole numbers, got [{low:g}, {high:g}]")
    if log and low <= 0:
        raise SweepError(f"{field}: a log range needs low > 0, got {low:g}")
    if key in ("lr", "deadline_factor", "noise_multiplier") and low <= 0:
        raise SweepError(f"{field}: {key} must be > 0, got a range from {low:g}")
    if key in _INT_PARAMS and low < 1:
        raise SweepError(f"{field}: {key} must be >= 1, got a range from {low:g}")
    return Range(low, high, integer, log)


def _fleet(value: object) -> FleetTarget:
    if not isinstance(value, dict):
        raise SweepError(f"fleet_job must be a table, got {value!r}")
    missing = [k for k in ("name", "model", "fleet") if not isinstance(value.get(k), str)]
    if missing:
        raise SweepError(f"fleet_job: give {', '.join(missing)} (the fleet job the best runs as)")
    rounds = value.get("rounds")
    return FleetTarget(
        str(value["name"]),
        str(value["model"]),
        str(value["fleet"]),
        str(value.get("edges", "all")),
        None if rounds is None else _int(value, "fleet_job.rounds", rounds, minimum=1),
    )
