"""Label-free accuracy (MPP) and input drift on the generated inspection task.

Per seed:

1. **Primary model**: the project's inspection CNN (:mod:`fedge.models.inspection`),
   trained on the CPU (one thread) on generated scratch images (:mod:`fedge.datasets.defects`).
2. **Gate set**: held-out, in-distribution, labelled images, and ``relit_copies`` re-lit
   copies of each (:func:`fedge.monitoring.relight.relit_copies`, seeded per image and
   copy, labels unchanged) -- what a station reports to the gate. The MPP predictor
   (:mod:`fedge.monitoring.mpp`) is fitted on the :func:`~fedge.monitoring.mpp.
   feature_row` of all of them and whether the primary model got each right, as the
   manager fits it on the gate's ``evaluations`` rows: that is ``mpp``, the product's
   configuration. ``mpp_plain`` is fitted on the gate images only (the product before
   re-lit copies). The copies' family (random gain, offset and *linear* gradient,
   :data:`fedge.monitoring.relight.FAMILY`) contains the ``lighting_gradient`` scenario
   (other parameters, other draws) but not ``lighting_spot``, whose spotlight is not
   linear: the spot scenario is the honest test of how far the copies carry.
3. **Scenarios**, fresh images each: ``in_distribution``; ``lighting_gradient`` (the
   light moved to one side: a linear gradient of amplitude 0.6 in a random direction);
   ``lighting_spot`` (a dimmer lamp, gain 0.7, plus an off-centre spotlight of amplitude
   0.5, sigma 0.25 of the side); ``new_defect_dents`` (every defect is a dent, a defect
   shape the primary model never saw); ``new_defect_mixed`` (half the defects are
   dents). Each reports the true accuracy, the MPP estimate, the confidence baseline
   (mean top score), average thresholded confidence, and absolute errors.
4. **Drift streams**: the gate set's image statistics are the reference; a stream of
   in-distribution images is followed, at a known index, by shifted ones; :func:`fedge.
   monitoring.drift.detect` runs on a sliding window over the stream's image statistics.
   Reported: images after the shift until the first alert, per shift, and alerts on a
   purely in-distribution stream (false alerts).

Targets (issue 11): MPP within 0.03 of the true accuracy in distribution and within
0.08 under drift (every drift scenario), a drift alert within 200 images of the shift,
and no alert in distribution. :func:`run_mpp_seeds` reports medians over seeds.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fedge.bench import Progress, no_progress
from fedge.bench.machine import machine_info
from fedge.bench.mpp_images import SCENARIOS, STREAM_SHIFTS, Images, Labels, gate_relit
from fedge.datasets.defects import CLASSES, make_defect_images
from fedge.models.inspection import cpu_threads, predict_proba, train_inspection_model
from fedge.monitoring.drift import DriftPolicy, detect
from fedge.monitoring.features import IMAGE_STATS, image_stats
from fedge.monitoring.mpp import MppPredictor, calibration_estimate, feature_row
from fedge.monitoring.relight import FAMILY
from fedge.protocols.evaluation import DEFAULT_AUGMENT

TARGET_IN_DISTRIBUTION = 0.03
TARGET_UNDER_DRIFT = 0.08
TARGET_ALERT_IMAGES = 200
NOTES = (
    "mpp is what the manager fits: the gate rows and the re-lit copies stations score "
    "beside them (size.relit_copies per held-out image, fedge.monitoring.relight: random "
    "gain, offset and linear gradient, labels unchanged). lighting_gradient is inside that "
    "family (other parameters, other draws); lighting_spot (a spotlight) is not.",
    "mpp_plain is fitted on the gate rows only (the product before re-lit copies). Outside "
    "the gate's range of image statistics its logistic regression extrapolates linearly, "
    "so under lighting drift its error varies widely between seeds.",
    "new_defect_*: the primary model calls many dents clean with high confidence; no "
    "estimator built from scores and image statistics seen on scratch data can see that "
    "(all are far off); the input-drift alert is what catches it.",
)


@dataclass(frozen=True)
class MppBenchSize:
    """How big a run is; :data:`FULL` is the benchmark, tests use a tiny one."""

    train_images: int = 4000
    epochs: int = 4
    gate_images: int = 2000
    test_images: int = 2000
    stream_before: int = 1000
    stream_after: int = 400
    window: int = 100
    step: int = 10
    relit_copies: int = DEFAULT_AUGMENT  # per gate image, as a station reports them


FULL = MppBenchSize()


@dataclass(frozen=True)
class _Scored:
    labels: Labels
    probs: npt.NDArray[np.float32]
    rows: list[list[float]]
    stats: list[dict[str, float]]

    @property
    def correct(self) -> npt.NDArray[np.bool_]:
        result: npt.NDArray[np.bool_] = self.probs.argmax(axis=1) == self.labels
        return result

    def score_maps(self) -> list[dict[str, float]]:
        return [dict(zip(CLASSES, map(float, p), strict=True)) for p in self.probs]


def run_mpp(
    seed: int = 0, *, size: MppBenchSize = FULL, progress: Progress = no_progress
) -> dict[str, Any]:
    """One seed: primary model, MPP fits, every scenario and every drift stream."""
    started = time.perf_counter()
    # Disjoint seeds per data set: training, gate, scenarios, streams (the copies are
    # seeded by their image's key, as on a station).
    base = 1000 * seed
    progress(f"training the primary CNN on {size.train_images} images")
    train_x, train_y = make_defect_images(size.train_images, seed=base + 1)
    with cpu_threads(1):
        model = train_inspection_model(
            train_x, train_y, epochs=size.epochs, seed=seed, device="cpu"
        )
        train_s = time.perf_counter() - started

        def score(images: Images, labels: Labels) -> _Scored:
            probs = predict_proba(model, images)
            stats = [image_stats(image.astype(np.float32) / np.float32(255.0)) for image in images]
            scores = [dict(zip(CLASSES, map(float, p), strict=True)) for p in probs]
            rows = [feature_row(s, st) for s, st in zip(scores, stats, strict=True)]
            return _Scored(labels, probs, rows, stats)

        progress(
            f"scoring the gate set ({size.gate_images} images, {size.relit_copies} re-lit "
            "copies each), fitting MPP"
        )
        gate_x, gate_y = make_defect_images(size.gate_images, seed=base + 2)
        gate = score(gate_x, gate_y)
        plain = MppPredictor.fit(gate.rows, gate.correct.tolist(), seed=seed)
        relit: _Scored | None = None
        mpp = plain
        if size.relit_copies:
            relit_x = gate_relit(gate_x, base, size.relit_copies)
            relit = score(relit_x, np.repeat(gate_y, size.relit_copies))
            rows, correct = gate.rows + relit.rows, [*gate.correct, *relit.correct]
            mpp = MppPredictor.fit(rows, [bool(c) for c in correct], seed=seed)

        scenarios: dict[str, dict[str, Any]] = {}
        for index, (name, make) in enumerate(SCENARIOS.items()):
            progress(f"scenario {name}")
            scored = score(*make(size.test_images, base + 10 + 2 * index))
            scenarios[name] = _scenario_result(scored, mpp, plain)

        policy = DriftPolicy(min_window=size.window)
        reference = {name: [s[name] for s in gate.stats] for name in IMAGE_STATS}
        streams: dict[str, dict[str, Any]] = {}
        before_x, _ = make_defect_images(size.stream_before, seed=base + 30)
        for index, name in enumerate(STREAM_SHIFTS):
            progress(f"drift stream: in distribution, then {name}")
            after_x, _ = SCENARIOS[name](size.stream_after, base + 31 + index)
            stream = [image_stats(i.astype(np.float32) / 255.0) for i in (*before_x, *after_x)]
            streams[name] = _stream_result(reference, stream, size.stream_before, size, policy)
        progress("drift stream: in distribution only")
        clean_x, _ = make_defect_images(size.stream_before + size.stream_after, seed=base + 40)
        clean = [image_stats(i.astype(np.float32) / 255.0) for i in clean_x]
        in_distribution_stream = _stream_result(reference, clean, None, size, policy)

    checks = _checks(scenarios, streams, [in_distribution_stream])
    return {
        "benchmark": "mpp",
        "seed": seed,
        "size": dataclasses.asdict(size),
        "primary": {
            "model": "InspectionNet (fedge.models.inspection), CPU, 1 thread",
            "train_images": size.train_images,
            "epochs": size.epochs,
            "gate_accuracy": round(float(gate.correct.mean()), 4),
        },
        "mpp": {
            "fitted_on": (
                f"{size.gate_images} gate images + {size.relit_copies} re-lit copies of each "
                f"(fedge.monitoring.relight.relit_copies: gain U{FAMILY.gain} about the mean, "
                f"offset U{FAMILY.offset}, linear gradient U{FAMILY.gradient} in a random "
                "direction; seeded per image and copy, as a station does), labels unchanged"
            ),
            "relit_copies": size.relit_copies,
            "relit_accuracy": None if relit is None else round(float(relit.correct.mean()), 4),
        },
        "mpp_plain": {
            "fitted_on": f"{size.gate_images} gate images (in distribution) only",
            "atc_threshold": round(plain.atc_threshold, 6),
        },
        "scenarios": scenarios,
        "drift_policy": dataclasses.asdict(policy),
        "drift_streams": streams,
        "drift_in_distribution_stream": in_distribution_stream,
        "targets": {
            "mpp_abs_error_in_distribution_max": TARGET_IN_DISTRIBUTION,
            "mpp_abs_error_under_drift_max": TARGET_UNDER_DRIFT,
            "alert_within_images": TARGET_ALERT_IMAGES,
            "false_alerts_in_distribution": 0,
        },
        "checks": checks,
        "met_target": all(checks.values()),
        "checks_other_estimators": _other_checks(scenarios),
        "notes": list(NOTES),
        "wall_s": {"train": round(train_s, 2), "total": round(time.perf_counter() - started, 2)},
        "machine": machine_info(),
    }


def _scenario_result(scored: _Scored, mpp: MppPredictor, plain: MppPredictor) -> dict[str, Any]:
    accuracy = float(scored.correct.mean())
    estimates = {
        "mpp": mpp.estimate(scored.rows),
        "mpp_plain": plain.estimate(scored.rows),
        "calibration": calibration_estimate(scored.score_maps()),
        # ATC's threshold is set on the held-out images as they are (Garg et al.).
        "atc": plain.estimate_atc(scored.rows),
    }
    return {
        "images": len(scored.labels),
        "true_accuracy": round(accuracy, 4),
        "estimate": {k: round(v, 4) for k, v in estimates.items()},
        "abs_error": {k: round(abs(v - accuracy), 4) for k, v in estimates.items()},
        "predicted_defect_rate": round(float((scored.probs.argmax(axis=1) == 1).mean()), 4),
    }


def _stream_result(
    reference: dict[str, list[float]],
    stream: list[dict[str, float]],
    shift_at: int | None,
    size: MppBenchSize,
    policy: DriftPolicy,
) -> dict[str, Any]:
    """Slide a window over ``stream``; the first alert (and every alert before the shift)."""
    alerts_before_shift = 0
    first_alert: int | None = None
    features: list[str] = []
    windows = 0
    for end in range(size.window, len(stream) + 1, size.step):
        window = stream[end - size.window : end]
        current = {name: [s[name] for s in window] for name in IMAGE_STATS}
        drifted = [v.feature for v in detect(reference, current, policy) if v.drifted]
        windows += 1
        if not drifted:
            continue
        if shift_at is None or end <= shift_at:
            alerts_before_shift += 1
        elif first_alert is None:
            first_alert, features = end, drifted
    result: dict[str, Any] = {
        "images": len(stream),
        "windows": windows,
        "false_alerts": alerts_before_shift,
    }
    if shift_at is not None:
        result |= {
            "shift_at": shift_at,
            "first_alert_at": first_alert,
            "images_after_shift_to_alert": None if first_alert is None else first_alert - shift_at,
            "features": features,
        }
    return result


def _checks(
    scenarios: dict[str, dict[str, Any]],
    streams: dict[str, dict[str, Any]],
    in_distribution_streams: list[dict[str, Any]],
) -> dict[str, bool]:
    """The issue's targets, for the MPP the manager fits (gate rows and re-lit copies)."""
    checks = _estimator_checks(scenarios, "mpp")
    for name, stream in streams.items():
        delay = stream["images_after_shift_to_alert"]
        checks[f"alert_{name}"] = delay is not None and delay <= TARGET_ALERT_IMAGES
    checks["no_false_alert"] = all(
        s["false_alerts"] == 0 for s in [*streams.values(), *in_distribution_streams]
    )
    return checks


