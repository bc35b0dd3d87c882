"""Federated anomaly detection from good parts (issue 28): unseen defects, exactness,
the gain of federation at a small station, and the serving cost beside the classifier.

Per seed:

1. **Backbone**: the fleet's inspection CNN (:mod:`fedge.models.inspection`), trained on
   the CPU (one thread) on generated scratch images; the anomaly model uses its feature
   layers (:class:`~fedge.models.anomaly.backbone.InspectionBackbone`).
2. **Stations**: ``size.station_parts`` good parts each (the last the smallest), fresh
   surfaces per station; each computes its sufficient statistics
   (:func:`~fedge.models.anomaly.statistics.station_statistics`); the fleet's model is the
   fit of their sum, the pooled model the fit of all parts' features at once.
3. **Unseen defects**: dents and pits, shapes no station's data holds (the classifier's
   training data has scratches only; the anomaly model's none at all). Image AUROC of
   good parts against each shape, on a fleet-wide held-out set; ``auroc_unseen`` is the
   worse shape's (a target met on the easy shape alone would flatter).
4. **Exactness**: max |federated - pooled| over the summed statistics, the fitted means
   and covariances and the float64 scores of the held-out set; and the float32 scores the
   exported graphs serve (reported apart); the AUROCs of both models.
5. **Smallest station**: its own held-out good parts, dents and pits, scored by the
   fleet's model and by the model fitted on its good parts alone: the gain in points;
   and the same gain with the station holding ``curve_parts`` good parts instead.
6. **Serving cost and novel defects** (seed 0): through the agent's runtime and scoring
   function, the classifier alone against the pair, and five streams with dents at 10 %
   judged by the monitor's rules after every image, beside 5 in-distribution streams
   (:mod:`fedge.bench.anomaly_serving`); for reference, bare ONNX Runtime,
   one image per call as a station scores them,
   interleaved rounds: the classifier alone against one graph giving the classifier's
   probabilities, the anomaly score and map from shared features
   (:func:`~fedge.models.anomaly.model.export_with_classifier`); and, for reference,
   the classifier and a separate anomaly graph run one after the other.
"""

import dataclasses
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fedge.bench import Progress, no_progress
from fedge.bench.anomaly_serving import StreamSize, load_pair, novel_detection
from fedge.bench.anomaly_serving import serving_cost as serving
from fedge.bench.anomaly_thresholds import HOLDOUT_SHARE, over_seeds, threshold_false_alarms
from fedge.bench.errors import BenchError
from fedge.bench.machine import machine_info
from fedge.datasets.defects import make_defect_images
from fedge.models.anomaly.backbone import (
    DEFAULT_INPUT_SCALE,
    DEFAULT_STAGES,
    InspectionBackbone,
)
from fedge.models.anomaly.model import (
    AnomalyNet,
    ClassifierWithAnomaly,
    export_onnx,
    export_with_classifier,
    extract_features,
    score_images,
)
from fedge.models.anomaly.statistics import (
    GaussianFit,
    SufficientStatistics,
    add_statistics,
    fit,
    mahalanobis,
    station_statistics,
)
from fedge.models.anomaly.threshold import min_parts_for, threshold_for_rate
from fedge.models.inspection import INPUT_NAME, cpu_threads, train_inspection_model
from fedge.models.inspection import export_onnx as export_classifier

TARGET_AUROC = 0.95
TARGET_MAX_ABS_DIFF = 1e-5
TARGET_GAIN_POINTS = 5.0
TARGET_COST_RATIO = 2.0
TARGET_NOVEL_IMAGES = 30
UNSEEN_SHAPES = ("dents", "pits")
FALSE_ALARM_RATE = 0.01


