"""Job manifests: one TOML file describes a whole federated training job.

A job (FfDL-style: submitted, queued, run, halted, resumed) is read once, validated
completely -- including building its strategy once -- and only then does anything touch
the disk. Every problem raises :class:`ManifestError` naming the field by its dotted path
(``strategy.kind``, ``job.rounds``), so a user can fix the file without reading code::

    [job]
    name = "tiered-digits"     # letters, digits, '.', '_', '-' (names the run)
    rounds = 100               # >= 1; overrides the scenario's training.rounds
    seed = 0                   # >= 0; data split, device speeds, selection, init

    [task]
    scenario = "tifl-digits"   # a shipped scenario name, or a path (relative to this file)
    arch = "mlp"               # optional: model architecture (default: the scenario's)

    [strategy]
    kind = "tiered"            # fedavg | fedprox | tiered | distill | nested

    [strategy.params]          # optional: the strategy's parameters (see aggregator.factory)
    tiers = 5
    late_policy = "drop"

    [federation]               # optional
    backend = "inprocess"      # inprocess | flower | deployment
    workers = 2                # >= 1: parties trained at once (inprocess)

    [checkpoint]               # optional
    every = 1                  # checkpoint every N rounds (and always at the last/halt)
    keep = 3                   # newest checkpoints kept on disk

``backend = "inprocess"`` is the one :mod:`fedge.sim.jobs` runs (the scenario's
simulated fleet on an in-process Flower grid, virtual clock). ``"flower"`` (Flower's
simulation runtime) and ``"deployment"`` (real SuperNodes) are valid manifests for the
code that runs those backends; ``fedge aggregator run`` refuses them by name.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fedge.aggregator.jobs.spec import (
    CheckpointSpec,
    JobSpec,
    ManifestError,
    check_tier_credits,
    take_privacy,
)
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.strategies.factory import (
    KINDS,
    StrategyConfigError,
    build_strategy,
    optimizer_as_kind,
)
from fedge.models.digits import ARCHITECTURES
from fedge.sim.scenario import Scenario, ScenarioError, load_scenario, scenario_path
from fedge.toml_table import TomlTable

Backend = Literal["inprocess", "flower", "deployment"]
BACKENDS: tuple[Backend, ...] = ("inprocess", "flower", "deployment")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class TaskSpec:
    """``[task]``: the scenario (task, data and fleet) and the model architecture."""

    scenario: str
    """As written in the manifest (a shipped name or a path)."""
    scenario_file: Path
    """The scenario file it resolved to (absolute)."""
    arch: str


@dataclass(frozen=True)
class StrategySpec:
    """``[strategy]``: the strategy kind and its parameters (validated by the factory)."""

    kind: str
    params: Mapping[str, object] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class FederationSpec:
    """``[federation]``: where the parties run."""

    backend: Backend = "inprocess"
    workers: int = 2


@dataclass(frozen=True)
class JobManifest:
    """A validated job manifest.

    ``scenario`` is the loaded scenario with the job's ``rounds`` and ``arch`` applied to
    its ``[training]``; ``text`` is the manifest as written (stored with the run).
    """

    job: JobSpec
    task: TaskSpec
    strategy: StrategySpec
    federation: FederationSpec
    checkpoint: CheckpointSpec
    scenario: Scenario = field(compare=False)
    source: str = field(default="", compare=False)
    text: str = field(default="", compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.job.name

    @property
    def rounds(self) -> int:
        return self.job.rounds

    @property
    def seed(self) -> int:
        return self.job.seed

    def strategy_params(self) -> dict[str, object]:
        """The parameter table :func:`fedge.aggregator.strategies.factory.build_strategy` takes."""
        return {"kind": self.strategy.kind, **self.strategy.params}


# ---------------------------------------------------------------- loading


def load_manifest(path: Path | str) -> JobManifest:
    """Read and validate a job manifest; raises :class:`ManifestError` naming the field.

    A relative ``task.scenario`` path is resolved against the manifest's directory.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"no job manifest at {path}") from None
    except OSError as exc:
        raise ManifestError(f"cannot read job manifest {path}: {exc}") from exc
    return parse_manifest(text, source=str(path), base_dir=path.resolve().parent)


