"""A station's part of an ``anomaly`` fleet job: its good parts' statistics (issue 28).

The job sends the fleet's inspection CNN (the backbone's weights, as a classifier round
does) and a config; the station answers with the sufficient statistics of its good
parts' features (:mod:`fedge.models.anomaly.statistics`), which the aggregator adds and
fits. One message, no epochs.

*Good parts* are the station's images an **operator labelled** with the good class
(``anomaly-good-class``, default ``clean``) in its training split -- never images the
serving classifier merely called clean, which would feed exactly the defects it misses
(a dent it passes) into "normal". A mislabelled defect still gets in; its influence is
bounded by clipping every location's feature vector to ``anomaly-clip`` (when set): one
part then moves the sum by at most ``clip`` and the outer products by ``clip^2`` per
location, the same bound the DP release needs (:mod:`fedge.models.anomaly.private`).

Config keys: ``anomaly-stages`` (1-3, default 1), ``anomaly-input-scale`` (default 20;
0 = the classifier's per-image normalisation), ``anomaly-clip`` (0 = none) and
``anomaly-good-class``. The reply's arrays are ``anomaly-count`` ``[1]``,
``anomaly-total`` ``[L, d]``, ``anomaly-outer`` ``[L, d, d]`` and ``anomaly-grid`` ``[2]``
(float64, :func:`fedge.models.anomaly.statistics.statistics_to_arrays`); metrics
``num-examples`` (good parts used) and ``skipped-unreadable``. The Flower adapter is
:mod:`fedge.party.anomaly_app`.

The held-out good parts stay for :func:`threshold_round`: once the fleet's model is
published, the station scores them, and its good training parts each under the fit
without it (from the pooled sums the request carries), and reports the conformal
threshold for its target false-alarm rate (:mod:`fedge.models.anomaly.threshold`).

Privacy (the round's ``dp-*`` keys, the station's floor and ledger): checked before any
feature is computed, by the same rules as a classifier round; under ``dp-mode = local``
the statistics leave the station only as a Gaussian release recorded in its ledger
(:mod:`fedge.party.anomaly_private`). A threshold from held-out parts is no DP release, so
a station under a floor or DP reports none (an error reply saying so). Under SecAgg+ the
reply carries only the arrays the job sent (the moments, not the grid: the server knows
it, and SecAgg+ would average it).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord

from fedge.party.errors import PartyError
from fedge.privacy.settings import PrivacyError, PrivacyMode, PrivacySpec
from fedge.protocols.model_spec import ModelSpec

if TYPE_CHECKING:
    from fedge.models.anomaly.backbone import InspectionBackbone
    from fedge.models.anomaly.statistics import GaussianFit, SufficientStatistics
    from fedge.party.station_app import Station

log = logging.getLogger(__name__)

# Good training parts a station scores left out of the fit, at most: one fit each (~1.5 ms
# at the default backbone's 18 features a location, ~9 ms at 48), and 500 beside the
# held-out parts are more than a 1 % threshold needs (99).
LEAVE_ONE_OUT_MAX = 500


def statistics_round(
    station: Station, spec: ModelSpec, arrays: ArrayRecord, config: ConfigRecord
) -> tuple[ArrayRecord, dict[str, int | float]]:
    """The statistics of this station's operator-labelled good training parts."""
    if _privacy(station, config).mode is not PrivacyMode.NONE:
        raise PartyError(
            f"station {station.edge}: the statistics app releases no DP statistics; run an "
            "anomaly fleet job with [privacy] for that"
        )
    stats, metrics = good_statistics(station, spec, arrays, config)
    return statistics_record(stats), metrics


def moments_round(
    station: Station,
    spec: ModelSpec,
    backbone: ArrayRecord,
    config: ConfigRecord,
    *,
    sent: Collection[str] | None = None,
) -> tuple[ArrayRecord, dict[str, int | float]]:
    """A fleet job's reply: the per-part moments of the good parts, weighted by their
    count (``num-examples``), so FedAvg's weighted mean is the pooled moments
    (:func:`fedge.models.anomaly.statistics.statistics_to_moments`). Under DP the
    moments and count of the noisy release (module docstring); ``sent``: the names of
    the arrays the job sent, the only ones the reply carries."""
    from fedge.models.anomaly import AnomalyError
    from fedge.models.anomaly.statistics import statistics_to_moments
    from fedge.party.anomaly_private import release_statistics
    from fedge.party.privacy_status import ledger_path
    from fedge.party.station_app import report_spent, station_floor

    privacy = _privacy(station, config)  # a refusal before any feature is computed
    clip = float(_number(config, "anomaly-clip", 0.0))
    private = privacy.mode is PrivacyMode.LOCAL
    if private and not clip > 0:
        raise PartyError(
            f"station {station.edge}: a DP release needs anomaly-clip > 0 (its sensitivity)"
        )
    stats, metrics = good_statistics(station, spec, backbone, config)
    if private:
        try:
            released = release_statistics(
                stats,
                privacy=privacy,
                floor=station_floor(station),
                clip=clip,
                ledger_path=ledger_path(station.data_dir),
                job=str(config.get("job-id", "")),
                server_round=int(_number(config, "server-round", 0)),
            )
        except AnomalyError as exc:
            raise PartyError(f"station {station.edge}: {exc}") from exc
        report_spent(station, privacy)
        stats, metrics = released.stats, released.metrics(privacy.delta)
    moments = statistics_to_moments(stats)
    if sent is not None:
        unknown = sorted(set(sent) - set(moments))
        if unknown:
            raise PartyError(f"the job asked for arrays {unknown} an anomaly station has none of")
        moments = {k: v for k, v in moments.items() if k in sent}
    return ArrayRecord(array_dict={k: Array(v) for k, v in moments.items()}), metrics


