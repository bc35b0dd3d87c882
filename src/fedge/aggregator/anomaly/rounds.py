"""An anomaly fleet job's one round, played by the job runner like any fleet job (issue 28).

The stations' good-part statistics are sums, and FedAvg already adds: each station replies
with its per-part moments (``total / n``, ``outer / n``) and ``num-examples = n``, and the
streaming weighted mean (:class:`~fedge.aggregator.strategies.streaming.StreamingFedAvg`,
float64 accumulators for float64 arrays) is the pooled moments; times the folded weight
``N`` they are the pooled sums, so the fit equals PaDiM's fit on the pooled parts (Defard
et al., ICPR 2021) up to float64 rounding. What the job runner gives every job comes with
it: the run store counts each station's parts once (its reply's ``num-examples``),
failures are data (a station with no good parts replies with an error), the round is
checkpointed, and a killed aggregator resumes.

:class:`StatisticsFedAvg` differs from FedAvg in two places: its train messages carry the
backbone beside the (zero) moments they ask for, and the round's result carries the
folded weight as ``anomaly-count``. After the round every station scores its held-out
good parts with the fitted model and reports its threshold for the job's false-alarm rate
(``anomaly-thresholds.json`` in the job directory; the run store's evaluation holds the
share of held-out good parts under it).

Under ``[privacy] secagg = true`` the round goes through Flower's SecAgg+ (the job runner's
driver, as for classifier jobs): the moments are what is masked and summed, without the
grid (the server knows it), the backbone rides in the train config as npz bytes (SecAgg+'s
legacy FitIns carries one model), SecAgg+'s ranges are chosen from ``[anomaly] clip`` and
the fit is within :func:`~fedge.aggregator.anomaly.secure.fit_bounds` of the plain round's
(the round's evaluation metrics carry the bounds). The count is the sum of the stations'
``num-examples``, which SecAgg+ leaves in the clear. Under ``mode = "local"`` each station
sends its noisy release's moments and noisy count (:mod:`fedge.party.anomaly_private`), so
the pooled statistics are the sum of the noisy releases and the fit clips the negative
eigenvalues noise can cause.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.supercore import log

from fedge.aggregator.anomaly.secure import FitBounds, fit_bounds, secagg_privacy
from fedge.aggregator.anomaly.spec import AnomalySpec
from fedge.aggregator.fleet.identity import IdentifiedGrid, identify_station
from fedge.aggregator.jobs.checkpoint import atomic_write_text, load_arrays
from fedge.aggregator.jobs.control import ACCURACY_KEY
from fedge.aggregator.jobs.directory import JobError
from fedge.aggregator.jobs.run_store import PartyEvaluation, RunStore
from fedge.aggregator.jobs.runner import JobRounds
from fedge.aggregator.rounds.deadline import RoundPlan, Settlement
from fedge.aggregator.rounds.fold import StreamingMean
from fedge.aggregator.rounds.loop import EvaluateFn
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.rounds.replies import Collected, arrays_of, reply_weight, to_array_record
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.models.anomaly import AnomalyError
from fedge.models.anomaly.statistics import (
    COUNT_KEY,
    FLEET_KEY,
    GRID_KEY,
    GaussianFit,
    fit,
    fit_to_arrays,
    statistics_from_moments,
    zero_moments,
)
from fedge.privacy.settings import PrivacyMode, PrivacySpec
from fedge.protocols.model_spec import MODEL_SPEC_KEY

BACKBONE_KEY = "backbone"  # the station reads it (fedge.party.anomaly_app.BACKBONE_KEY)
BACKBONE_BYTES_KEY = "anomaly-backbone"  # under SecAgg+ (fedge.party.anomaly_app)
MODEL_KEY = "model"
SHAPE_FILE = "anomaly.json"  # {"grid": [h, w], "dims": d}: written by prepare
THRESHOLDS_FILE = "anomaly-thresholds.json"


class StatisticsFedAvg(StreamingFedAvg):
    """FedAvg of the stations' moments, the backbone sent beside them (module docstring)."""

    def __init__(
        self,
        *,
        per_round: int,
        seed: int,
        backbone: ArrayRecord,
        privacy: PrivacySpec | None = None,
        grid: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(per_round=per_round, seed=seed)
        self.backbone = backbone
        if privacy is not None:
            self.privacy = privacy
        self.grid = grid
        """Under SecAgg+ the grid is not summed: the aggregate gets it back from here."""
        self.counts: list[int] = []
        """The on-time stations' ``num-examples`` of the last round (SecAgg+: the count)."""

    def _messages(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        plan: RoundPlan,
    ) -> list[Message]:
        messages = super()._messages(server_round, arrays, config, plan)
        for message in messages:  # one content object shared by the round's messages
            message.content[BACKBONE_KEY] = self.backbone
        return messages

    def close_round(
        self,
        server_round: int,
        arrays: ArrayRecord,
        plan: RoundPlan,
        tier: int | None,
        folds: dict[str, StreamingMean],
        settlement: Settlement,
        collected: Collected,
        stale_folded: int,
    ) -> tuple[ArrayRecord, RoundRecord]:
        replies = collected.replies
        self.counts = [round(reply_weight(replies[n])) for n in settlement.on_time if n in replies]
        return super().close_round(
            server_round, arrays, plan, tier, folds, settlement, collected, stale_folded
        )

    def aggregate(
        self,
        server_round: int,
        arrays: ArrayRecord,
        folds: dict[str, StreamingMean],
        metrics: dict[str, float],
    ) -> ArrayRecord:
        fold = folds.get("")
        parts = fold.total_weight if fold is not None and fold.count else 0.0
        if self.privacy.secagg and parts > 0:
            # SecAgg+'s fold is the unmasked mean itself (weight 1): the count is the sum
            # of the counts the stations sent in the clear.
            parts = float(sum(self.counts))
        result = super().aggregate(server_round, arrays, folds, metrics)
        if parts > 0:
            result[COUNT_KEY] = Array(np.array([parts], dtype=np.float64))
            if GRID_KEY not in result and self.grid is not None:
                result[GRID_KEY] = Array(np.array(self.grid, dtype=np.float64))
        return result


def fleet_fit(arrays: Mapping[str, np.ndarray]) -> GaussianFit:
    """The fleet's model from the round's result (pooled moments and ``anomaly-count``)."""
    count = arrays.get(COUNT_KEY)
    if count is None or count.shape != (1,) or not count[0] >= 1:
        raise JobError("the anomaly round added no station's statistics: nothing to fit")
    try:
        return fit(statistics_from_moments(arrays, round(float(count[0]))))
    except AnomalyError as exc:
        raise JobError(f"cannot fit the fleet's anomaly model: {exc}") from exc


def read_shape(job_dir: Path) -> tuple[tuple[int, int], int]:
    data = json.loads((job_dir / SHAPE_FILE).read_text(encoding="utf-8"))
    return (int(data["grid"][0]), int(data["grid"][1])), int(data["dims"])


def write_shape(job_dir: Path, grid: tuple[int, int], dims: int) -> None:
    atomic_write_text(job_dir / SHAPE_FILE, json.dumps({"grid": list(grid), "dims": dims}))


def anomaly_rounds(
    grid: Grid,
    job_dir: Path,
    *,
    spec_text: str,
    anomaly: AnomalySpec,
    backbone_path: Path,
    parties: dict[str, int],
    store: RunStore,
    run_id: str,
    wait_for_parties: Callable[[IdentifiedGrid], None],
    eval_timeout_s: float,
    round_timeout_s: float,
    max_weight: float,
) -> JobRounds:
    """The job runner's view of an anomaly job: the moments round and the thresholds."""
    backbone_arrays = load_arrays(backbone_path)
    backbone = to_array_record(backbone_arrays)
    grid_shape, dims = read_shape(job_dir)
    privacy = anomaly.privacy
    if privacy.secagg:
        privacy = secagg_privacy(privacy, clip=anomaly.clip, parties=len(parties))
    strategy = StatisticsFedAvg(
        per_round=len(parties), seed=0, backbone=backbone, privacy=privacy, grid=grid_shape
    )
    names = {party: edge for edge, party in parties.items()}
    config: dict[str, Any] = {MODEL_SPEC_KEY: spec_text, **anomaly.to_config()}
    if privacy.mode is not PrivacyMode.NONE:  # stations refuse thresholds under DP
        config.update(privacy.to_config())
    train_config = dict(config)
    if privacy.secagg:
        train_config[BACKBONE_BYTES_KEY] = _npz_bytes(backbone_arrays)

    def initial_arrays() -> ArrayRecord:
        moments = zero_moments(grid_shape, dims)
        if privacy.secagg:  # the grid is the server's: not summed (module docstring)
            del moments[GRID_KEY]
        return to_array_record(moments)

    def bounds() -> FitBounds | None:
        if not privacy.secagg or not strategy.counts:
            return None
        return fit_bounds(
            strategy.counts, clip=anomaly.clip, dims=dims, privacy=privacy, max_weight=max_weight
        )

    @contextmanager
    def open_grid() -> Iterator[Grid]:
        stations = IdentifiedGrid(grid, identify=identify_station(parties), unidentified="exclude")
        wait_for_parties(stations)
        yield stations

    def evaluation(stations: Grid) -> EvaluateFn:
        def evaluate(server_round: int, model: ArrayRecord) -> MetricRecord | None:
            if server_round == 0:
                return None  # zero moments: no model yet
            fitted = fleet_fit(arrays_of(model))
            results, thresholds = _thresholds_of_stations(
                stations, backbone, fitted, config, eval_timeout_s, names, fleet=model
            )
            store.record_evaluation(run_id, server_round, results)
            atomic_write_text(job_dir / THRESHOLDS_FILE, json.dumps(thresholds, indent=1))
            scored = [(r.accuracy, r.examples) for r in results if r.accuracy is not None]
            metrics = {"stations-evaluated": float(len(scored)), "good-parts": float(fitted.count)}
            bound = bounds()
            if bound is not None:
                metrics["secagg-moment-bound"] = bound.moments
                metrics["secagg-mean-bound"] = bound.mean
                metrics["secagg-covariance-bound"] = bound.covariance
                log(INFO, "SecAgg+ anomaly round: fit within %s of the plain round's", bound)
            examples = sum(n for _, n in scored)
            if examples:
                metrics[ACCURACY_KEY] = sum(a * n for a, n in scored) / examples
            return MetricRecord(dict(metrics))

        return evaluate

    return JobRounds(
        strategy=strategy,
        initial_arrays=initial_arrays,
        open_grid=open_grid,
        evaluation=evaluation,
        train_config=ConfigRecord(train_config),
        round_timeout_s=round_timeout_s,
        max_weight=max_weight,
    )


def _thresholds_of_stations(
    grid: Grid,
    backbone: ArrayRecord,
    model: GaussianFit,
    config: dict[str, Any],
    timeout_s: float,
    names: dict[int, str],
    *,
    fleet: ArrayRecord | None = None,
) -> tuple[list[PartyEvaluation], dict[str, dict[str, Any]]]:
    """Every connected station's threshold on its good parts scored out of sample, and
    the share of them under it (its evaluation: what passes as good). A station that set
    none is kept with its reason (too few parts for the rate, its privacy), which an
    operator asking for its recommended threshold is shown. ``fleet``: the round's pooled moments
    and count, from which a station scores its own good training parts left out of the
    fit (:func:`fedge.models.anomaly.threshold.leave_one_out_scores`): what it tells the
    station is what the published model's mean and covariance tell it already."""
    model_record = to_array_record(fit_to_arrays(model))
    content: dict[str, Any] = {
        "arrays": backbone,
        MODEL_KEY: model_record,
        "config": ConfigRecord(dict(config)),
    }
    if fleet is not None:
        content[FLEET_KEY] = fleet
    nodes = list(grid.get_node_ids())
    messages = [
        Message(RecordDict(content), dst_node_id=node, message_type=MessageType.EVALUATE)
        for node in nodes
    ]
    replies = {
        r.metadata.src_node_id: r for r in grid.send_and_receive(messages, timeout=timeout_s)
    }
    results: list[PartyEvaluation] = []
    thresholds: dict[str, dict[str, Any]] = {}
    for node in nodes:
        name = names.get(node, str(node))
        reply = replies.get(node)
        if reply is None:
            results.append(PartyEvaluation(name, None, 0, f"no reply within {timeout_s:.0f}s"))
            thresholds[name] = {"reason": f"no reply within {timeout_s:.0f}s", "at": time.time()}
            continue
        if reply.has_error():
            reason = str(reply.error.reason)[:500]
            log(WARNING, "station %s set no anomaly threshold: %s", name, reason[:300])
            results.append(PartyEvaluation(name, None, 0, reason))
            thresholds[name] = {"reason": reason, "at": time.time()}
            continue
        metrics: dict[str, Any] = dict(reply.content.metric_records.get("metrics", {}))
        threshold, held = metrics.get("anomaly-threshold"), metrics.get("holdout-examples")
        alarms = metrics.get("holdout-false-alarms")
        # The parts the threshold rests on: held out and left out of the fit (a station of
        # an older fedge reports only the held-out ones).
        calibrated = metrics.get("calibration-examples", held)
        missed = metrics.get("calibration-false-alarms", alarms)
        # What a station reports is data to check, not to trust.
        if not (
            isinstance(threshold, int | float) and _number(threshold) and threshold > 0
            and _count(held) and _count(alarms) and alarms <= held
            and _count(calibrated) and calibrated > 0 and calibrated >= held
            and _count(missed) and missed <= calibrated
        ):  # fmt: skip
            reason = (
                f"malformed threshold reply: anomaly-threshold={threshold!r}, "
                f"holdout-examples={held!r}, holdout-false-alarms={alarms!r}, "
                f"calibration-examples={calibrated!r}, calibration-false-alarms={missed!r}"
            )
            results.append(PartyEvaluation(name, None, 0, reason))
            thresholds[name] = {"reason": reason, "at": time.time()}
            continue
        assert isinstance(threshold, int | float)  # checked above; for the type checker
        results.append(PartyEvaluation(name, 1.0 - missed / calibrated, calibrated))
        thresholds[name] = {
            "threshold": float(threshold),
            "false_alarm_rate": float(metrics.get("anomaly-false-alarm-rate", 0.0)),
            "holdout_examples": held,
            "holdout_false_alarms": alarms,
            "calibration_examples": calibrated,
            "calibration_false_alarms": missed,
            "at": time.time(),
        }
    return results, thresholds


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Arrays as npz bytes (the station reads them: fedge.party.anomaly_app)."""
    buffer = io.BytesIO()
    contiguous: dict[str, Any] = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    np.savez(buffer, **contiguous)
    return buffer.getvalue()


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value)


def read_thresholds(job_dir: Path) -> dict[str, dict[str, Any]]:
    """Each station's reported anomaly threshold, or its ``reason`` for none (empty
    before the job evaluated)."""
    path = job_dir / THRESHOLDS_FILE
    if not path.exists():
        return {}
    data: dict[str, dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))
    return data
