"""The agent's scoring path: image files in, predictions recorded, images kept.

:class:`Scorer` decodes files as the serving model's manifest says, scores them in one
model call (:mod:`fedge.edge_agent.inference.batch`), records the predictions in one commit
shared with concurrent callers (:mod:`fedge.edge_agent.group_commit`) and keeps each
image in the station's training set. The serving model and the config in force are the
agent's :class:`~fedge.edge_agent.serving.ServingState`; the scorer reads each once per
call. Where that config shares thumbnails, a scored file's thumbnail is queued too
(thumbnails.py).
"""

import logging
import os
import sqlite3
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from fedge.edge_agent.config.decisions import (
    ThresholdsInForce,
    ThresholdSource,
    thresholds_in_force,
)
from fedge.edge_agent.errors import InferenceError, NotServingError, StorageError
from fedge.edge_agent.group_commit import GroupCommit
from fedge.edge_agent.inference import batch as scoring
from fedge.edge_agent.inference import runtime
from fedge.edge_agent.inference.batch import Scored
from fedge.edge_agent.inference.images import decode_for
from fedge.edge_agent.inference.thumbnails import ThumbnailSharer
from fedge.edge_agent.serving import ServingState
from fedge.edge_agent.settings import AgentSettings
from fedge.edge_agent.store import LocalStore
from fedge.party.errors import StationDataError
from fedge.party.station_store import StationData
from fedge.protocols.manifest import Preprocess
from fedge.protocols.records import PredictionRecord

log = logging.getLogger(__name__)


# (model, its raw score rows, their latencies in ms, images it failed on, per scored image
# whether its anomaly model could not score it: a pair on probation is judged whole,
# issue 28).
Observer = Callable[[runtime.LoadedModel, np.ndarray, Sequence[float], int, Sequence[bool]], None]


@dataclass(frozen=True)
class ImageFile:
    """An image file's bytes as a camera or the station's software handed them over."""

    data: bytes
    suffix: str  # ".png", ".jpg", ...: how the kept training copy is named
    source: str = ""  # recorded with the prediction (e.g. "file:<name>")
    # Which inbox arrival this is, kept with the prediction on the station only (a reused
    # file name is a new arrival; see fedge.edge_agent.inference.watcher.arrival_key).
    arrival: str = ""