def _privacy(station: Station, config: Mapping[str, Any]) -> PrivacySpec:
    """The round's privacy as this station honours it (its floor and ledger), or a
    refusal (:func:`fedge.party.anomaly_private.check_round`)."""
    from fedge.party.anomaly_private import check_round
    from fedge.party.budget import BudgetLedger
    from fedge.party.privacy_status import ledger_path
    from fedge.party.station_app import station_floor

    asked = PrivacySpec.from_config(config)  # a bad dp- setting: an error reply
    path = ledger_path(station.data_dir)
    bound = None
    if path.exists():
        ledger = BudgetLedger(path)
        try:
            bound, _ = ledger.lifetime()
        finally:
            ledger.close()
    return check_round(station.edge, asked, station_floor(station), bound)


def good_statistics(
    station: Station, spec: ModelSpec, arrays: ArrayRecord, config: ConfigRecord
) -> tuple[SufficientStatistics, dict[str, int | float]]:
    """The statistics of this station's good training parts, and the reply's metrics."""
    from fedge.models.anomaly import AnomalyError
    from fedge.models.anomaly.private import clip_features
    from fedge.models.anomaly.statistics import station_statistics
    from fedge.models.inspection import cpu_threads

    backbone = _backbone(spec, arrays, config)
    good, skipped = _good_images(station, spec, config, holdout=False)
    if len(good) == 0:
        raise PartyError(
            f"station {station.edge} has no good parts to contribute: label some images "
            f"{_good_class(config)!r} (skipped {skipped} unreadable)"
        )
    clip = float(_number(config, "anomaly-clip", 0.0))
    with cpu_threads(station.threads):
        features, grid = _features(backbone, good)
    if clip > 0:
        features = clip_features(features, clip)
    try:
        stats = station_statistics(features, grid)
    except AnomalyError as exc:
        raise PartyError(f"station {station.edge}: {exc}") from exc
    return stats, {"num-examples": stats.count, "skipped-unreadable": skipped}


def threshold_round(
    station: Station,
    spec: ModelSpec,
    arrays: ArrayRecord,
    model: GaussianFit,
    config: ConfigRecord,
    *,
    fleet: SufficientStatistics | None = None,
) -> dict[str, int | float]:
    """The station's threshold for ``anomaly-false-alarm-rate`` (default 0.01), conformal
    (:mod:`fedge.models.anomaly.threshold`) on its good parts scored out of sample: the
    held-out ones by the fleet's ``model``, and, given the ``fleet``'s pooled statistics,
    its good training parts each under the fit without it (they were summed into it)."""
    from fedge.models.anomaly import AnomalyError
    from fedge.models.anomaly.private import clip_features
    from fedge.models.anomaly.statistics import mahalanobis
    from fedge.models.anomaly.threshold import leave_one_out_scores, threshold_for_rate
    from fedge.models.inspection import cpu_threads
    from fedge.party.station_app import station_floor

    if station_floor(station) is not None or _privacy(station, config).mode is not (
        PrivacyMode.NONE
    ):
        raise PrivacyError(
            f"station {station.edge} reports no anomaly threshold under its privacy floor or "
            "DP: a quantile of its held-out parts' scores is no DP release; set its "
            "threshold by hand (`fedge edge set-threshold EDGE --anomaly VALUE`)"
        )
    backbone = _backbone(spec, arrays, config)
    held, _ = _good_images(station, spec, config, holdout=True)
    trained = _good_images(station, spec, config, holdout=False)[0] if fleet is not None else None
    if trained is not None and fleet is not None and len(trained) >= fleet.count:
        # More good training parts than the whole fit holds: labelled since it was made,
        # or not this fit's; held-out parts only.
        log.warning(
            "station %s: %d good training parts but the fleet's fit holds %d: "
            "threshold from held-out parts only", station.edge, len(trained), fleet.count,
        )  # fmt: skip
        trained = None
    if len(held) == 0 and (trained is None or len(trained) == 0):
        none_trained = "" if fleet is None else ", and none of its training parts in the fit"
        raise PartyError(
            f"station {station.edge} has no held-out good parts{none_trained} to set a threshold on"
        )
    rate = float(_number(config, "anomaly-false-alarm-rate", 0.01))
    clip = float(_number(config, "anomaly-clip", 0.0))
    try:
        with cpu_threads(station.threads):
            held_scores = (
                mahalanobis(model, _features(backbone, held)[0]).max(axis=1)
                if len(held)
                else np.empty(0)
            )
            left_out = np.empty(0)
            if trained is not None and fleet is not None and len(trained):
                if len(trained) > LEAVE_ONE_OUT_MAX:  # any subset chosen blind to scores
                    seed = int.from_bytes(hashlib.sha256(station.edge.encode()).digest()[:8])
                    chosen = np.random.default_rng(seed).choice(
                        len(trained), LEAVE_ONE_OUT_MAX, replace=False
                    )
                    trained = trained[np.sort(chosen)]
                served, _ = _features(backbone, trained)
                summed = clip_features(served, clip) if clip > 0 else served  # as in the fit
                left_out = leave_one_out_scores(fleet, summed, scored=served)
        scores = np.concatenate([held_scores, left_out])
        result = threshold_for_rate(scores, rate)
    except AnomalyError as exc:
        raise PartyError(f"station {station.edge}: {exc}") from exc
    return {
        "anomaly-threshold": result.threshold,
        "anomaly-false-alarm-rate": result.false_alarm_rate,
        "holdout-examples": len(held),
        "holdout-false-alarms": int(np.sum(held_scores > result.threshold)),
        "left-out-examples": len(left_out),
        "calibration-examples": result.parts,
        "calibration-false-alarms": result.false_alarms,
    }


