"""The fleet page's table for a whole fleet in a handful of queries, sorted and filtered.

``views.fleet_row`` builds one row from ``Fleet.show`` (about ten queries an edge); for
the fleet page that is ten thousand queries at 1,000 edges. Here every figure comes from
one grouped query over all edges (fleet_table_store.py) into the same ``EdgeFigures``,
formatted by the same ``views.cells``, so the page, its live updates and an edge's own
page always agree.

Sorting, filtering and paging happen on the server from the query string
(``?sort=last_seen&desc=1&state=online&model=inspect:3&q=st-0&page=2&per=100``), so they
work without JavaScript and on any size of fleet. A page shows ``per`` rows (100 by
default): at 1,000 edges rendering every row cost ~300 ms of the page's 314 ms p95 (issue
25), while the figures for all of them take ~20 ms; the fleet's health and the filters'
counts still cover every edge.
"""

import functools
import time
from collections import defaultdict
from dataclasses import dataclass

from fedge.console import fleet_table_store, freshness, views_store
from fedge.console.fleet_table_store import NewestDesired
from fedge.console.health import Health, fleet_health
from fedge.console.views import EdgeFigures, FleetRow, manifest_of, table_row
from fedge.edge_manager.fleet.edge_view_store import Gap
from fedge.edge_manager.fleet.operations import Fleet
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ProtocolError
from fedge.protocols.manifest import ModelManifest

# What a column sorts by: the raw value, not its display text.
SORT_KEYS = (
    "edge",
    "state",
    "serving",
    "sync",
    "last_seen",
    "predictions",
    "reject_rate",
    "agreement",
    "gaps",
)
# As shown: "stale" is an online edge not heard from lately (freshness.py).
STATES = ("online", freshness.STALE, "lost", "offline", "never-seen", "revoked")
# Rows a page may show; the last is a whole 1,000-station plant on one page.
PER_PAGE = (50, 100, 250, 1000)
DEFAULT_PER_PAGE = 100
ALL_ROWS = 0  # per_page of the live feed, which carries every edge's cells


@dataclass(frozen=True)
class TableQuery:
    sort: str = "edge"
    desc: bool = False
    state: str = ""
    model: str = ""
    text: str = ""
    page: int = 1  # from 1; past the last page shows the last
    per_page: int = DEFAULT_PER_PAGE  # ALL_ROWS: one page of every row (the live feed)

    @classmethod
    def parse(cls, params: dict[str, str]) -> "TableQuery":
        """From the query string; anything unknown falls back to the default (a page
        never fails on a hand-edited URL)."""
        sort = params.get("sort", "edge")
        state = params.get("state", "")
        page = params.get("page", "1")
        per = params.get("per", "")
        return cls(
            sort=sort if sort in SORT_KEYS else "edge",
            desc=params.get("desc", "") in ("1", "true"),
            state=state if state in STATES else "",
            model=params.get("model", "")[:128],
            text=params.get("q", "")[:64],
            page=int(page) if page.isdigit() and 0 < len(page) < 7 and int(page) > 0 else 1,
            per_page=int(per) if per.isdigit() and int(per) in PER_PAGE else DEFAULT_PER_PAGE,
        )


@dataclass(frozen=True)
class Table:
    rows: list[FleetRow]  # this page's
    total: int  # edges in the fleet, before filtering
    models: list[str]  # what the model filter offers
    query: TableQuery
    health: Health  # of the whole fleet, not only the filtered rows
    matched: int = 0  # edges the filters let through, on every page
    page: int = 1  # the page shown (the query's, or the last there is)
    pages: int = 1

    @property
    def first(self) -> int:
        """The 1-based position of the page's first row among the matched (0: none)."""
        return (self.page - 1) * max(self.query.per_page, 0) + 1 if self.rows else 0

    @property
    def last(self) -> int:
        return self.first + len(self.rows) - 1 if self.rows else 0


@functools.lru_cache(maxsize=8192)
def _decoded(document: str) -> EdgeConfig | None:
    """A desired config document, decoded once: (edge, version) documents never change,
    so a console process decodes each only the first time it shows it."""
    try:
        return codec.decode(document.encode(), EdgeConfig)
    except ProtocolError:
        return None  # shown as '?', as on the edge's page


def _configs(fleet: Fleet) -> tuple[dict[str, EdgeConfig], dict[str, NewestDesired]]:
    """Each edge's config in force (the desired document of the version it applied) and
    its newest desired config version."""
    in_force: dict[str, EdgeConfig] = {}
    for edge, document in fleet_table_store.in_force_documents(fleet.store):
        config = _decoded(document)
        if config is not None:
            in_force[edge] = config
    return in_force, fleet_table_store.newest_config_versions(fleet.store)


