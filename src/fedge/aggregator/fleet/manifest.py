"""Fleet job manifests: a federated job across a fleet's stations, not a simulation.

::

    [job]
    name = "inspect-fleet"
    rounds = 3
    seed = 0

    [task]
    model = "inspect:1"        # the registry model to start from (must be trainable)
    lr = 0.003                 # optional: local training (defaults shown)
    local_epochs = 2
    batch_size = 32

    [strategy]
    kind = "tiered"            # fedavg | fedprox | tiered (aggregator.factory)
    [strategy.params]
    tiers = 2

    [federation]
    backend = "fleet"
    fleet = "plant-a"          # must be the manager home's fleet
    edges = "all"              # or ["st-01", "st-02"]: stations that train
    per_round = 0              # parties per round (0: every edge)
    min_parties = 0            # stations connected before round 1 (0: every edge)
    node_wait_s = 180.0        # ... waited for at most this long
    round_timeout_s = 600.0    # a round's hard limit (deadlines are the strategy's)
    eval_timeout_s = 120.0     # per-station evaluation after each round

    [checkpoint]
    every = 1
    keep = 3

    [publish]                  # optional: where the final model goes
    name = "inspect"           # default: the task model's name; version = latest + 1

A ``distill`` job (one architecture per tier, one model per tier: kind ``distill`` with
``tier_archs`` and a ``[distill]`` proxy table) and a ``nested`` one (``tier_archs``
that are slices of the largest; no proxy) are :mod:`.tier_models`'s.

``[task] family = "anomaly"`` makes it an anomaly job instead (issue 28): the task
model's feature layers are the backbone, the stations send their good parts' statistics,
and ``[anomaly]`` says how (:mod:`fedge.aggregator.anomaly.spec`); ``[strategy]`` may be
left out (FedAvg), and the published name defaults to ``<model>-anomaly``.

Parsing is pure (no registry, no fleet): :mod:`fedge.federation.fleet_job` checks the
edges and the model against the manager's store before anything is created.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fedge.aggregator.anomaly.spec import (
    ANOMALY_FAMILY,
    ANOMALY_KEYS,
    CLASSIFIER_FAMILY,
    FAMILIES,
    AnomalySpec,
    anomaly_privacy,
    check_anomaly_job,
    parse_anomaly,
)
from fedge.aggregator.fleet.tier_models import (
    DISTILL,
    NESTED,
    DistillSpec,
    parse_distill,
    tiered_params,
)
from fedge.aggregator.jobs.spec import (
    CheckpointSpec,
    JobSpec,
    ManifestError,
    check_tier_credits,
    take_privacy,
)
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.strategies.factory import (
    TIER_ARCH_KINDS,
    StrategyConfigError,
    build_strategy,
    optimizer_as_kind,
)
from fedge.privacy.settings import SECAGG_MIN_PARTIES
from fedge.toml_table import TomlTable

if TYPE_CHECKING:
    import numpy as np

    from fedge.models.architectures import Architectures

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}:[0-9]+$")
FLEET_KINDS = ("fedavg", "fedprox", "tiered", DISTILL, NESTED)


@dataclass(frozen=True)
class FleetTask:
    """``[task]``: the registry model to start from and the stations' local training."""

    model: str
    lr: float = 3e-3
    local_epochs: int = 2
    batch_size: int = 32
    family: str = CLASSIFIER_FAMILY
    """What the job fits: the classifier's weights, or an anomaly model from its features."""


@dataclass(frozen=True)
class FleetFederation:
    """``[federation]``: the fleet, its training stations, and how long to wait for them."""

    fleet: str
    edges: tuple[str, ...] | Literal["all"]
    per_round: int = 0
    min_parties: int = 0
    node_wait_s: float = 180.0
    round_timeout_s: float = 600.0
    eval_timeout_s: float = 120.0


@dataclass(frozen=True)
class FleetJobManifest:
    job: JobSpec
    task: FleetTask
    kind: str
    params: dict[str, object] = field(hash=False)
    federation: FleetFederation
    checkpoint: CheckpointSpec
    publish_name: str
    distill: DistillSpec | None = None
    """``[distill]`` of a distill job (None: any other kind)."""
    text: str = field(default="", compare=False, repr=False)
    anomaly: AnomalySpec | None = None
    """``[anomaly]`` of an anomaly job (None: a classifier job)."""

    @property
    def name(self) -> str:
        return self.job.name

    @property
    def is_anomaly(self) -> bool:
        return self.task.family == ANOMALY_FAMILY

    def strategy_params(self) -> dict[str, object]:
        return {"kind": self.kind, **self.params}


