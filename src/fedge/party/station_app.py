"""The station's Flower ``ClientApp``: train the job's model on this station's labelled images.

The agent (``fedge agent run`` with training enabled in its signed config) supervises a
``flower-supernode`` for the station; the SuperNode runs this app in its own process for
every message, so training never shares a process with inference. The node config the
agent starts the SuperNode with says where the station's data is::

    edge             the station's edge id (answers the aggregator's QUERY)
    data-dir         the agent's data directory (its kept images and labels)
    holdout-percent  the station's held-out share (as the agent keeps it)
    threads          CPU threads training may use
    max-seconds      the longest one round's training may take

A train message carries the global model (``"arrays"``) and a ``"config"`` record:
``model-spec`` (JSON: ``family``, ``params``, ``classes``, ``preprocess``), ``lr``,
``local-epochs``, ``batch-size``, ``proximal-mu`` (FedProx), ``server-round``, and in a
distilling job ``arch``: the named size of the family this station's tier trains
(:func:`fedge.party.families.round_spec`; one the family lacks is an error reply). Training
is :mod:`fedge.party.trainer`'s, the one a simulated party runs too. The reply's
``"metrics"``:

=======================  =================================================================
``num-examples``          labelled training images used (FedAvg's weight)
``train-loss``            mean cross-entropy over local training
``train-time-s``          wall time of local training
``local-acc``             the RECEIVED model's accuracy on the station's held-out images,
                          before training (TiFL's per-tier accuracy signal)
``holdout-acc-after``     the trained model's accuracy on the same held-out images
``holdout-examples``      held-out images
``skipped-unreadable``    kept files that no longer decode (skipped)
``skipped-unknown-label`` labels the model has no class for (skipped)
``stopped-early``         1 when the round's time cap ended training
=======================  =================================================================

Under DP-SGD (``dp-mode = local``) only what is accounted or public leaves the station
(issue 24, "nothing leaves outside the ledger"): ``train-loss`` (computed on the private
batches), ``local-acc`` and ``holdout-acc-after`` (held-out images scored for weights the
server chose) and the ``skipped-*`` label counts are not sent. The image counts
(``num-examples``, ``holdout-examples``) and timings are treated as public, as DP-SGD's
own sample rate is.

With ``dp-mode = local`` in the round config (:class:`~fedge.privacy.settings.PrivacySpec`)
the round is DP-SGD (:mod:`fedge.party.private_round`): planned for the job's target
epsilon over ``dp-rounds-per-party`` rounds (the aggregator sends the job's rounds when
the job sets none; without either, one round: all of the job's epsilon at once, the safe
reading), checked against the station's ledger (``<data-dir>/privacy.db``: the job's
epsilon and the lifetime bound from the signed edge config) *before* training, trained
with Opacus, and recorded under ``(job-id, server-round)``. The reply adds
``dp-epsilon-round``, ``dp-epsilon-job``, ``dp-epsilon-total``, ``dp-noise-multiplier``,
``dp-sample-rate`` and ``dp-steps``. A round past a bound raises
:class:`~fedge.privacy.settings.BudgetExhaustedError` and trains nothing. The job is the
config's ``job-id`` (the aggregator's run id, the same across resumes); a ServerApp that
sends none gets Flower's run id, which a resubmitted run changes: the job's own bound then
restarts, the lifetime bound does not.

The station's privacy floor (:mod:`fedge.privacy.floor`, its agent writes it into the
ledger from agent.toml) is checked first: a round asking for less privacy (no DP-SGD, a
noise multiplier below the floor's, a job epsilon above it, a lifetime past it) raises
:class:`~fedge.privacy.floor.PrivacyFloorError` naming the floor before anything trains.

An evaluate message gets ``eval-acc`` and ``num-examples`` on the held-out images. Under a
floor, or when the evaluation's config says ``dp-mode = local``, each evaluation is a
release: at most the floor's ``evaluations_per_job`` per job, recorded in the ledger
before anything is scored, and ``eval-acc`` is the correct count plus Gaussian noise over
the held-out count (accounted as a Gaussian mechanism in the same ledger). A query gets
``{"edge": ...}`` in the ``"identity"`` config record. Anything that prevents
training (no labelled images, a family the station cannot build, weights that do not
fit) raises a :class:`~fedge.party.errors.PartyError`: Flower turns it into an error
reply, which the aggregator records as the party's failure -- data, never a hang.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import secrets
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge.party.budget import BudgetLedger
from fedge.party.errors import PartyError
from fedge.party.messages import ARRAYS_KEY, METRICS_KEY, global_arrays, round_config
from fedge.party.privacy_status import SpentEpsilon, ledger_path, write_spent
from fedge.party.secagg import secagg_mod
from fedge.party.station_store import Retention, StationData
from fedge.privacy.floor import (
    EvaluationBudget,
    PrivacyFloor,
    PrivacyFloorError,
    effective_spec,
    noisy_accuracy,
    round_refusal,
)
from fedge.privacy.settings import BudgetExhaustedError, PrivacyError, PrivacyMode, PrivacySpec
from fedge.protocols.errors import ProtocolError
from fedge.protocols.model_spec import MODEL_SPEC_KEY, ModelSpec

if TYPE_CHECKING:
    from torch import nn

    from fedge.party import trainer

IDENTITY_KEY = "identity"
JOB_ID_KEY = "job-id"  # the aggregator's run id: what a DP-SGD round is accounted to
ARCH_KEY = "arch"  # a distilling job's architecture for this station (families.round_spec)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Station:
    """Who this node is and where its data is (from the SuperNode's node config)."""

    edge: str
    data_dir: Path
    holdout_percent: int
    threads: int
    max_seconds: float
    # The agent says whether this station has a floor ("required") or opted out ("none"):
    # a required floor it cannot find in the ledger fails closed (nothing trains) instead
    # of open. A node config that says nothing (no fedge agent: a plain SuperNode) reads
    # whatever floor the ledger holds.
    floor_required: bool = False

    @classmethod
    def from_node_config(cls, config: Mapping[str, Any]) -> Station:
        edge = config.get("edge")
        data_dir = config.get("data-dir")
        if not isinstance(edge, str) or not edge:
            raise PartyError("node_config['edge'] must name the station's edge")
        if not isinstance(data_dir, str) or not data_dir:
            raise PartyError("node_config['data-dir'] must be the agent's data directory")
        return cls(
            edge=edge,
            data_dir=Path(data_dir),
            holdout_percent=int(config.get("holdout-percent", 20)),
            threads=max(1, int(config.get("threads", 1))),
            max_seconds=float(config.get("max-seconds", 600.0)),
            floor_required=config.get("privacy-floor") == "required",
        )

    def data(self) -> StationData:
        return StationData(
            self.data_dir, Retention(holdout_percent=self.holdout_percent), readonly=True
        )


# ---------------------------------------------------------------- the work itself


def train_round(
    station: Station,
    spec: ModelSpec,
    arrays: ArrayRecord,
    config: ConfigRecord,
    *,
    job: str = "",
) -> tuple[ArrayRecord, dict[str, int | float]]:
    """Train the received model on the station's labelled images; returns arrays, metrics.

    ``job`` names the job a DP-SGD round is accounted to (:func:`round_job`).
    """
    asked = PrivacySpec.from_config(config)  # a bad dp- setting: an error reply, no training
    floor = station_floor(station)
    refusal = round_refusal(floor, asked)
    if refusal is not None:
        raise PrivacyFloorError(f"station {station.edge} refuses: {refusal}")
    if asked.mode is not PrivacyMode.LOCAL:
        _refuse_unprotected(station, asked)
    privacy = effective_spec(floor, asked)  # the floor's job bound and delta, if smaller
    private = privacy.mode is PrivacyMode.LOCAL
    # Imported where a network is built, not at the app's load: SecAgg+'s key stages and
    # queries run this module in a fresh process too, and torch costs them ~2 s each.
    from fedge.party import families, trainer

    # A distilling job names this station's tier's architecture; an unknown one is an
    # error reply, and nothing trains.
    spec = families.round_spec(spec, config.get(ARCH_KEY))
    family = families.get_family(spec.family)
    model = families.build(spec.family, spec.params, len(spec.classes))
    families.load_state_arrays(model, {k: v.numpy() for k, v in arrays.items()})
    train_items, held_items = _items(station)
    train_set = trainer.load_examples(train_items, spec.classes, spec.preprocess)
    held_out = trainer.load_examples(held_items, spec.classes, spec.preprocess)
    if len(train_set) == 0:
        raise PartyError(
            f"station {station.edge} has no usable labelled training images "
            f"({len(train_items)} labelled, skipped {dict(train_set.skipped)})"
        )
    # TiFL's signal is the received model on data it did not train on: without held-out
    # images there is none to give, and local-acc is left out of the reply. Under DP-SGD
    # it is never measured: weights the server chose, scored on held-out images, would be
    # an unaccounted release.
    before = trainer.accuracy(model, held_out) if len(held_out) and not private else math.nan
    settings = trainer.TrainSettings(
        lr=_number(config, "lr", 3e-3),
        epochs=int(_number(config, "local-epochs", 2, minimum=1)),
        batch_size=int(_number(config, "batch-size", 32, minimum=1)),
        max_seconds=station.max_seconds,
        threads=station.threads,
        seed=int(_number(config, "server-round", 0)),
        augment_symmetries=family.augment_symmetries,
        proximal_mu=_number(config, "proximal-mu", 0.0),
    )
    dp_metrics: dict[str, int | float] = {}
    if private:
        server_round = int(_number(config, "server-round", 0))
        result = _train_private(
            station, model, train_set, settings, privacy, job=job, server_round=server_round,
            floor=floor,
        )  # fmt: skip
        dp_metrics = dict(result.dp_metrics)
        dp_metrics["dp-delta"] = privacy.delta  # the delta the station accounted the job at
    else:
        result = trainer.train(model, train_set, settings)
    after = trainer.accuracy(model, held_out) if len(held_out) and not private else math.nan
    skipped = train_set.skipped + held_out.skipped
    metrics: dict[str, int | float] = {
        "num-examples": len(train_set),
        "train-time-s": result.seconds,
        "holdout-examples": len(held_out),
        "stopped-early": int(result.stopped_early),
        **dp_metrics,
    }
    if not private:
        # Under DP-SGD the loss on the private batches and the label counts are numbers
        # about the station's images that no ledger accounts: not sent.
        metrics["train-loss"] = result.loss if math.isfinite(result.loss) else 0.0
        metrics["skipped-unreadable"] = skipped["unreadable_image"]
        metrics["skipped-unknown-label"] = skipped["unknown_label"]
    if math.isfinite(before):
        metrics["local-acc"] = before
    if math.isfinite(after):
        metrics["holdout-acc-after"] = after
    return ArrayRecord(model.state_dict()), metrics


def _train_private(
    station: Station,
    model: nn.Module,
    examples: trainer.Examples,
    settings: trainer.TrainSettings,
    privacy: PrivacySpec,
    *,
    job: str,
    server_round: int,
    floor: PrivacyFloor | None,
) -> trainer.TrainResult:
    """One DP-SGD round through the trainer every party shares (planned, checked against
    the station's ledger, trained, recorded), then the station's spend reported.

    Adam, as the station's plain rounds use, so a job's ``lr`` means the same with and
    without DP. The seed is the station's secret: the noise drawn from a seed the server
    knew (the round number) could be subtracted.
    """
    from fedge.party import trainer

    secret = dataclasses.replace(settings, seed=secrets.randbits(62))
    result = trainer.train_private(
        model,
        examples,
        secret,
        privacy,
        ledger_path=ledger_path(station.data_dir),
        job=job,
        server_round=server_round,
        floor=floor,
    )
    report_spent(station, privacy)
    return result


def station_floor(station: Station) -> PrivacyFloor | None:
    """The station's privacy floor as its agent wrote it into the ledger (None: opted out,
    or no agent ever ran on this data directory). An unreadable floor is an error."""
    path = ledger_path(station.data_dir)
    written, floor = False, None
    if path.exists():
        ledger = BudgetLedger(path)
        try:
            written, floor = ledger.floor_state()
        finally:
            ledger.close()
    if station.floor_required and not written:
        raise PrivacyFloorError(
            f"station {station.edge} has a privacy floor in its agent.toml but none in its "
            f"ledger {path}: its agent writes it there at start; restart `fedge agent run` "
            "(nothing trains or is evaluated until it is there)"
        )
    return floor


def _refuse_unprotected(station: Station, privacy: PrivacySpec) -> None:
    """A station whose operator bounded its privacy spend trains only with DP-SGD: a round
    without it (or with central DP, where the server sees the raw update) would release
    an update the ledger cannot account. Refused before training, whatever the job says."""
    path = ledger_path(station.data_dir)
    if not path.exists():
        return
    ledger = BudgetLedger(path)
    try:
        bound, _ = ledger.lifetime()
    finally:
        ledger.close()
    if bound is not None:
        raise BudgetExhaustedError(
            f"station {station.edge} has a lifetime privacy budget (epsilon {bound:g}) and "
            f"trains only with DP-SGD; this round asks for dp-mode {privacy.mode.value!r}. "
            'Run the job with [privacy] mode = "local", or clear the station\'s budget '
            f"(`fedge edge set-privacy {station.edge} --clear`)"
        )


def report_spent(station: Station, privacy: PrivacySpec) -> None:
    """Leave the station's lifetime epsilon (at its lifetime delta) for its agent to send
    up (:mod:`fedge.party.privacy_status`). Only a report: a failure is logged, not raised."""
    try:
        ledger = BudgetLedger(ledger_path(station.data_dir))
        try:
            delta = ledger.bound().delta
            epsilon = ledger.spent(None, delta=delta, accountant=privacy.accountant)
        finally:
            ledger.close()
        write_spent(station.data_dir, SpentEpsilon(epsilon, delta, time.time()))
    except (OSError, PartyError, PrivacyError, sqlite3.Error) as exc:
        log.warning("station %s: could not report the epsilon spent: %s", station.edge, exc)


def evaluate_round(
    station: Station,
    spec: ModelSpec,
    arrays: ArrayRecord,
    config: ConfigRecord | None = None,
    *,
    job: str = "",
) -> dict[str, int | float]:
    """Accuracy of the received model on the station's held-out images.

    Under the station's floor, or a job with ``dp-mode = local`` in ``config``, the
    evaluation is counted in the ledger (refused past the floor's evaluations per job or
    the lifetime bound) *before* anything is scored, and the reported accuracy is noised.
    """
    asked = PrivacySpec.from_config(config or ConfigRecord())
    floor = station_floor(station)
    budget: EvaluationBudget | None = None
    if floor is not None:
        budget = EvaluationBudget.of(floor)
    elif asked.mode is PrivacyMode.LOCAL:
        budget = EvaluationBudget.of(PrivacyFloor())  # the default floor's evaluation rules
    from fedge.party import families, trainer  # torch: only where a network is built

    spec = families.round_spec(spec, (config or ConfigRecord()).get(ARCH_KEY))
    model = families.build(spec.family, spec.params, len(spec.classes))
    families.load_state_arrays(model, {k: v.numpy() for k, v in arrays.items()})
    _, held_items = _items(station)
    held_out = trainer.load_examples(held_items, spec.classes, spec.preprocess)
    if len(held_out) == 0:
        raise PartyError(f"station {station.edge} has no usable held-out images to evaluate on")
    if budget is None:
        return {"eval-acc": trainer.accuracy(model, held_out), "num-examples": len(held_out)}
    if not job:
        raise PartyError("a private evaluation needs its job's id (config['job-id'])")
    ledger = BudgetLedger(ledger_path(station.data_dir))
    try:
        ledger.record_evaluation(job, budget, accountant=asked.accountant)
    finally:
        ledger.close()
    correct = round(trainer.accuracy(model, held_out) * len(held_out))
    # The OS's randomness: noise from a seed the server could guess could be subtracted.
    draw = random.SystemRandom().gauss(0.0, budget.noise)
    return {"eval-acc": noisy_accuracy(correct, len(held_out), draw), "num-examples": len(held_out)}


def _items(station: Station) -> tuple[list[Any], list[Any]]:
    from fedge.party import trainer  # loaded already by the round that asks

    data = station.data()
    try:
        return trainer.split(data.labelled())
    finally:
        data.close()


# ---------------------------------------------------------------- the Flower adapter

# SecAgg+ rounds reach the app through Flower's secaggplus_mod (fedge.party.secagg).
app = ClientApp(mods=[secagg_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the job's model on this station's labelled images."""
    station = Station.from_node_config(context.node_config)
    config = round_config(msg)
    spec = model_spec(config)
    job = round_job(config, msg.metadata.run_id)
    arrays, metrics = train_round(station, spec, global_arrays(msg), config, job=job)
    content = RecordDict({ARRAYS_KEY: arrays, METRICS_KEY: MetricRecord(dict(metrics))})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The received model's accuracy on this station's held-out images."""
    station = Station.from_node_config(context.node_config)
    config = round_config(msg)
    spec = model_spec(config)
    job = round_job(config, msg.metadata.run_id)
    metrics = evaluate_round(station, spec, global_arrays(msg), config, job=job)
    return Message(content=RecordDict({METRICS_KEY: MetricRecord(dict(metrics))}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Say which station this node is, and how much it could train on."""
    station = Station.from_node_config(context.node_config)
    try:
        train_items, held_items = _items(station)
    except PartyError:
        train_items, held_items = [], []
    content = RecordDict(
        {
            IDENTITY_KEY: ConfigRecord({"edge": station.edge}),
            METRICS_KEY: MetricRecord(
                {"labelled": len(train_items), "holdout-examples": len(held_items)}
            ),
        }
    )
    return Message(content=content, reply_to=msg)


def round_job(config: ConfigRecord, run_id: int) -> str:
    """The job a round is accounted to: the config's ``job-id``, else Flower's run id."""
    job = config.get(JOB_ID_KEY)
    if job is None:
        return f"flwr-run-{run_id}"
    if not isinstance(job, str) or not job.strip():
        raise PartyError(f"config[{JOB_ID_KEY!r}] must be the job's id, got {job!r}")
    return job


def model_spec(config: ConfigRecord) -> ModelSpec:
    """The round's model spec; a PartyError (an error reply) when it is missing or bad."""
    try:
        return ModelSpec.from_json(config.get(MODEL_SPEC_KEY))
    except ProtocolError as exc:
        raise PartyError(str(exc)) from exc


def _number(config: ConfigRecord, key: str, default: float, *, minimum: float = 0.0) -> float:
    value = config.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < minimum
    ):
        raise PartyError(f"config[{key!r}] must be a number >= {minimum:g}, got {value!r}")
    return float(value)
