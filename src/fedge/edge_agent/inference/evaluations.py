"""The gate's evaluations on the station: score held-out labelled images, report scores.

The manager asks (a signed, retained :class:`EvaluationRequest` on ``down/evaluate``, or
over gRPC without MQTT) for the candidate model and the model this station serves to be
scored on the station's held-out labelled images (``fedge.party.station_store``: the share a
station never trains on). Images never leave the station: the report carries per image
and model the class scores, the station's label and the image statistics
(``monitoring.features.image_stats``) of the prepared input. Each held-out image is also
scored as ``request.copies`` re-lit copies (``monitoring.relight.relit_copies``: random
gain, offset and lighting gradient, seeded by the image's id and the copy's index, so
every model scores the same copies), reported as items marked ``augmented``: the
manager's MPP predictor learns from them how accuracy falls as the lighting changes
(the gate itself ignores them). A report that would be too large loses copies first.

Each model is downloaded and verified exactly as a deployment does it
(:func:`fedge.edge_agent.deploy.deployer.prepare`: signed manifest, size, sha256, load, smoke
test) but into a working directory of its own, ``<data_dir>/evaluation``, and loaded in
an ONNX Runtime session of its own: nothing is activated, the serving session is not
touched, and a deployment's pruning of ``<data_dir>/models`` cannot delete a model
mid-evaluation (a model already there is hard-linked, not downloaded again). The
working directory is removed afterwards.

The report is published retained on ``up/evaluate`` (QoS 1), stored first in the agent's
store and re-stated by every new session, as the deploy status is: a manager that was
down or restarted gets it from the broker, a broker that lost it gets it again, and the
manager stores it once. Retained rather than the record outbox because it is a status
-- the answer to the latest request, superseding the previous one -- and the outbox's
numbered streams carry records. The stored report is also the "done" mark (its version):
after a restart a finished evaluation is neither lost (re-stated) nor run again (stale),
and an unfinished one runs again, as the request is still retained.
"""

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from fedge.edge_agent.deploy import deployer
from fedge.edge_agent.errors import AgentError, DeployError, InferenceError
from fedge.edge_agent.inference import batch as scoring
from fedge.edge_agent.inference import runtime
from fedge.edge_agent.inference.images import decode_for
from fedge.edge_agent.settings import AgentSettings
from fedge.edge_agent.store import LocalStore
from fedge.monitoring.features import image_stats
from fedge.monitoring.relight import relit_copies
from fedge.party.station_store import LabelledImage, StationData
from fedge.protocols import codec, topics
from fedge.protocols.deployment import DeploymentDesired
from fedge.protocols.errors import ProtocolError
from fedge.protocols.evaluation import (
    EvaluationItem,
    EvaluationReport,
    EvaluationRequest,
    EvaluationStatus,
)
from fedge.protocols.manifest import ModelManifest, Preprocess
from fedge.protocols.signing import TrustedKeys, open_signed

log = logging.getLogger(__name__)

Report = Callable[[topics.Up, bytes, bool], None]

LAST_REPORT_KEY = "last_evaluation_report"
WORK_DIR = "evaluation"
# What the manager decodes (codec.DEFAULT_MAX_BYTES), less a margin.
REPORT_MAX_BYTES = codec.DEFAULT_MAX_BYTES - 4096
BATCH = 32


class EvaluationFailed(AgentError):
    """The evaluation cannot be done; reported as ``failed`` with ``tag: detail``."""

    def __init__(self, tag: str, detail: str) -> None:
        super().__init__(f"{tag}: {detail}")


def fit_report(
    report: EvaluationReport, per_image: Sequence[tuple[EvaluationItem, ...]], limit: int
) -> EvaluationReport:
    """``report`` with the items of ``per_image`` (oldest image first) that fit ``limit``
    encoded bytes: the images as they are first, dropping the oldest images until those
    fit; then the re-lit copies (``augmented``) of as many of the newest kept images as
    still fit. The gate needs the former; the copies only sharpen the MPP fit."""
    images = [tuple(i for i in image if i.augmented is None) for image in per_image]
    copies = [tuple(i for i in image if i.augmented is not None) for image in per_image]
    while True:
        base = dataclasses.replace(report, items=tuple(i for image in images for i in image))
        if len(codec.encode(base)) <= limit or not images:
            break
        keep = len(images) * 3 // 4 if len(images) > 1 else 0
        images, copies = images[len(images) - keep :], copies[len(copies) - keep :]

    def with_copies(newest: int) -> EvaluationReport:
        extra = tuple(i for image in copies[len(copies) - newest :] for i in image)
        return dataclasses.replace(base, items=base.items + extra)

    # The most images whose copies still fit (a bisection: size grows with the count).
    low, high = 0, len(images)
    while low < high:
        middle = (low + high + 1) // 2
        if len(codec.encode(with_copies(middle))) <= limit:
            low = middle
        else:
            high = middle - 1
    return with_copies(low) if low else base


