"""A plant-like fleet for the console benchmark and the README's picture.

Every column of the fleet page has something to show, as on a real line: most stations
online, some lost (their will), a few enrolled but never seen; two model versions
served; thresholds that differ; configs pushed but not yet applied; predictions with
different reject rates; labels that mostly agree with the decision (and some defects the
model missed); a gap in a few record streams. Who is what is a pure function of the
station's index (:func:`plan`); :func:`fill` stores it through the manager's real
ingest (the bytes an agent publishes, the code ``manager serve`` runs on them), with the
configs pushed and the models published through the library, as the CLI does.
"""

import logging
import secrets
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.ingest import records as ingest_records
from fedge.edge_manager.ingest.messages import Ingestor, Verdict
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.models.tiny_onnx import build_linear_classifier
from fedge.protocols import codec, topics
from fedge.protocols.config import ConfigReport, ConfigStatus
from fedge.protocols.liveness import EdgeState, Liveness
from fedge.protocols.records import LabelRecord, PredictionRecord, Record, RecordBatch, Stream

MODEL = "inspect"
VERSIONS = (1, 2)
CLASSES = ("clean", "scratch")
BATCH = 10  # predictions per record batch, as an agent's outbox seals them when idle
THRESHOLDS = (0.5, 0.55, 0.6, 0.65)


@dataclass(frozen=True)
class EdgePlan:
    edge: str
    seen: bool  # False: enrolled, never connected
    state: EdgeState
    serving: str
    threshold: float
    pending: bool  # a newer config pushed that the station has not applied yet
    predictions: int
    reject_every: int  # every n-th prediction is a reject
    labelled: int  # predictions an operator labelled at the station
    missed: int  # of those, accepted parts labelled as scratches (the model missed them)
    gap: bool  # one record batch never arrived
    seen_ago_s: float

    @property
    def delivered(self) -> int:
        """Predictions the manager stores: all but the (full) batch lost on the way."""
        return self.predictions - (BATCH if self.gap else 0)


def plan(index: int) -> EdgePlan:
    """Station ``index`` (1, 2, ...): small moduli, so a dozen stations already show
    every kind of row and a thousand show them in plant-like proportions."""
    seen = index % 25 != 9
    lost = seen and index % 10 == 7
    predictions = 0 if not seen else 10 + (index * 7) % 21
    labelled = min(predictions, 6) if index % 4 == 1 else 0
    return EdgePlan(
        edge=f"st-{index:04d}",
        seen=seen,
        state=EdgeState.LOST if lost else EdgeState.ONLINE,
        serving=f"{MODEL}:{VERSIONS[1] if index % 3 == 0 else VERSIONS[0]}",
        threshold=THRESHOLDS[index % len(THRESHOLDS)],
        pending=index % 6 == 4,
        predictions=predictions,
        reject_every=5 + index % 8,
        labelled=labelled,
        missed=1 if labelled and index % 8 == 5 else 0,
        gap=seen and index % 8 == 3 and predictions > 2 * BATCH,
        seen_ago_s=(600.0 + index % 50 * 60.0) if lost else float(index % 30),
    )


def publish_models(fleet: Fleet, root: Path) -> None:
    """Two versions of a small ONNX classifier (no torch), the second from the first."""
    for version in VERSIONS:
        source = build_linear_classifier(
            root / f"{MODEL}-v{version}.onnx", n_classes=len(CLASSES), seed=version
        )
        fleet.registry.publish(
            source, name=MODEL, version=version, classes=CLASSES, positive_classes=("scratch",)
        )


@contextmanager
def _quiet_gaps() -> Iterator[None]:
    """The planned gaps are not news: keep ingest's per-gap warning off the terminal."""
    logger = logging.getLogger(ingest_records.__name__)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def fill(fleet: Fleet, plans: list[EdgePlan], now: float) -> None:
    """Enroll ``plans``' stations, push their configs and ingest what they report."""
    with fleet.store.transaction():
        for p in plans:
            fleet.enroll(p.edge, secrets.token_urlsafe(12))
    by_threshold: dict[float, list[str]] = defaultdict(list)
    for p in plans:
        by_threshold[p.threshold].append(p.edge)
    applied = {
        push.edge: push.version
        for threshold, edges in sorted(by_threshold.items())
        for push in fleet.set_threshold(edges, threshold)
    }
    pending = [p.edge for p in plans if p.pending]
    if pending:
        fleet.set_threshold(pending, 0.7)  # pushed; these stations have not applied it
    ingestor = Ingestor(fleet.store, fleet.fleet)
    with _quiet_gaps(), IngestTransaction.open(fleet.store) as tx:
        for p in plans:
            if not p.seen:
                continue
            at = now - p.seen_ago_s
            for kind, payload in _messages(p, applied[p.edge], at):
                outcome = ingestor.handle(tx, topics.up(fleet.fleet, p.edge, kind), payload, at)
                if outcome.verdict is not Verdict.STORED:
                    raise RuntimeError(f"ingest refused {p.edge}/{kind.value}: {outcome}")


def _messages(p: EdgePlan, version: int, at: float) -> Iterator[tuple[topics.Up, bytes]]:
    """What station ``p`` published, in the order it did (its last will last)."""
    yield (
        topics.Up.STATE,
        codec.encode(Liveness(p.edge, 1, EdgeState.ONLINE, "0", p.serving, 0, at)),
    )
    report = ConfigReport(p.edge, ConfigStatus.APPLIED, version, version, "", at)
    yield topics.Up.CONFIG, codec.encode(report)
    records: list[PredictionRecord] = [
        PredictionRecord(
            f"{p.edge}-{k}",
            at - (p.predictions - k) * 3.0,
            p.serving,
            {"clean": 0.2, "scratch": 0.8}
            if k % p.reject_every == 0
            else {"clean": 0.9, "scratch": 0.1},
            "reject" if k % p.reject_every == 0 else "accept",
            p.threshold,
            version,
            2.0 + k % 5 * 0.3,
        )
        for k in range(p.predictions)
    ]
    for seq, start in enumerate(range(0, len(records), BATCH)):
        if p.gap and seq == 1:
            continue  # lost on the way: the manager records a gap at seq 1
        yield (
            topics.Up.PREDICTIONS,
            _batch(p.edge, Stream.PREDICTIONS, seq, list(records[start : start + BATCH])),
        )
    # The station's operator labels its newest predictions with the decision's class,
    # and ``missed`` accepted parts as scratches: defects the model let through.
    accepted = [r for r in records if r.decision == "accept"]
    missed = {r.prediction_id for r in accepted[: p.missed]}
    chosen = {
        r.prediction_id: r for r in [*records[len(records) - p.labelled :], *accepted[: p.missed]]
    }
    labels: list[Record] = [
        LabelRecord(
            f"lbl-{pid}",
            pid,
            "scratch" if r.decision == "reject" or pid in missed else "clean",
            "line-operator",
            at,
        )
        for pid, r in chosen.items()
    ]
    if labels:
        yield topics.Up.LABELS, _batch(p.edge, Stream.LABELS, 0, labels)
    if p.state is EdgeState.LOST:
        yield (
            topics.Up.STATE,
            codec.encode(Liveness(p.edge, 1, EdgeState.LOST, "0", p.serving, 0, at)),
        )


def _batch(edge: str, stream: Stream, seq: int, records: list[Record]) -> bytes:
    return codec.encode(RecordBatch(edge, stream, 1, seq, tuple(records)))