def parse_manifest(
    text: str,
    *,
    source: str = "",
    base_dir: Path | None = None,
    scenario_file: Path | None = None,
) -> JobManifest:
    """Validate manifest TOML text.

    ``base_dir`` resolves a relative ``task.scenario`` (default: the working directory);
    ``scenario_file`` reads the scenario from that file instead (a job directory's frozen
    copy), whatever ``task.scenario`` says.
    """
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"job manifest {source or '<text>'} is not valid TOML: {exc}") from exc
    top = TomlTable(document, "", _TOP_FIELDS, error=ManifestError)
    job_table = top.table("job", _JOB_FIELDS)
    task_table = top.table("task", _TASK_FIELDS)
    strategy_table = top.table("strategy", _STRATEGY_FIELDS)
    federation_table = top.optional_table("federation", _FEDERATION_FIELDS)
    checkpoint_table = top.optional_table("checkpoint", _CHECKPOINT_FIELDS)

    name = job_table.text("name", non_empty=True)
    if not _NAME.match(name):
        raise ManifestError(
            f"job.name must be 1-64 letters, digits, '.', '_' or '-' "
            f"(starting with a letter or digit), got {name!r}"
        )
    job = JobSpec(
        name=name,
        rounds=job_table.integer("rounds", minimum=1),
        seed=job_table.integer("seed", minimum=0),
    )

    reference = task_table.text("scenario", non_empty=True)
    resolved = scenario_file or _resolve_scenario(reference, base_dir)
    try:
        loaded = load_scenario(str(resolved))
    except ScenarioError as exc:
        raise ManifestError(f"task.scenario: {exc}") from None
    arch = task_table.text("arch", loaded.training.arch, non_empty=True)
    if arch not in ARCHITECTURES:
        raise ManifestError(
            f"task.arch: unknown architecture {arch!r} (known: {', '.join(sorted(ARCHITECTURES))})"
        )
    task = TaskSpec(scenario=reference, scenario_file=resolved.resolve(), arch=arch)
    scenario = dataclasses.replace(
        loaded, training=dataclasses.replace(loaded.training, rounds=job.rounds, arch=arch)
    )

    kind = strategy_table.text("kind", non_empty=True)
    misnamed = optimizer_as_kind(kind)
    if misnamed:
        raise ManifestError(f"strategy.kind: {misnamed}")
    if kind not in KINDS:
        known = ", ".join(KINDS)
        raise ManifestError(f"strategy.kind: unknown strategy {kind!r} (known: {known})")
    if kind in ("distill", "nested") and "arch" in task_table:
        raise ManifestError(
            f"task.arch: {kind} trains one architecture per tier (strategy.params.tier_archs; "
            "the largest is the global model): leave task.arch out"
        )
    params_table = strategy_table.optional_table("params", None)
    params = dict(params_table.items()) if params_table else {}
    take_privacy(document, params)
    strategy = StrategySpec(kind=kind, params=params)
    _validate_strategy(strategy, scenario, job.seed)
    check_tier_credits(job.rounds, kind, strategy.params, parties=scenario.fleet.parties)

    federation = FederationSpec()
    if federation_table is not None:
        backend = federation_table.text("backend", "inprocess", non_empty=True)
        if backend not in BACKENDS:
            raise ManifestError(
                f"federation.backend must be one of {', '.join(BACKENDS)}, got {backend!r}"
            )
        federation = FederationSpec(
            backend=_backend(backend),
            workers=federation_table.integer("workers", minimum=1, default=2),
        )
    checkpoint = CheckpointSpec()
    if checkpoint_table is not None:
        checkpoint = CheckpointSpec(
            every=checkpoint_table.integer("every", minimum=1, default=1),
            keep=checkpoint_table.integer("keep", minimum=1, default=3),
        )
    return JobManifest(
        job=job,
        task=task,
        strategy=strategy,
        federation=federation,
        checkpoint=checkpoint,
        scenario=scenario,
        source=source,
        text=text,
    )


def _resolve_scenario(reference: str, base_dir: Path | None) -> Path:
    path = scenario_path(reference)  # a bare name resolves to the shipped (absolute) file
    return path if path.is_absolute() else (base_dir or Path.cwd()) / path


def _backend(value: str) -> Backend:
    for backend in BACKENDS:
        if backend == value:
            return backend
    raise ManifestError(f"federation.backend must be one of {', '.join(BACKENDS)}, got {value!r}")


def _validate_strategy(strategy: StrategySpec, scenario: Scenario, seed: int) -> None:
    """Build the strategy once, as the job will, and name the offending parameter."""
    prefix = f"strategies.{strategy.kind}"
    try:
        proxy_X = None
        if strategy.kind == "distill":  # distils on the scenario's unlabeled proxy split
            from fedge.sim.data import make_partitions

            proxy_X = make_partitions(scenario, seed).proxy_X
        build_strategy(
            strategy.kind,
            {"kind": strategy.kind, **strategy.params},
            per_round=scenario.fleet.per_round,
            seed=seed,
            clock=ClockMode.VIRTUAL,
            proxy_X=proxy_X,
            rounds=scenario.training.rounds,  # the job's: central DP's epsilon is checked
        )
    except StrategyConfigError as exc:
        message = str(exc)
        if message.startswith(prefix):
            message = "strategy.params" + message[len(prefix) :]
        raise ManifestError(message) from None
    except ScenarioError as exc:  # e.g. a fleet the data cannot be split over
        raise ManifestError(f"task.scenario: {exc}") from None


_TOP_FIELDS = frozenset(("job", "task", "strategy", "federation", "checkpoint", "privacy"))
_JOB_FIELDS = frozenset(("name", "rounds", "seed"))
_TASK_FIELDS = frozenset(("scenario", "arch"))
_STRATEGY_FIELDS = frozenset(("kind", "params"))
_FEDERATION_FIELDS = frozenset(("backend", "workers"))
_CHECKPOINT_FIELDS = frozenset(("every", "keep"))