def _estimator_checks(scenarios: dict[str, dict[str, Any]], estimator: str) -> dict[str, bool]:
    """Accuracy targets for one estimator: 0.03 in distribution, 0.08 in each drift scenario."""
    return {
        f"{estimator}_{name}": scenario["abs_error"][estimator]
        <= (TARGET_IN_DISTRIBUTION if name == "in_distribution" else TARGET_UNDER_DRIFT)
        for name, scenario in scenarios.items()
    }


def run_mpp_seeds(
    seeds: int = 3, *, size: MppBenchSize = FULL, progress: Progress = no_progress
) -> dict[str, Any]:
    """:func:`run_mpp` on seeds ``0..seeds-1``; medians of errors and alert delays."""
    runs = [run_mpp(seed, size=size, progress=_labelled(progress, seed)) for seed in range(seeds)]
    scenarios: dict[str, dict[str, Any]] = {}
    for name in SCENARIOS:
        per_seed = [run["scenarios"][name] for run in runs]
        scenarios[name] = {
            "true_accuracy": _median(r["true_accuracy"] for r in per_seed),
            "estimate": {k: _median(r["estimate"][k] for r in per_seed) for k in _ESTIMATORS},
            "abs_error": {k: _median(r["abs_error"][k] for r in per_seed) for k in _ESTIMATORS},
            "abs_error_max": {k: max(r["abs_error"][k] for r in per_seed) for k in _ESTIMATORS},
        }
    streams: dict[str, dict[str, Any]] = {}
    for name in STREAM_SHIFTS:
        delays = [run["drift_streams"][name]["images_after_shift_to_alert"] for run in runs]
        found = [d for d in delays if d is not None]
        streams[name] = {
            "images_after_shift_to_alert": statistics.median(found) if found else None,
            "per_seed": delays,
            "max": max(found) if len(found) == len(delays) else None,
            "false_alerts": sum(run["drift_streams"][name]["false_alerts"] for run in runs),
        }
    false_alerts = sum(run["drift_in_distribution_stream"]["false_alerts"] for run in runs)
    checks = _checks(
        scenarios,
        streams,
        [run["drift_in_distribution_stream"] for run in runs],
    )
    return {
        "benchmark": "mpp",
        "seeds": list(range(seeds)),
        "statistic": "median over seeds (abs_error_max: worst seed)",
        "size": dataclasses.asdict(size),
        "gate_accuracy": _median(run["primary"]["gate_accuracy"] for run in runs),
        "scenarios": scenarios,
        "drift_policy": runs[0]["drift_policy"],
        "drift_streams": streams,
        "drift_in_distribution_false_alerts": false_alerts,
        "targets": runs[0]["targets"],
        "checks": checks,
        "checks_per_seed": {str(run["seed"]): run["checks"] for run in runs},
        "met_target": all(checks.values()),
        "checks_other_estimators": _other_checks(scenarios),
        "notes": list(NOTES),
        "per_seed": runs,
        "machine": runs[0]["machine"],
    }


def _labelled(progress: Progress, seed: int) -> Progress:
    return lambda line: progress(f"seed {seed}: {line}")


_ESTIMATORS = ("mpp", "mpp_plain", "calibration", "atc")


def _other_checks(scenarios: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """The same accuracy targets for the other estimators, for comparison only."""
    return {
        key: value
        for estimator in _ESTIMATORS[1:]
        for key, value in _estimator_checks(scenarios, estimator).items()
    }


def _median(values: Any) -> float:
    return round(float(statistics.median(list(values))), 4)