def statistics_record(stats: SufficientStatistics) -> ArrayRecord:
    """The reply's arrays (float64, as ``statistics.statistics_to_arrays`` gives them)."""
    from fedge.models.anomaly.statistics import statistics_to_arrays

    return ArrayRecord(array_dict={k: Array(v) for k, v in statistics_to_arrays(stats).items()})


def record_statistics(record: ArrayRecord) -> SufficientStatistics:
    """A station's reply back into statistics; a reply of another shape is an error."""
    from fedge.models.anomaly import AnomalyError
    from fedge.models.anomaly.statistics import statistics_from_arrays

    try:
        return statistics_from_arrays({k: v.numpy() for k, v in record.items()})
    except AnomalyError as exc:
        raise PartyError(f"bad anomaly statistics reply: {exc}") from exc


def _backbone(spec: ModelSpec, arrays: ArrayRecord, config: ConfigRecord) -> InspectionBackbone:
    from fedge.models.anomaly import AnomalyError
    from fedge.models.anomaly.backbone import InspectionBackbone, feature_grid
    from fedge.models.inspection import InspectionNet
    from fedge.party import families

    net = families.build(spec.family, spec.params, len(spec.classes))
    if not isinstance(net, InspectionNet):
        raise PartyError(
            f"the anomaly backbone is the inspection CNN's feature layers; family "
            f"{spec.family!r} has none (a user's backbone file is fitted with fedge.models)"
        )
    families.load_state_arrays(net, {k: v.numpy() for k, v in arrays.items()})
    scale = float(_number(config, "anomaly-input-scale", 20.0))
    try:
        backbone = InspectionBackbone(
            net,
            stages=int(_number(config, "anomaly-stages", 1, minimum=1)),
            input_scale=scale if scale > 0 else None,
        ).eval()
        feature_grid(backbone, spec.preprocess.image_size)
    except AnomalyError as exc:
        raise PartyError(f"cannot build the anomaly backbone: {exc}") from exc
    return backbone


def _good_images(
    station: Station, spec: ModelSpec, config: ConfigRecord, *, holdout: bool
) -> tuple[np.ndarray[Any, np.dtype[np.float32]], int]:
    from fedge.party import trainer

    data = station.data()
    try:
        items = data.labelled()
    finally:
        data.close()
    good = _good_class(config)
    chosen = [i for i in items if i.label == good and i.holdout == holdout]
    examples = trainer.load_examples(chosen, (good,), spec.preprocess)
    return examples.x, int(sum(examples.skipped.values()))


def _features(
    backbone: InspectionBackbone, images: np.ndarray[Any, np.dtype[np.float32]]
) -> tuple[np.ndarray[Any, np.dtype[np.float64]], tuple[int, int]]:
    from fedge.models.anomaly.model import extract_features

    return extract_features(backbone, images)


def _good_class(config: Mapping[str, Any]) -> str:
    value = config.get("anomaly-good-class", "clean")
    if not isinstance(value, str) or not value:
        raise PartyError(f"anomaly-good-class must name a class, got {value!r}")
    return value


def _number(config: Mapping[str, Any], key: str, default: float, *, minimum: float = 0.0) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise PartyError(f"config[{key!r}] must be a number >= {minimum}, got {value!r}")
    return float(value)