class Scorer:
    def __init__(
        self,
        settings: AgentSettings,
        store: LocalStore,
        station: StationData,
        counters: Counter[str],
        *,
        serving: ServingState,
        observe: Observer | None = None,
    ) -> None:
        self.settings = settings
        self.station = station
        self.counters = counters
        self._serving = serving
        # Told of every model call (the probation of a new model,
        # fedge.edge_agent.deploy.probation).
        self._observe = observe
        self._untied_seen: set[tuple[int, str]] = set()
        # Thumbnails of scored files, only while the config in force shares them.
        self.thumbnails = ThumbnailSharer(store, counters)
        # The image statistics are computed on this worker while the model runs, where
        # the host has a core for it (batch.score says why); on one core, after the call.
        self._beside = (
            ThreadPoolExecutor(1, thread_name_prefix="image-stats")
            if (os.cpu_count() or 1) > 1
            else None
        )
        # (record, inbox arrival) pairs: the arrival commits with its prediction.
        self.commits: GroupCommit[tuple[PredictionRecord, str]] = GroupCommit(
            lambda items: store.add_predictions(
                [record for record, _ in items], [arrival for _, arrival in items]
            )
        )

    def close(self) -> None:
        if self._beside is not None:
            self._beside.shutdown(wait=True)

    def _check_untied(self, in_force: ThresholdsInForce) -> None:
        """A config set for another model applies as the serving one has none: counted
        and logged once per (config version, model)."""
        if in_force.source is not ThresholdSource.UNTIED:
            return
        key = (in_force.config_version, in_force.model)
        if key in self._untied_seen:
            return
        self._untied_seen.add(key)
        self.counters["thresholds.untied"] += 1
        log.warning(
            "config v%d sets thresholds for %s but %s serves and recommends none: "
            "applying them untied; set a threshold for %s (fedge edge set-threshold)",
            in_force.config_version,
            in_force.tied_to,
            in_force.model,
            in_force.model,
        )

    def preprocess_for(self, model: runtime.LoadedModel) -> Preprocess:
        """How ``model`` wants its images (its manifest, else agent.toml's size)."""
        return model.manifest.preprocess or Preprocess(image_size=self.settings.image_size)

    def score_image(
        self, data: bytes, *, suffix: str, source: str = "", keep: bool = True
    ) -> Scored:
        """Decode an image file's bytes as the serving model says, score it, keep it.

        The image is kept in the station's training set (bounded by retention) under the
        prediction's id, so an operator's label for the prediction makes it a training
        example. It stays on the station. With ``keep=False`` the caller keeps it later
        (:meth:`keep`): the local API replies first (local_api.py says why).
        """
        (result,) = self.score_images([ImageFile(data, suffix, source)], keep=keep)
        if isinstance(result, InferenceError):
            raise result
        return result

    def score_images(
        self, files: Sequence[ImageFile], *, keep: bool = True
    ) -> list[Scored | InferenceError]:
        """:meth:`score_image` for several files: one model call and one commit for all.

        One result per file, in order: its :class:`Scored`, or the error that kept it
        from being scored (an undecodable file fails alone, not the batch).
        """
        model = self._serving.model  # one snapshot: a deployment may swap it meanwhile
        if model is None:
            raise NotServingError("no model deployed yet; deploy one with `fedge deploy`")
        preprocess = self.preprocess_for(model)
        results: dict[int, Scored | InferenceError] = {}
        decoded: list[tuple[int, np.ndarray]] = []
        for index, file in enumerate(files):
            try:
                decoded.append((index, decode_for(file.data, preprocess)))
            except InferenceError as exc:
                results[index] = exc
        scored = self.score_many(
            [image for _, image in decoded],
            [files[i].source for i, _ in decoded],
            model=model,
            arrivals=[files[i].arrival for i, _ in decoded],
        )
        for (index, _), item in zip(decoded, scored, strict=True):
            results[index] = item
            if keep:
                self.keep(item.record, files[index])
        return [results[index] for index in range(len(files))]

    def keep(self, record: PredictionRecord, file: ImageFile) -> None:
        """What follows a recorded prediction of an image file: its training copy, and
        its thumbnail where the config in force shares them. Never raises: the
        prediction is recorded already."""
        config = self._serving.config
        self._keep_for_training(record, file)
        self.thumbnails.offer(None if config is None else config.thumbnails, record, file.data)

    def _keep_for_training(self, record: PredictionRecord, file: ImageFile) -> None:
        try:
            self.station.keep(record.prediction_id, file.data, file.suffix, record.at)
        except (StationDataError, OSError, sqlite3.Error) as exc:
            # Scoring succeeded and is recorded; only the training copy is lost.
            self.counters["station.keep_failed"] += 1
            log.error("could not keep %s for training: %s", record.prediction_id, exc)

    def score(
        self, image: np.ndarray, source: str = "", *, model: runtime.LoadedModel | None = None
    ) -> Scored:
        """Score one image (H x W, or C x H x W; float, prepared) and record the prediction.

        ``model`` is the model the image was prepared for (default: the serving one).
        """
        return self.score_many([image], [source], model=model)[0]

    def score_many(
        self,
        images: Sequence[np.ndarray],
        sources: Sequence[str] | None = None,
        *,
        model: runtime.LoadedModel | None = None,
        arrivals: Sequence[str] | None = None,
    ) -> list[Scored]:
        """Score prepared images in one model call and record them in one commit.

        Every record is durable when this returns, with its inbox arrival (if any).
        Calls from several threads at once share commits
        (:mod:`fedge.edge_agent.group_commit`).
        """
        model, config = model or self._serving.model, self._serving.config
        if model is None:
            raise NotServingError("no model deployed yet; deploy one with `fedge deploy`")
        keys = [""] * len(images) if arrivals is None else list(arrivals)
        if len(keys) != len(images):
            raise InferenceError(f"{len(images)} images but {len(keys)} arrivals")
        self._check_untied(thresholds_in_force(config, model.manifest))
        try:
            scored = scoring.score(
                model, config, images, sources or [""] * len(images), beside=self._beside
            )
        except InferenceError:
            # The model failed on images it was given (a staged rollout's error_rate).
            self.counters["inference.errors"] += len(images)
            if self._observe is not None:
                self._observe(model, np.empty((0, 0)), [], len(images), ())
            raise
        unscored = () if model.anomaly is None else [s.record.anomaly is None for s in scored]
        if self._observe is not None and scored:
            rows = np.stack([s.scores for s in scored])
            self._observe(model, rows, [s.record.latency_ms for s in scored], 0, unscored)
        try:
            self.commits.submit([(s.record, key) for s, key in zip(scored, keys, strict=True)])
        except sqlite3.Error as exc:
            # Rolled back: none of these predictions exists, and the caller is told so
            # (an inbox file stays in the inbox, an API client gets a 503 and retries).
            self.counters["store.write_failed"] += 1
            raise StorageError(
                f"predictions not recorded ({exc}); is the disk under "
                f"{self.settings.data_dir} full?"
            ) from None
        for item in scored:
            self.counters[f"decision.{item.record.decision}"] += 1
        if model.anomaly is not None:  # images its companion could not score (batch.py)
            self.counters["anomaly.errors"] += sum(unscored)
        return scored
