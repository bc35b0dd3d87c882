"""The anomaly model beside the classifier, as a station serves them (issue 28, items 3-4).

Two figures of ``fedge bench anomaly`` come from here, both through the code that runs in
production, not a copy of it:

- **Novel-defect detection.** Both models exported to ONNX and loaded by the agent's own
  runtime as one serving pair (:mod:`fedge.edge_agent.inference.runtime`), images scored
  by the agent's scoring function (:func:`fedge.edge_agent.inference.batch.score`, which
  writes each record's anomaly score and the station's threshold in force), one image per
  call as a line camera sends them. A dent stream: ``warmup`` in-distribution parts (good
  parts and the scratches the classifier knows), then the same with dents at ``rate``;
  ``dent_streams`` of them, each its own draw. After every image the manager's rules
  judge the newest ``window`` records exactly as the monitor's tick does: the
  ``novel_rate`` CUSUM (:mod:`fedge.edge_manager.monitor.novel`) and the input/score
  drift alerts (:func:`fedge.edge_manager.monitor.rules.drift_findings`) against the
  first ``window`` parts as their reference. ``novel_alert_images`` and
  ``mpp_drift_alert_images`` are the medians over the dent streams of the images since
  the first dent until each alert fires (a stream without one counts as never).
  ``false_alerts`` counts ``novel_rate`` alerts on in-distribution streams of the same
  length (no dents), and on dent streams before their first dent. ``dents_called_clean``
  and ``dents_novel`` say what the alert had to go on: a dent is novel when its anomaly
  score is over the threshold and the classifier called it clean or rejected it without
  confidence (``PredictionRecord.novel``).
- **Serving cost.** The same function on the classifier alone against the pair, one image
  per call, interleaved rounds, median ms per image; the ratio is the pair's cost.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fedge.datasets.defects import make_defect_images
from fedge.edge_agent.inference import batch as scoring
from fedge.edge_agent.inference import runtime
from fedge.edge_manager.monitor.novel import STRONGLY_NOVEL, grade, novel_finding
from fedge.edge_manager.monitor.rules import MonitorPolicy, WindowRow, drift_findings
from fedge.protocols.config import EdgeConfig
from fedge.protocols.manifest import ModelManifest, Preprocess, TensorSpec
from fedge.protocols.records import PredictionRecord

WINDOW = 100  # the manager's monitor_min_window default


@dataclass(frozen=True)
class StreamSize:
    warmup: int = 200  # in distribution, before the first dent (the drift reference and more)
    after: int = 200  # parts after the first dent
    rate: float = 0.10  # dents among them
    dent_streams: int = 5  # streams with dents, each its own draw of parts and dents
    clean_streams: int = 5


def load_pair(
    classifier_onnx: Path, anomaly_onnx: Path, image_size: int
) -> tuple[runtime.LoadedModel, runtime.LoadedModel]:
    """The classifier alone, and the classifier with the anomaly model beside it, loaded
    and checked by the agent's runtime as a deployment loads them."""
    preprocess = Preprocess(image_size=image_size)
    image = TensorSpec("image", "float32", ("batch", 1, image_size, image_size))

    def manifest(
        path: Path, name: str, outputs: tuple[TensorSpec, ...], classes: tuple[str, ...]
    ) -> ModelManifest:
        data = path.read_bytes()
        return ModelManifest(
            name=name,
            version=1,
            sha256=hashlib.sha256(data).hexdigest(),
            size=len(data),
            inputs=(image,),
            outputs=outputs,
            classes=classes,
            positive_classes=classes[1:],
            preprocess=preprocess,
        )

    classifier = runtime.load(
        classifier_onnx,
        manifest(
            classifier_onnx,
            "inspect",
            (TensorSpec("probs", "float32", ("batch", 2)),),
            ("clean", "scratch"),
        ),
        (),
    )
    runtime.smoke_test(classifier)
    anomaly = runtime.load(
        anomaly_onnx,
        manifest(
            anomaly_onnx,
            "inspect-anomaly",
            (TensorSpec("score", "float32", ("batch",)),),
            ("good", "anomalous"),
        ),
        (),
    )
    runtime.check_anomaly(classifier, anomaly)
    return classifier, classifier.with_anomaly(anomaly)