def is_fleet_manifest(text: str) -> bool:
    """Whether manifest text is a fleet job (``[federation] backend = "fleet"``)."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return False
    federation = document.get("federation")
    return isinstance(federation, dict) and federation.get("backend") == "fleet"


def load_fleet_manifest(path: Path | str) -> FleetJobManifest:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"cannot read job manifest {path}: {exc}") from exc
    return parse_fleet_manifest(text, source=str(path))


def parse_fleet_manifest(text: str, *, source: str = "") -> FleetJobManifest:
    """Validate a fleet job manifest; a ManifestError names the field."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"job manifest {source or '<text>'} is not valid TOML: {exc}") from exc
    top = TomlTable(document, "", _TOP, error=ManifestError)
    job_table = top.table("job", frozenset(("name", "rounds", "seed")))
    task_table = top.table(
        "task", frozenset(("model", "lr", "local_epochs", "batch_size", "family"))
    )
    family = task_table.text("family", CLASSIFIER_FAMILY, non_empty=True)
    if family not in FAMILIES:
        raise ManifestError(f"task.family must be one of {', '.join(FAMILIES)}, got {family!r}")
    anomaly_job = family == ANOMALY_FAMILY
    strategy_table = (
        top.optional_table("strategy", frozenset(("kind", "params")))
        if anomaly_job
        else top.table("strategy", frozenset(("kind", "params")))
    )
    anomaly_table = top.optional_table("anomaly", ANOMALY_KEYS)
    if anomaly_table is not None and not anomaly_job:
        raise ManifestError('[anomaly] is for anomaly jobs: set [task] family = "anomaly"')
    fed = top.table("federation", _FEDERATION)
    checkpoint_table = top.optional_table("checkpoint", frozenset(("every", "keep")))
    publish_table = top.optional_table("publish", frozenset(("name",)))
    distill_table = top.optional_table(DISTILL, frozenset(("proxy", "max_images")))

    name = job_table.text("name", non_empty=True)
    if not _NAME.match(name):
        raise ManifestError(f"job.name must be 1-64 letters, digits, '.', '_' or '-', got {name!r}")
    job = JobSpec(
        name=name,
        rounds=job_table.integer("rounds", minimum=1),
        seed=job_table.integer("seed", minimum=0, default=0),
    )
    model = task_table.text("model", non_empty=True)
    if not _REF.match(model):
        raise ManifestError(
            f"task.model must look like NAME:VERSION (e.g. inspect:1), got {model!r}"
        )
    lr = task_table.number("lr", 3e-3)
    if not lr > 0:
        raise ManifestError(f"task.lr must be > 0, got {lr}")
    task = FleetTask(
        model=model,
        lr=lr,
        local_epochs=task_table.integer("local_epochs", minimum=1, default=2),
        batch_size=task_table.integer("batch_size", minimum=1, default=32),
        family=family,
    )
    kind = "fedavg" if strategy_table is None else strategy_table.text("kind", non_empty=True)
    misnamed = optimizer_as_kind(kind)
    if misnamed:
        raise ManifestError(f"strategy.kind: {misnamed}")
    if kind not in FLEET_KINDS:
        known = ", ".join(FLEET_KINDS)
        raise ManifestError(f"strategy.kind: {kind!r} cannot run a fleet job (known: {known})")
    params_table = None if strategy_table is None else strategy_table.optional_table("params", None)
    params = dict(params_table.items()) if params_table else {}
    take_privacy(document, params)
    distill = parse_distill(kind, params, distill_table)
    if anomaly_job:
        check_anomaly_job(job.rounds, kind, params)

    if fed.text("backend", non_empty=True) != "fleet":
        raise ManifestError('federation.backend must be "fleet" for a fleet job')
    edges_value = document["federation"].get("edges", "all")
    edges: tuple[str, ...] | Literal["all"]
    if edges_value == "all":
        edges = "all"
    elif (
        isinstance(edges_value, list)
        and edges_value
        and all(isinstance(e, str) and _NAME.match(e) for e in edges_value)
    ):
        if len(set(edges_value)) != len(edges_value):
            raise ManifestError("federation.edges names an edge twice")
        edges = tuple(edges_value)
    else:
        raise ManifestError(
            f'federation.edges must be "all" or a non-empty list of edge ids, got {edges_value!r}'
        )
    federation = FleetFederation(
        fleet=fed.text("fleet", non_empty=True),
        edges=edges,
        per_round=fed.integer("per_round", minimum=0, default=0),
        min_parties=fed.integer("min_parties", minimum=0, default=0),
        node_wait_s=_positive(fed, "node_wait_s", 180.0),
        round_timeout_s=_positive(fed, "round_timeout_s", 600.0),
        eval_timeout_s=_positive(fed, "eval_timeout_s", 120.0),
    )
    checkpoint = CheckpointSpec()
    if checkpoint_table is not None:
        checkpoint = CheckpointSpec(
            every=checkpoint_table.integer("every", minimum=1, default=1),
            keep=checkpoint_table.integer("keep", minimum=1, default=3),
        )
    publish_name = model.split(":")[0] + ("-anomaly" if anomaly_job else "")
    if publish_table is not None:
        publish_name = publish_table.text("name", publish_name, non_empty=True)
        if not _NAME.match(publish_name):  # it becomes a directory in the registry
            raise ManifestError(
                f"publish.name must be 1-64 letters, digits, '.', '_' or '-', got {publish_name!r}"
            )
    manifest = FleetJobManifest(
        job=job,
        task=task,
        kind=kind,
        params=params,
        federation=federation,
        checkpoint=checkpoint,
        publish_name=publish_name,
        distill=distill,
        text=text,
        anomaly=(
            anomaly_privacy(parse_anomaly(anomaly_table), _privacy_table(params))
            if anomaly_job
            else None
        ),
    )
    # edges = "all": the stations are counted against the fleet by `prepare`, which
    # validates again; here assume as many as SecAgg+ asks (at least 2; under it, 3).
    validate_strategy(manifest, parties=len(edges) if edges != "all" else _least_parties(params))
    check_tier_credits(job.rounds, kind, params, parties=len(edges) if edges != "all" else None)
    return manifest


