"""Scoring prepared images with a loaded model: one ONNX Runtime call per batch.

Pure apart from the model call: the agent hands in the model and config it snapshotted,
gets back one :class:`Scored` per image, and commits the records together (one SQLite
transaction per batch, see :mod:`fedge.edge_agent.group_commit`). Batching is what keeps
the agent's path near bare ONNX Runtime: the per-prediction commit, not the model, was
most of the agent's overhead (BENCHMARKS.md §3).
"""

import logging
import math
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import numpy as np

from fedge.edge_agent.config.decisions import decide, thresholds_in_force
from fedge.edge_agent.errors import InferenceError
from fedge.edge_agent.inference.runtime import LoadedModel
from fedge.monitoring.features import image_stats_many
from fedge.protocols.config import EdgeConfig
from fedge.protocols.records import AnomalyScore, PredictionRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scored:
    record: PredictionRecord
    scores: np.ndarray


def batch_axis_is_dynamic(model: LoadedModel) -> bool:
    """Whether the model takes any batch size (else it is fed one image per call)."""
    first = model.manifest.inputs[0].shape[0] if model.manifest.inputs[0].shape else 1
    return not (isinstance(first, int) and first > 0)


def _shaped(image: np.ndarray) -> np.ndarray:
    """H x W -> 1 x H x W (one channel); C x H x W as it is."""
    if image.ndim == 2:
        return image[None, :, :]
    if image.ndim == 3:
        return image
    raise InferenceError(f"an image must be H x W or C x H x W, got shape {image.shape}")


def run(model: LoadedModel, images: Sequence[np.ndarray]) -> tuple[np.ndarray, float]:
    """Class probabilities for ``images`` (N x classes) and the model's ms per image.

    A model with a dynamic batch axis gets the whole batch in one call; one with a fixed
    batch of 1 gets a call per image.
    """
    probs, per_image_ms, _ = _run(model, images)
    return probs, per_image_ms


def _stacked(images: Sequence[np.ndarray]) -> np.ndarray | None:
    """The images as one N x C x H x W batch (None for none)."""
    if not images:
        return None
    shaped = [_shaped(np.asarray(image)) for image in images]
    if len({image.shape for image in shaped}) != 1:
        raise InferenceError("the images of one batch must have the same shape")
    return np.stack(shaped)


def _run(
    model: LoadedModel, images: Sequence[np.ndarray], batch: np.ndarray | None = None
) -> tuple[np.ndarray, float, np.ndarray | None]:
    """:func:`run`, and the stacked batch (N x C x H x W; ``batch`` if given)."""
    if batch is None:
        batch = _stacked(images)
    if batch is None:
        return np.empty((0, len(model.manifest.classes)), dtype=np.float32), 0.0, None
    started = time.perf_counter()
    if batch_axis_is_dynamic(model) or len(batch) == 1:
        probs = model.run(batch.astype(model.input_dtype, copy=False))
    else:
        probs = np.concatenate(
            [model.run(image.astype(model.input_dtype, copy=False)[None]) for image in batch]
        )
    per_image_ms = (time.perf_counter() - started) * 1000.0 / len(batch)
    if probs.ndim != 2 or probs.shape[0] != len(batch):
        raise InferenceError(
            f"{model.ref} returned shape {probs.shape} for a batch of {len(batch)}"
        )
    return probs, per_image_ms, batch


def record_for(
    model: LoadedModel,
    config: EdgeConfig | None,
    probs: np.ndarray,
    latency_ms: float,
    source: str,
    at: float,
    stats: dict[str, float] | None = None,
    anomaly: AnomalyScore | None = None,
) -> PredictionRecord:
    """The prediction record of one image's probabilities under the config in force.

    ``stats`` are the image's statistics (monitoring.features.image_stats): the manager
    watches them for input drift and estimates accuracy from them without labels.
    """
    classes = model.manifest.classes
    # Scores are clamped to [0, 1]: a model's float noise must not fail validation.
    scores = {
        name: min(1.0, max(0.0, float(p))) for name, p in zip(classes, probs.tolist(), strict=True)
    }
    # The config's thresholds, or the serving model's own when the config is tied to
    # another model version (decisions.thresholds_in_force).
    in_force = thresholds_in_force(config, model.manifest)
    decision = decide(scores, model.manifest.positive_classes, in_force)
    return PredictionRecord(
        prediction_id=f"p-{uuid.uuid4().hex}",
        at=at,
        model=model.ref,
        scores=scores,
        decision=decision.decision,
        threshold=decision.threshold,
        config_version=0 if config is None else config.version,
        latency_ms=latency_ms,
        source=source[:512],
        stats=stats,
        anomaly=anomaly,
    )