def _prepared(images: npt.NDArray[np.uint8]) -> list[npt.NDArray[np.float32]]:
    return [(x.astype(np.float32) / np.float32(255.0))[None] for x in images]


def _stream(
    seed: int, size: StreamSize, with_dents: bool
) -> tuple[list[npt.NDArray[np.float32]], list[int]]:
    """The stream's images and the indices of its dents (first to last; none: [])."""
    rng = np.random.default_rng(seed)
    warm, _ = make_defect_images(size.warmup, seed=seed, scratch_fraction=0.3)
    normal, _ = make_defect_images(size.after, seed=seed + 1, scratch_fraction=0.3)
    after = list(normal)
    dent_at: list[int] = []
    if with_dents:
        dents, _ = make_defect_images(
            size.after, seed=seed + 2, scratch_fraction=1.0, dent_fraction=1.0
        )
        is_dent = rng.random(size.after) < size.rate
        is_dent[int(np.argmax(is_dent)) if is_dent.any() else 0] = True
        after = [d if flag else n for d, n, flag in zip(dents, normal, is_dent, strict=True)]
        dent_at = [size.warmup + int(i) for i in np.flatnonzero(is_dent)]
    return _prepared(np.concatenate([warm, np.stack(after)])), dent_at


def _outcomes(records: Sequence[PredictionRecord], policy: MonitorPolicy) -> list[int | None]:
    """Each record's outcome as the monitor grades it from the manager's columns."""
    return [
        None
        if r.anomaly is None or r.anomaly.threshold is None
        else grade(r.novel, r.anomaly.score, r.anomaly.threshold, policy.novel)
        for r in records
    ]


def _row(record: PredictionRecord) -> WindowRow:
    return WindowRow(record.scores, record.stats, record.at)


def judge_stream(
    pair: runtime.LoadedModel,
    config: EdgeConfig,
    images: Sequence[npt.NDArray[np.float32]],
    dent_at: Sequence[int],
    *,
    drift: bool = True,
) -> dict[str, Any]:
    """Score ``images`` one per call with the pair; after each, the monitor's findings on
    the newest window. Images from the first dent until each alert first fires; how many
    dents the classifier called clean and how many dents were novel
    (``PredictionRecord.novel``)."""
    first_dent = dent_at[0] if dent_at else -1
    policy = MonitorPolicy()
    records: list[PredictionRecord] = []
    fired: dict[str, int] = {}
    start = max(first_dent, 0)
    early = False  # the novel_rate alert held before the first dent: a false alert
    for index, image in enumerate(images):
        (scored,) = scoring.score(pair, config, [image], [""])
        records.append(scored.record)
        if len(records) < WINDOW:
            continue
        window = records[-WINDOW:]
        novel = novel_finding(_outcomes(window, policy), policy.novel)
        if "novel_rate" not in fired and novel.holds:
            if index < first_dent:
                early = True
            else:
                fired["novel_rate"] = index + 1 - start
        if drift and "drift" not in fired and index >= 2 * WINDOW - 1:
            reference = [_row(r) for r in records[:WINDOW]]
            current = [_row(r) for r in records[WINDOW:][-WINDOW:]]
            findings = drift_findings(reference, current, policy.drift, reference_source="first")
            if any(f.holds for f in findings):
                fired["drift"] = index + 1 - start
    novel_parts = sum(r.novel for r in records)
    strong = sum(o == STRONGLY_NOVEL for o in _outcomes(records, policy))
    dents = [records[i] for i in dent_at]
    return {
        "images": len(records),
        "first_dent_at": first_dent,
        "novel_parts": novel_parts,
        "strongly_novel_parts": strong,
        "dents": len(dents),
        "dents_called_clean": sum(r.decision == "accept" for r in dents),
        "dents_novel": sum(r.novel for r in dents),
        "novel_alert_images": fired.get("novel_rate"),
        "novel_alert_before_first_dent": early,
        "drift_alert_images": fired.get("drift"),
    }