def _agreement(fleet: Fleet) -> dict[str, float]:
    """labels.agreement for every edge at once (same rule: a label agrees with "reject"
    when it names one of the model's positive classes)."""
    positives = views_store.positive_classes(fleet.store)
    agree: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    for row in fleet_table_store.labelled_predictions(fleet.store):
        total[row.edge] += 1
        agree[row.edge] += (row.decision == "reject") == (
            row.label in positives.get(row.model, set())
        )
    return {edge: agree[edge] / n for edge, n in total.items()}


def fleet_table(
    fleet: Fleet,
    query: TableQuery = TableQuery(),
    now: float | None = None,
    serve_notice: str | None = None,
) -> Table:
    """The table as of ``now`` (default: the clock), states aged against it;
    ``serve_notice``: what is wrong with ``manager serve`` (health.py), None if nothing."""
    now = time.time() if now is None else now
    edges = fleet_table_store.edge_rows(fleet.store)
    manifests: dict[str, ModelManifest | None] = {}
    in_force, newest = _configs(fleet)
    counts = fleet_table_store.prediction_counts(fleet.store)
    gaps: dict[str, list[Gap]] = defaultdict(list)
    for edge, gap in fleet_table_store.gaps(fleet.store):
        gaps[edge].append(gap)
    agreement = _agreement(fleet)
    models = sorted({e.serving for e in edges if e.serving})
    text = query.text.lower()
    # Rows without a value (never seen, nothing labelled) go last either way.
    present: list[tuple[str | float, FleetRow]] = []
    absent: list[FleetRow] = []
    shown: list[FleetRow] = []  # every edge's row, for the fleet's health
    for edge_row in edges:
        edge = edge_row.edge
        predictions, rejects = counts.get(edge, (0, 0))
        applied = edge_row.config_applied
        newest_desired = newest.get(edge)
        desired = 0 if newest_desired is None else newest_desired.version
        pending = None
        if newest_desired is not None and desired != applied:
            pending = freshness.pending(
                desired,
                newest_desired.created_at,
                newest_desired.published_at,
                edge_row.config_status,
                edge_row.config_reason,
            )
        figures = EdgeFigures(
            edge=edge,
            state=edge_row.state,
            serving=edge_row.serving,
            last_seen=edge_row.last_seen,
            config_applied=applied,
            desired_config_version=desired,
            in_sync=desired == applied,
            predictions=predictions,
            rejects=rejects,
            gaps=tuple(gaps.get(edge, ())),
            label_agreement=agreement.get(edge),
            pending=pending,
        )
        default = EdgeConfig(fleet.fleet, edge, version=1) if applied == 0 else None
        if edge_row.serving not in manifests:
            manifests[edge_row.serving] = manifest_of(fleet, edge_row.serving)
        row = table_row(figures, in_force.get(edge, default), manifests[edge_row.serving], now)
        shown.append(row)
        if query.state and row.state != query.state:
            continue
        if query.model and edge_row.serving != query.model:
            continue
        if text and text not in edge.lower():
            continue
        value = _sort_value(query.sort, figures)
        if value is None:
            absent.append(row)
        else:
            present.append((value, row))
    present.sort(key=lambda k: k[0], reverse=query.desc)
    seen = [e.last_seen for e in edges if e.last_seen is not None]
    health = fleet_health(serve_notice, shown, max(seen, default=None), now)
    matched = [r for _, r in present] + absent
    per = query.per_page if query.per_page > 0 else max(1, len(matched))
    pages = max(1, -(-len(matched) // per))
    page = min(query.page, pages)
    rows = matched[(page - 1) * per : page * per]
    return Table(rows, len(edges), models, query, health, len(matched), page, pages)


def _sort_value(sort: str, edge: EdgeFigures) -> str | float | None:
    """What ``edge``'s row sorts by in column ``sort`` (one type a column); None: no value."""
    if sort == "reject_rate":
        return None if edge.predictions == 0 else edge.rejects / edge.predictions
    if sort == "agreement":
        return edge.label_agreement
    if sort == "sync":
        return edge.in_sync
    if sort == "gaps":
        return len(edge.gaps)
    if sort == "state":
        return edge.state
    if sort == "serving":
        return edge.serving
    if sort == "last_seen":
        return edge.last_seen
    if sort == "predictions":
        return edge.predictions
    return edge.edge