def score(
    model: LoadedModel,
    config: EdgeConfig | None,
    images: Sequence[np.ndarray],
    sources: Sequence[str],
    *,
    beside: Executor | None = None,
) -> list[Scored]:
    """Score ``images`` (prepared: H x W or C x H x W) into records, not yet stored.

    Where ``model`` carries an anomaly model (issue 28), the same prepared batch goes
    through it too, and each record holds its score, the anomaly model's version and the
    station's anomaly threshold in force; the latency is both models'.

    The image statistics are computed on the prepared batch (what the model saw). With
    ``beside`` (one worker thread) they are computed there while the model runs: ONNX
    Runtime releases the interpreter lock for the call, so on a host with a core to spare
    the statistics cost the line nothing (issue 25); without it, after the model call.
    Either way the measured latency stays the models' own.
    """
    if len(sources) != len(images):
        raise InferenceError(f"{len(images)} images but {len(sources)} sources")
    batch = _stacked(images)
    pending: Future[list[dict[str, float]]] | None = None
    if beside is not None and batch is not None:
        try:
            pending = beside.submit(image_stats_many, batch)
        except RuntimeError:  # the worker is shut down (the agent stopping): here, after
            pending = None
    probs, latency_ms, _ = _run(model, images, batch)
    anomalies: list[AnomalyScore | None] = [None] * len(images)
    if model.anomaly is not None and batch is not None:
        anomalies, anomaly_ms = _anomaly_scores(model.anomaly, config, batch)
        latency_ms += anomaly_ms
    at = time.time()
    if pending is not None:
        stats = pending.result()
    else:
        stats = [] if batch is None else image_stats_many(batch)
    return [
        Scored(record_for(model, config, row, latency_ms, source, at, image_stats, anomaly), row)
        for row, source, image_stats, anomaly in zip(probs, sources, stats, anomalies, strict=True)
    ]


def _anomaly_scores(
    anomaly: LoadedModel, config: EdgeConfig | None, batch: np.ndarray
) -> tuple[list[AnomalyScore | None], float]:
    """The anomaly model's score of every image of ``batch``, and its ms per image.

    The anomaly model is the classifier's companion: where it fails (it raises, answers
    the wrong shape, or gives an image a non-finite distance) those images get no anomaly
    score and the classifier's records stand -- a secondary model must not stop parts
    being scored, nor count against the classifier in a rollout's error rate. The scorer
    counts the images left without one (``anomaly.errors``).
    """
    started = time.perf_counter()
    try:
        scores = np.asarray(anomaly.run(batch.astype(anomaly.input_dtype, copy=False)))
    except Exception as exc:  # ONNX Runtime's own errors, or an InferenceError
        log.warning("anomaly model %s failed on a batch of %d: %s", anomaly.ref, len(batch), exc)
        return [None] * len(batch), (time.perf_counter() - started) * 1000.0 / len(batch)
    per_image_ms = (time.perf_counter() - started) * 1000.0 / len(batch)
    if scores.shape != (len(batch),):
        log.warning(
            "anomaly model %s returned shape %s for a batch of %d: no anomaly scores",
            anomaly.ref,
            scores.shape,
            len(batch),
        )
        return [None] * len(batch), per_image_ms
    # A threshold set for another anomaly model says nothing of this one's scores.
    threshold = None if config is None else config.anomaly_threshold_for(anomaly.ref)
    return [
        AnomalyScore(anomaly.ref, max(0.0, float(value)), threshold)
        if math.isfinite(value)
        else None
        for value in scores.tolist()
    ], per_image_ms