def _median_delay(delays: Sequence[int | None]) -> float | None:
    """The median of alert delays, a stream without an alert counting as never (None
    when the median stream saw none)."""
    value = statistics.median(math.inf if d is None else d for d in delays)
    return None if math.isinf(value) else value


def novel_detection(
    pair: runtime.LoadedModel, threshold: float, seed: int, size: StreamSize = StreamSize()
) -> dict[str, Any]:
    """The dent streams and the in-distribution streams (module docstring): the median
    delay over the dent streams, and every false alert (on a clean stream, or on a dent
    stream before its first dent)."""
    config = EdgeConfig(fleet="bench", edge="st-01", version=1, anomaly_threshold=threshold)
    dented = []
    for stream in range(size.dent_streams):
        images, dent_at = _stream(seed + 10 * stream, size, with_dents=True)
        dented.append(judge_stream(pair, config, images, dent_at))
    clean = []
    for stream in range(size.clean_streams):
        images, _ = _stream(seed + 100 * (stream + 1), size, with_dents=False)
        clean.append(judge_stream(pair, config, images, [], drift=False))
    delays = [s["novel_alert_images"] for s in dented]
    return {
        "method": (
            "agent runtime + batch.score one image per call; after each image the monitor's "
            f"rules on the newest {WINDOW} records (novel_rate CUSUM; input/score drift "
            f"against the first {WINDOW}); medians over the dent streams, a stream without "
            "an alert counting as never"
        ),
        "stream": {"warmup": size.warmup, "after": size.after, "dent_rate": size.rate},
        "anomaly_threshold": round(threshold, 4),
        "novel_alert_images": _median_delay(delays),
        "novel_alert_images_per_stream": delays,
        "novel_alert_within_30_share": sum(d is not None and d <= 30 for d in delays) / len(delays),
        "mpp_drift_alert_images": _median_delay([s["drift_alert_images"] for s in dented]),
        "mpp_drift_alert_images_per_stream": [s["drift_alert_images"] for s in dented],
        "dent_streams": [
            {
                key: s[key]
                for key in (
                    "novel_parts",
                    "strongly_novel_parts",
                    "dents",
                    "dents_called_clean",
                    "dents_novel",
                )
            }
            for s in dented
        ],
        "false_alerts": sum(s["novel_alert_images"] is not None for s in clean)
        + sum(s["novel_alert_before_first_dent"] for s in dented),
        "clean_streams": size.clean_streams,
        "novel_parts_clean_streams": [s["novel_parts"] for s in clean],
        "strongly_novel_parts_clean_streams": [s["strongly_novel_parts"] for s in clean],
    }


def serving_cost(
    classifier: runtime.LoadedModel,
    pair: runtime.LoadedModel,
    images: Sequence[npt.NDArray[np.float32]],
    rounds: int,
) -> dict[str, Any]:
    """ms per image through :func:`batch.score`, one image per call: alone vs the pair."""
    config = EdgeConfig(fleet="bench", edge="st-01", version=1, anomaly_threshold=1.0)
    sides = {"classifier": classifier, "with_anomaly": pair}
    for model in sides.values():  # warm-up
        for image in images[:20]:
            scoring.score(model, config, [image], [""])
    per_round: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, model in sides.items():
            started = time.perf_counter()
            for image in images:
                scoring.score(model, config, [image], [""])
            per_round[name].append((time.perf_counter() - started) / len(images) * 1e3)
    median = {name: statistics.median(values) for name, values in per_round.items()}
    return {
        "method": (
            "the agent's scoring path (runtime-loaded pair, batch.score: decode excluded, "
            "records and image statistics included), one image per call, "
            "median of interleaved rounds"
        ),
        "ms_per_image": {name: round(value, 4) for name, value in median.items()},
        "ratio": round(median["with_anomaly"] / median["classifier"], 3),
        "rounds": rounds,
        "images_per_round": len(images),
    }


def prepared_images(count: int, seed: int) -> list[npt.NDArray[np.float32]]:
    images, _ = make_defect_images(count, seed=seed, scratch_fraction=0.3)
    return _prepared(images)