def check_classes(manifests: Sequence[ModelManifest]) -> None:
    """The models of one evaluation must name the same classes in the same order."""
    first = manifests[0]
    for other in manifests[1:]:
        if other.classes != first.classes:
            raise EvaluationFailed(
                "class_mismatch",
                f"{first.ref} has classes {','.join(first.classes)} but {other.ref} has "
                f"{','.join(other.classes)}",
            )


def _version_of(report: bytes | None) -> int:
    """The request version a stored report answers (0: none, or unreadable)."""
    if report is None:
        return 0
    try:
        return codec.decode(report, EvaluationReport).version
    except ProtocolError:
        return 0


class Evaluations:
    """One per agent: checks requests on the caller's thread, evaluates on its own."""

    def __init__(
        self,
        settings: AgentSettings,
        store: LocalStore,
        station: StationData,
        keys: TrustedKeys,
        counters: Counter[str],
        *,
        report: Report,
    ) -> None:
        self.settings = settings
        self.store = store
        self.station = station
        self.keys = keys
        self.counters = counters
        self._report = report
        self._lock = threading.Lock()  # one evaluation at a time; the store write commits
        self._publishing = threading.Lock()  # reports go out in the order they were stored
        stored = store.get(LAST_REPORT_KEY)
        # Re-stated (retained) by every new session, after the birth.
        self.last_report: bytes | None = None if stored is None else stored.encode()
        self._done_version = _version_of(self.last_report)

    @property
    def done_version(self) -> int:
        """The newest request version this station answered (done or failed)."""
        return self._done_version

    def handle(self, envelope: bytes) -> None:
        """A request (MQTT or gRPC): checked here, carried out on its own thread."""
        try:
            request = open_signed(envelope, EvaluationRequest, self.keys)
            if request.edge != self.settings.edge or request.fleet != self.settings.fleet:
                raise ProtocolError(f"evaluation is for {request.fleet}/{request.edge}")
        except ProtocolError as exc:
            # Nothing in it can be trusted, not even its id: counted and logged only.
            self.counters[f"evaluate.rejected.{exc.reason}"] += 1
            log.error("evaluation request rejected (%s): %s", exc.reason, exc)
            return
        if request.version <= self.done_version:
            self.counters["evaluate.stale"] += 1
            return
        threading.Thread(
            target=self.evaluate, args=(request,), name="evaluate", daemon=True
        ).start()

    def evaluate(self, request: EvaluationRequest) -> None:
        """Score the held-out images with every model of ``request``; publish the report.

        The store write under ``_lock`` is the commit point; the report is published
        after the lock is released, since the callback reaches paho and takes the gRPC
        poller's lock (holding ours across it could deadlock). A crash between the two
        loses nothing: the stored report is re-stated by every new session."""
        with self._lock:
            if request.version <= self.done_version:
                return
            started = time.monotonic()
            try:
                report = self._run(request)
            except EvaluationFailed as exc:
                report = self._failed(request, str(exc))
            except Exception as exc:  # a bug must still answer, or the gate waits in vain
                log.exception("evaluation %s failed unexpectedly", request.eval_id)
                report = self._failed(request, f"internal: {type(exc).__name__}: {exc}")
            finally:
                shutil.rmtree(self.settings.data_dir / WORK_DIR, ignore_errors=True)
            payload = codec.encode(report)
            # Stored first: a crash after this re-states it rather than losing it.
            self.store.put(LAST_REPORT_KEY, payload.decode())
            self.last_report, self._done_version = payload, report.version
            self.counters[f"evaluate.{report.status.value}"] += 1
        with self._publishing:
            # A newer report stored meanwhile publishes itself; never retain an older one.
            if self._done_version == report.version:
                self._report(topics.Up.EVALUATE, payload, True)
        log.info(
            "evaluation %s %s in %.1f s (%d items)%s",
            request.eval_id,
            report.status.value,
            time.monotonic() - started,
            len(report.items),
            f": {report.reason}" if report.reason else "",
        )

    def _failed(self, request: EvaluationRequest, reason: str) -> EvaluationReport:
        return EvaluationReport(
            self.settings.edge,
            request.eval_id,
            request.version,
            EvaluationStatus.FAILED,
            reason[:1000],
            self._holdout_count(),
            (),
            time.time(),
        )

    def _holdout_count(self) -> int:
        try:
            return sum(image.holdout for image in self.station.labelled())
        except Exception:  # only for a failure report: never mask the real reason
            return 0

    def _run(self, request: EvaluationRequest) -> EvaluationReport:
        held_out = [image for image in self.station.labelled() if image.holdout]
        if not held_out:
            raise EvaluationFailed(
                "no_holdout",
                "this station has no held-out labelled images (label some of the images "
                "it scored; a share of them is held out for evaluation)",
            )
        manifests = []
        for envelope in request.manifest_envelopes:
            try:
                manifests.append(deployer.open_manifest(envelope.encode(), self.keys))
            except DeployError as exc:
                raise EvaluationFailed("bad_manifest", str(exc)) from None
        check_classes(manifests)
        work = self.settings.data_dir / WORK_DIR
        shutil.rmtree(work, ignore_errors=True)  # a crashed evaluation's leftovers
        models = [
            self._prepare(request, envelope, manifest, work)
            for envelope, manifest in zip(request.manifest_envelopes, manifests, strict=True)
        ]
        chosen = held_out[-request.max_images :]  # the newest: the line as it is now
        per_model = [self._score(model, chosen, request.copies) for model in models]
        per_image: list[tuple[EvaluationItem, ...]] = []
        unreadable = 0
        for index in range(len(chosen)):
            complete = [scored[index] for scored in per_model if scored[index] is not None]
            if len(complete) == len(models):
                per_image.append(tuple(item for items in complete if items for item in items))
            else:
                unreadable += 1
        if not per_image:
            raise EvaluationFailed(
                "unreadable", f"none of the {len(chosen)} held-out images could be scored"
            )
        reason = f"{unreadable} held-out image(s) unreadable, left out" if unreadable else ""
        report = EvaluationReport(
            self.settings.edge,
            request.eval_id,
            request.version,
            EvaluationStatus.DONE,
            reason,
            len(held_out),
            (),
            time.time(),
        )
        return fit_report(report, per_image, REPORT_MAX_BYTES)

    def _prepare(
        self, request: EvaluationRequest, envelope: str, manifest: ModelManifest, work: Path
    ) -> runtime.LoadedModel:
        """Download (or reuse) and verify one model into ``work``; load it, not activate."""
        relative = Path("models") / manifest.name / str(manifest.version) / "model.onnx"
        existing, target = self.settings.data_dir / relative, work / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        # Verified again below like a download; when the station lacks it (or it was
        # pruned meanwhile) it is downloaded instead.
        with contextlib.suppress(OSError):
            os.link(existing, target)
        desired = DeploymentDesired(
            self.settings.fleet,
            self.settings.edge,
            request.version,
            request.eval_id,
            envelope,
            request.grpc_target,
            request.issued_at,
        )
        eval_settings = dataclasses.replace(self.settings, data_dir=work)
        try:
            return deployer.prepare(desired, eval_settings, self.keys, lambda _s, _r: None)
        except DeployError as exc:
            raise EvaluationFailed(exc.reason, f"{manifest.ref}: {exc.detail}") from None

    def _score(
        self, model: runtime.LoadedModel, images: Sequence[LabelledImage], copies: int
    ) -> list[tuple[EvaluationItem, ...] | None]:
        """Per image, in order: its item, then those of its ``copies`` re-lit copies (None
        where the image cannot be read)."""
        preprocess = model.manifest.preprocess or Preprocess(image_size=self.settings.image_size)
        classes = model.manifest.classes
        results: list[tuple[EvaluationItem, ...] | None] = []
        for start in range(0, len(images), BATCH):
            batch = images[start : start + BATCH]
            prepared: list[tuple[LabelledImage, list[np.ndarray]] | None] = []
            for image in batch:
                try:
                    array = decode_for(image.path, preprocess)
                except (InferenceError, OSError) as exc:
                    self.counters["evaluate.unreadable"] += 1
                    log.warning("held-out image %s not scored: %s", image.prediction_id, exc)
                    prepared.append(None)
                    continue
                variants = [array, *relit(array, preprocess, image.prediction_id, copies)]
                prepared.append((image, variants))
            inputs = [array for entry in prepared if entry is not None for array in entry[1]]
            try:
                probs, _ = scoring.run(model, inputs)
            except InferenceError as exc:
                raise EvaluationFailed("inference_failed", str(exc)) from None
            rows = iter(probs.tolist())
            for entry in prepared:
                if entry is None:
                    results.append(None)
                    continue
                image, variants = entry
                items: list[EvaluationItem] = []
                own_rows = [next(rows) for _ in variants]  # consumed whatever happens below
                for copy, (array, row) in enumerate(zip(variants, own_rows, strict=True)):
                    scores = {
                        name: round(min(1.0, max(0.0, float(p))), 6)
                        for name, p in zip(classes, row, strict=True)
                    }
                    try:
                        items.append(
                            EvaluationItem(
                                image.prediction_id,
                                model.ref,
                                image.label,
                                scores,
                                image_stats(array),
                                copy or None,
                            )
                        )
                    except ProtocolError as exc:  # e.g. a label that is no class name
                        log.warning("held-out image %s not reported: %s", image.prediction_id, exc)
                        break
                # An image is reported with all its copies or not at all.
                if len(items) == len(variants):
                    results.append(tuple(items))
                else:
                    self.counters["evaluate.unreadable"] += 1
                    results.append(None)
        return results


def relit(array: np.ndarray, preprocess: Preprocess, key: str, copies: int) -> list[np.ndarray]:
    """``copies`` re-lit copies of one prepared model input (:func:`fedge.monitoring.
    relight.relit_copies` on its 8-bit intensities), prepared the same way."""
    if copies <= 0 or preprocess.scale <= 0:
        return []  # a scale of 0 makes every input constant: nothing to re-light
    full = 255.0 * preprocess.scale
    return [
        (copy * full).astype(array.dtype)
        for copy in relit_copies(array.astype(np.float64) / full, key, copies)
    ]
