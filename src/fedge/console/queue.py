"""The label queue (issue 30, item 4): what to label first, a page at a time.

Ordered by what teaches the model most: the smallest *margin* first, the distance
between a prediction's deciding defect score and the threshold it was decided with --
uncertainty sampling (Lewis & Gale, SIGIR 1994): the parts the station was least sure
about. Newest first is the other order. In both, *novel* parts come first (issue 28):
ones whose anomaly score is over the station's anomaly threshold and that the
classifier did not recognise as a known defect (``PredictionRecord.novel``) -- a defect
nobody has labelled yet, which a margin cannot rank -- newest first among them. The margin is
taken over the newest
:data:`CANDIDATES` unlabelled predictions that match the filters (bounded work per page
view however large the backlog); the total counts them all.
"""

import json
import math
from dataclasses import dataclass

from fedge.console import queue_store
from fedge.console.deciding import positives_of
from fedge.console.queue_store import Unlabelled
from fedge.console.views import manifest_of
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.fleet.predictions import DECISIONS
from fedge.edge_manager.ingest import thumbnail_store

PAGE = 25
CANDIDATES = 5000
ORDERS = {"margin": "smallest margin first", "newest": "newest first"}
NOVEL_FIRST = "novel parts first (anomaly score over the station's threshold, not a known defect)"


@dataclass(frozen=True)
class QueueQuery:
    edge: str = ""
    model: str = ""
    decision: str = ""
    order: str = "margin"
    page: int = 1

    @classmethod
    def parse(cls, params: dict[str, str]) -> "QueueQuery":
        """From the query string; anything unknown falls back to the default."""
        decision = params.get("decision", "")
        order = params.get("order", "margin")
        page = params.get("page", "1")
        return cls(
            edge=params.get("edge", "")[:64],
            model=params.get("model", "")[:128],
            decision=decision if decision in DECISIONS else "",
            order=order if order in ORDERS else "margin",
            page=int(page) if page.isascii() and page.isdigit() and 0 < len(page) < 7 else 1,
        )

    def link(self, **change: object) -> str:
        values = {**self.__dict__, **change}
        return "?" + "&".join(f"{k}={v}" for k, v in values.items() if v not in ("", None))


@dataclass(frozen=True)
class QueueItem:
    prediction: Unlabelled
    scores: dict[str, float]
    classes: tuple[str, ...]  # what it can be labelled: its model's classes
    margin: float | None  # None: its model's defect classes are unknown
    thumbnail: bool = False  # its station shared the image's thumbnail


@dataclass(frozen=True)
class Queue:
    items: list[QueueItem]
    total: int  # unlabelled predictions matching the filters
    pages: int
    query: QueueQuery
    edges: list[str]
    models: list[str]
    rule: str


def margin(scores: dict[str, float], threshold: float, positives: tuple[str, ...]) -> float | None:
    """|deciding defect score - threshold|: the highest-scoring defect class's score, as the
    agent's ``decide`` records it for an accepted part (and, with one defect class, a
    rejected one). None without defect classes among the scores."""
    present = [scores[c] for c in positives if c in scores]
    if not present:
        return None
    return abs(max(present) - threshold)


def order(items: list[QueueItem], by: str) -> list[QueueItem]:
    """``items`` (newest first) by ``by``, novel parts first in either order: 'margin'
    puts the smallest first, unknown margins last, newest first among equals; 'newest'
    keeps them."""
    if by == "newest":
        return sorted(items, key=lambda i: not i.prediction.novel)
    return sorted(
        items,
        key=lambda i: (not i.prediction.novel, math.inf if i.margin is None else i.margin),
    )


def label_queue(fleet: Fleet, query: QueueQuery = QueueQuery()) -> Queue:
    store = fleet.store
    rows = queue_store.unlabelled(store, query.edge, query.model, query.decision, CANDIDATES)
    total = queue_store.unlabelled_count(store, query.edge, query.model, query.decision)
    classes: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    items = []
    for row in rows:
        if row.model not in classes:
            manifest = manifest_of(fleet, row.model)
            all_classes = () if manifest is None else tuple(manifest.classes)
            classes[row.model] = (all_classes, positives_of(manifest))
        scores = {str(k): float(v) for k, v in json.loads(row.scores).items()}
        own, positives = classes[row.model]
        items.append(QueueItem(row, scores, own, margin(scores, row.threshold, positives)))
    ordered = order(items, query.order)
    pages = max(1, math.ceil(len(ordered) / PAGE))
    page = min(query.page, pages)
    shown = ordered[(page - 1) * PAGE : page * PAGE]
    shared = thumbnail_store.available(
        store, [(i.prediction.edge, i.prediction.prediction_id) for i in shown]
    )
    shown = [
        QueueItem(i.prediction, i.scores, i.classes, i.margin,
                  (i.prediction.edge, i.prediction.prediction_id) in shared)
        for i in shown
    ]  # fmt: skip
    edges, models = queue_store.choices(store)
    rule = NOVEL_FIRST + ", then " + ORDERS[query.order]
    if query.order == "margin":
        rule += " (|defect score - the threshold that decided it|: least certain first)"
    return Queue(
        shown, total, pages, QueueQuery(**{**query.__dict__, "page": page}), edges, models, rule
    )