def validate_strategy(
    manifest: FleetJobManifest,
    parties: int,
    *,
    architectures: Architectures | None = None,
    proxy_X: np.ndarray | None = None,
) -> None:
    """Build the strategy once, as the job will, naming the offending parameter.

    A distill job is built whole only with its stations' ``architectures`` and the proxy
    set (known once the registry is read), a nested one with the ``architectures``;
    without them, as the tiered strategy it rests on (its own keys are checked by
    :func:`~.tier_models.parse_distill`)."""
    per_round = manifest.federation.per_round or parties
    kind, params = manifest.kind, manifest.strategy_params()
    if kind in TIER_ARCH_KINDS and (architectures is None or (kind == DISTILL and proxy_X is None)):
        kind, params = "tiered", {**tiered_params(params), "kind": "tiered"}
    try:
        build_strategy(
            kind,
            params,
            per_round=max(1, per_round),
            seed=manifest.job.seed,
            clock=ClockMode.WALL,
            rounds=manifest.job.rounds,  # central DP's epsilon is checked against them
            proxy_X=proxy_X,
            architectures=architectures,
        )
    except StrategyConfigError as exc:
        message = str(exc)
        prefix = f"strategies.{manifest.kind}"
        if message.startswith(prefix):
            message = "strategy.params" + message[len(prefix) :]
        raise ManifestError(message) from None


def _privacy_table(params: dict[str, object]) -> dict[str, object] | None:
    privacy = params.get("privacy")  # take_privacy refused anything but a table
    return privacy if isinstance(privacy, dict) else None


def _least_parties(params: dict[str, object]) -> int:
    """The fewest stations an ``edges = "all"`` job could run with: 2, or under SecAgg+ 3
    (two would each learn the other's update) or its threshold's count if more."""
    privacy = params.get("privacy")
    if not isinstance(privacy, dict) or privacy.get("secagg") is not True:
        return 2
    threshold = privacy.get("secagg_threshold")
    if isinstance(threshold, int | float) and not isinstance(threshold, bool) and threshold > 1:
        return max(int(threshold), SECAGG_MIN_PARTIES)
    return SECAGG_MIN_PARTIES


def _positive(table: TomlTable, key: str, default: float) -> float:
    value = table.number(key, default)
    if not value > 0:
        raise ManifestError(f"federation.{key} must be > 0, got {value}")
    return value


_TOP = frozenset(
    (
        "job",
        "task",
        "strategy",
        "federation",
        "checkpoint",
        "privacy",
        "publish",
        "anomaly",
        DISTILL,
    )
)
_FEDERATION = frozenset(
    (
        "backend",
        "fleet",
        "edges",
        "per_round",
        "min_parties",
        "node_wait_s",
        "round_timeout_s",
        "eval_timeout_s",
    )
)