@dataclass(frozen=True)
class AnomalyBenchSize:
    """How big a run is; the defaults are the benchmark, tests use a tiny one."""

    train_images: int = 2000
    epochs: int = 3
    station_parts: tuple[int, ...] = (600, 300, 150, 20)
    # Good parts at the smallest station for the gain-by-size curve (reported beside the
    # headline gain, which is at ``station_parts[-1]``).
    curve_parts: tuple[int, ...] = (5, 10, 20, 40, 80)
    test_good: int = 500
    test_per_shape: int = 250
    station_test_good: int = 250  # what `fedge bench anomaly` runs (test_images // 2)
    station_test_per_shape: int = 100
    cost_rounds: int = 7
    cost_per_round: int = 200
    streams: StreamSize = field(default_factory=StreamSize)
    stages: int = DEFAULT_STAGES
    input_scale: float | None = DEFAULT_INPUT_SCALE
    """None: the classifier's per-image normalisation (PaDiM-as-published with stages=3)."""

    def __post_init__(self) -> None:
        if len(self.station_parts) < 2 or min(self.station_parts) < 1:
            raise BenchError(
                f"give at least 2 stations with at least 1 good part each, got {self.station_parts}"
            )
        if min(self.test_good, self.test_per_shape, self.station_test_per_shape) < 1:
            raise BenchError("every held-out set needs at least one image")
        needed = min_parts_for(FALSE_ALARM_RATE)  # a conformal threshold (threshold.py)
        if min(self.station_test_good, self.test_good) < needed:
            raise BenchError(
                f"a {FALSE_ALARM_RATE:.0%} threshold needs >= {needed} held-out good parts: "
                f"got {self.test_good} for the fleet and {self.station_test_good} at the "
                "smallest station (--test-images gives both, the second as half)"
            )


FULL = AnomalyBenchSize()


def run_anomaly(
    seed: int = 0,
    *,
    size: AnomalyBenchSize = FULL,
    serving_cost: bool = True,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """One seed: backbone, station statistics, AUROCs, exactness, smallest station, cost."""
    started = time.perf_counter()
    base = 1000 * seed
    progress(f"training the inspection CNN on {size.train_images} scratch images")
    train_x, train_y = make_defect_images(size.train_images, seed=base + 1)
    with cpu_threads(1):
        classifier = train_inspection_model(
            train_x, train_y, epochs=size.epochs, seed=seed, device="cpu"
        )
        backbone = InspectionBackbone(
            classifier, stages=size.stages, input_scale=size.input_scale
        ).eval()

        progress(f"{len(size.station_parts)} stations compute their statistics")
        station_features = []
        for index, parts in enumerate(size.station_parts):
            good, _ = make_defect_images(parts, seed=base + 10 + index, scratch_fraction=0.0)
            station_features.append(extract_features(backbone, good))
        grid = station_features[0][1]
        shares = [station_statistics(features, grid) for features, _ in station_features]
        summed = add_statistics(shares)
        pooled_stats = station_statistics(
            np.concatenate([features for features, _ in station_features]), grid
        )
        federated, pooled = fit(summed), fit(pooled_stats)

        progress("each station's threshold by three rules, on fresh good parts")
        held_out = [
            extract_features(
                backbone,
                make_defect_images(
                    max(1, round(parts * HOLDOUT_SHARE / (1 - HOLDOUT_SHARE))),
                    seed=base + 300 + index,
                    scratch_fraction=0.0,
                )[0],
            )[0]
            for index, parts in enumerate(size.station_parts)
        ]

        progress("scoring held-out good parts, dents and pits")
        test = _held_out(base + 100, size.test_good, size.test_per_shape)
        test_features = {name: extract_features(backbone, x)[0] for name, x in test.items()}
        fed_scores = {name: _max_distance(federated, f) for name, f in test_features.items()}
        pool_scores = {name: _max_distance(pooled, f) for name, f in test_features.items()}
        auroc_fed = _shape_aurocs(fed_scores)
        auroc_pool = _shape_aurocs(pool_scores)
        served_diff = _served_scores_diff(backbone, federated, pooled, test)
        calibration = threshold_false_alarms(
            federated,
            summed,
            [features for features, _ in station_features],
            held_out,
            test_features["good"],
        )

        progress("the smallest station: the fleet's model against its own")
        smallest = len(size.station_parts) - 1
        own = _held_out(base + 200, size.station_test_good, size.station_test_per_shape)
        own_features = {name: extract_features(backbone, x)[0] for name, x in own.items()}
        alone = fit(shares[smallest])
        smallest_fed = _shape_aurocs(
            {name: _max_distance(federated, f) for name, f in own_features.items()}
        )
        smallest_alone = _shape_aurocs(
            {name: _max_distance(alone, f) for name, f in own_features.items()}
        )
        threshold = threshold_for_rate(
            _max_distance(federated, own_features["good"]), FALSE_ALARM_RATE
        )
        curve = _gain_by_size(backbone, shares[:smallest], base + 10 + smallest, own_features, size)

        # The station's threshold: the fleet model's 1 % quantile on held-out good parts.
        fleet_threshold = threshold_for_rate(fed_scores["good"], FALSE_ALARM_RATE).threshold
        cost = (
            _serving_cost(classifier, backbone, federated, size, progress, fleet_threshold, seed)
            if serving_cost
            else None
        )

    stats_diff = _stats_diff(summed, pooled_stats)
    fit_diff = max(
        float(np.max(np.abs(federated.mean - pooled.mean))),
        float(np.max(np.abs(federated.covariance - pooled.covariance))),
    )
    score_diff = max(
        float(np.max(np.abs(fed_scores[name] - pool_scores[name]))) for name in fed_scores
    )
    gain = 100.0 * (smallest_fed["unseen"] - smallest_alone["unseen"])
    result: dict[str, Any] = {
        "benchmark": "anomaly",
        "seed": seed,
        "size": dataclasses.asdict(size),
        "grid": list(grid),
        "feature_dims": summed.dims,
        "auroc": {"federated": auroc_fed, "pooled": auroc_pool},
        "auroc_unseen": auroc_fed["unseen"],
        "auroc_equal": auroc_fed == auroc_pool,
        "pooled_max_abs_diff": max(stats_diff, fit_diff, score_diff),
        "pooled_diff": {
            "statistics": stats_diff,
            "fit": fit_diff,
            "scores_float64": score_diff,
            "scores_served_float32": served_diff,
        },
        "smallest_station": {
            "good_parts": size.station_parts[smallest],
            "auroc_federated": smallest_fed,
            "auroc_alone": smallest_alone,
            "threshold_at_1pct": dataclasses.asdict(threshold),
            "over_threshold_1pct": {
                shape: round(
                    float(
                        np.mean(_max_distance(federated, own_features[shape]) > threshold.threshold)
                    ),
                    4,
                )
                for shape in UNSEEN_SHAPES
            },
        },
        "auroc_gain_smallest_station": round(gain, 2),
        # The same comparison with the smallest station holding other numbers of good
        # parts (its statistics in the fleet's sum each time): where federation pays.
        "auroc_gain_by_station_size": curve,
        # What the station's threshold lets through: the shapes' share over the fleet
        # model's 1 % quantile of held-out good parts (the threshold the streams use).
        "over_threshold_1pct": {
            shape: round(float(np.mean(fed_scores[shape] > fleet_threshold)), 4)
            for shape in UNSEEN_SHAPES
        },
        # Each station's threshold set by the old empirical rule, the conformal one on its
        # held-out parts, and the conformal one with its parts left out of the fit: the
        # share of fresh good parts over it (anomaly_thresholds.py).
        "threshold_false_alarms": calibration,
        "serving_cost": cost,
        "seconds": round(time.perf_counter() - started, 1),
        "machine": machine_info(),
    }
    return result


def run_anomaly_seeds(
    seeds: int = 5, *, size: AnomalyBenchSize = FULL, progress: Progress = no_progress
) -> dict[str, Any]:
    """:func:`run_anomaly` on seeds ``0..seeds-1`` (serving cost on seed 0); medians."""
    runs = [
        run_anomaly(
            seed,
            size=size,
            serving_cost=seed == 0,
            progress=_labelled(progress, seed),
        )
        for seed in range(seeds)
    ]
    cost = runs[0]["serving_cost"]
    novel = cost["novel_detection"]
    auroc_unseen = _median(run["auroc_unseen"] for run in runs)
    per_shape = {
        shape: _median(run["auroc"]["federated"][shape] for run in runs)
        for shape in (*UNSEEN_SHAPES, "unseen")
    }
    max_diff = max(run["pooled_max_abs_diff"] for run in runs)
    gain = _median(run["auroc_gain_smallest_station"] for run in runs)
    gain_curve = {
        parts: _median(run["auroc_gain_by_station_size"][parts] for run in runs)
        for parts in runs[0]["auroc_gain_by_station_size"]
    }
    checks = {
        "auroc_unseen_at_least_0.95": auroc_unseen >= TARGET_AUROC,
        "pooled_max_abs_diff_at_most_1e-5": max_diff <= TARGET_MAX_ABS_DIFF,
        "auroc_equal_every_seed": all(run["auroc_equal"] for run in runs),
        "gain_smallest_station_at_least_5_points": gain >= TARGET_GAIN_POINTS,
        "serving_cost_ratio_within_2x": cost["ratio"] <= TARGET_COST_RATIO,
        "novel_alert_within_30_images": novel["novel_alert_images"] is not None
        and novel["novel_alert_images"] <= TARGET_NOVEL_IMAGES,
        "no_false_alerts": novel["false_alerts"] == 0,
    }
    return {
        "benchmark": "anomaly",
        "seeds": list(range(seeds)),
        "statistic": "median over seeds (pooled_max_abs_diff: worst seed)",
        "size": dataclasses.asdict(size),
        "auroc_unseen": auroc_unseen,
        "auroc_unseen_definition": "the worse of the unseen shapes (dents, pits)",
        "auroc_federated_median": per_shape,
        "over_threshold_1pct_median": {
            shape: _median(run["over_threshold_1pct"][shape] for run in runs)
            for shape in UNSEEN_SHAPES
        },
        "pooled_max_abs_diff": max_diff,
        "threshold_false_alarms": over_seeds([run["threshold_false_alarms"] for run in runs]),
        "auroc_gain_smallest_station": gain,
        "auroc_gain_by_station_size_median": gain_curve,
        "serving_cost_ratio": cost["ratio"],
        "serving_cost": cost,
        "novel_alert_images": novel["novel_alert_images"],
        "mpp_drift_alert_images": novel["mpp_drift_alert_images"],
        "false_alerts": novel["false_alerts"],
        "targets": {
            "auroc_unseen": TARGET_AUROC,
            "pooled_max_abs_diff": TARGET_MAX_ABS_DIFF,
            "auroc_gain_smallest_station_points": TARGET_GAIN_POINTS,
            "serving_cost_ratio": TARGET_COST_RATIO,
            "novel_alert_images": TARGET_NOVEL_IMAGES,
            "false_alerts": 0,
        },
        "checks": checks,
        "met_target": all(checks.values()),
        "per_seed": runs,
        "machine": runs[0]["machine"],
    }


def _gain_by_size(
    backbone: InspectionBackbone,
    others: list[SufficientStatistics],
    seed: int,
    own_features: dict[str, npt.NDArray[np.float64]],
    size: AnomalyBenchSize,
) -> dict[str, float]:
    """Points of unseen-shape AUROC the fleet's model gains over the smallest station's
    own, at each of ``size.curve_parts`` good parts there (its held-out set fixed)."""
    curve = {}
    for parts in size.curve_parts:
        good, _ = make_defect_images(parts, seed=seed, scratch_fraction=0.0)
        features, grid = extract_features(backbone, good)
        own = station_statistics(features, grid)
        fleet, alone = fit(add_statistics([*others, own])), fit(own)
        gained = (
            _shape_aurocs({name: _max_distance(fleet, f) for name, f in own_features.items()})[
                "unseen"
            ]
            - _shape_aurocs({name: _max_distance(alone, f) for name, f in own_features.items()})[
                "unseen"
            ]
        )
        curve[str(parts)] = round(100.0 * gained, 2)
    return curve


def _labelled(progress: Progress, seed: int) -> Progress:
    return lambda line: progress(f"seed {seed}: {line}")


def _held_out(seed: int, good: int, per_shape: int) -> dict[str, npt.NDArray[np.uint8]]:
    good_x, _ = make_defect_images(good, seed=seed, scratch_fraction=0.0)
    dents, _ = make_defect_images(per_shape, seed=seed + 1, scratch_fraction=1.0, dent_fraction=1.0)
    pits, _ = make_defect_images(per_shape, seed=seed + 2, scratch_fraction=1.0, pit_fraction=1.0)
    return {"good": good_x, "dents": dents, "pits": pits}


def _max_distance(model: GaussianFit, features: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    result: npt.NDArray[np.float64] = mahalanobis(model, features).max(axis=1)
    return result


def _shape_aurocs(scores: dict[str, npt.NDArray[np.float64]]) -> dict[str, float]:
    result = {shape: auroc(scores["good"], scores[shape]) for shape in UNSEEN_SHAPES}
    result["unseen"] = min(result[shape] for shape in UNSEEN_SHAPES)
    return result


def auroc(negatives: npt.NDArray[np.float64], positives: npt.NDArray[np.float64]) -> float:
    """P(a positive scores above a negative), ties counted half (Mann-Whitney U / n m)."""
    if len(negatives) == 0 or len(positives) == 0:
        raise ValueError("AUROC needs at least one negative and one positive")
    above = np.sum(positives[:, None] > negatives[None, :])
    ties = np.sum(positives[:, None] == negatives[None, :])
    return round(float((above + 0.5 * ties) / (len(negatives) * len(positives))), 4)


def _stats_diff(a: SufficientStatistics, b: SufficientStatistics) -> float:
    return max(
        float(abs(a.count - b.count)),
        float(np.max(np.abs(a.total - b.total))),
        float(np.max(np.abs(a.outer - b.outer))),
    )


def _served_scores_diff(
    backbone: InspectionBackbone,
    federated: GaussianFit,
    pooled: GaussianFit,
    test: dict[str, npt.NDArray[np.uint8]],
) -> float:
    fed_net, pool_net = AnomalyNet(backbone, federated).eval(), AnomalyNet(backbone, pooled).eval()
    return max(
        float(np.max(np.abs(score_images(fed_net, x)[0] - score_images(pool_net, x)[0])))
        for x in test.values()
    )


def _serving_cost(
    classifier: Any,
    backbone: InspectionBackbone,
    model: GaussianFit,
    size: AnomalyBenchSize,
    progress: Progress,
    threshold: float,
    seed: int,
) -> dict[str, Any]:
    import onnxruntime as ort

    progress("timing the classifier alone against classifier + anomaly (ONNX Runtime)")
    anomaly = AnomalyNet(backbone, model).eval()
    images, _ = make_defect_images(size.cost_per_round, seed=9_999, scratch_fraction=0.3)
    inputs = [x[None, None].astype(np.float32) / np.float32(255.0) for x in images]
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: Path(tmp) / f"{name}.onnx" for name in ("classifier", "both", "anomaly")}
        export_classifier(classifier, paths["classifier"])
        export_with_classifier(
            ClassifierWithAnomaly(classifier, anomaly), paths["both"], image_size=32
        )
        export_onnx(anomaly, paths["anomaly"], image_size=32)
        options = ort.SessionOptions()
        # One thread, as a station's inference runs beside its other work.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        sessions = {
            name: ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            for name, path in paths.items()
        }
        sides = {
            "classifier": [sessions["classifier"]],
            "shared": [sessions["both"]],
            "separate": [sessions["classifier"], sessions["anomaly"]],
        }
        for runners in sides.values():  # warm-up
            for session in runners:
                for x in inputs[:20]:
                    session.run(None, {INPUT_NAME: x})
        medians: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(size.cost_rounds):
            for name, runners in sides.items():
                started = time.perf_counter()
                for x in inputs:
                    for session in runners:
                        session.run(None, {INPUT_NAME: x})
                medians[name].append((time.perf_counter() - started) / len(inputs) * 1e3)
        # The real serving path: the agent's runtime and scoring function (issue 28).
        alone, pair = load_pair(paths["classifier"], paths["anomaly"], 32)
        progress("timing the agent's scoring path: the classifier alone against the pair")
        agent_cost = serving(alone, pair, [x[0] for x in inputs], size.cost_rounds)
        progress("novel-defect streams through the agent's scoring and the monitor's rules")
        streams = novel_detection(pair, threshold, 5_000 + seed, size.streams)
    per_image = {name: statistics.median(values) for name, values in medians.items()}
    return {
        "method": "ONNX Runtime CPU, 1 thread, one image per call, median of interleaved rounds",
        "ms_per_image": {name: round(value, 4) for name, value in per_image.items()},
        "ratio_shared_graph": round(per_image["shared"] / per_image["classifier"], 3),
        "ratio_separate_graphs": round(per_image["separate"] / per_image["classifier"], 3),
        # What a station pays: two graphs through the agent's scoring path.
        "ratio": agent_cost["ratio"],
        "agent_serving_path": agent_cost,
        "novel_detection": streams,
        "rounds": size.cost_rounds,
        "images_per_round": size.cost_per_round,
    }


def _median(values: Any) -> float:
    return round(float(statistics.median(list(values))), 4)
