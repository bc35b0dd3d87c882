"""The fleet page's reads over the manager's store: one grouped query per figure, all edges.

:mod:`fedge.console.fleet_table` builds the whole fleet's table from these -- a handful
of queries however many edges there are, instead of ``Fleet.show``'s ten an edge -- and
does the joining, filtering and sorting itself.
"""

from dataclasses import dataclass

from fedge.edge_manager.desired.store import CONFIG
from fedge.edge_manager.fleet.edge_view_store import Gap
from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class EdgeRow:
    """What an edge last reported, as the fleet table shows it."""

    edge: str
    state: str
    serving: str  # a model reference, '' when it serves none
    last_seen: float | None
    config_applied: int
    config_status: str = ""  # '<applied|rejected>:<offered version>' of its last report
    config_reason: str = ""


@dataclass(frozen=True)
class NewestDesired:
    """An edge's newest desired config version: when it was made and published."""

    version: int
    created_at: float
    published_at: float | None


@dataclass(frozen=True)
class LabelledPrediction:
    """A labelled prediction: what the edge decided and what the label says it is."""

    edge: str
    model: str
    decision: str
    label: str


def edge_rows(store: Store) -> list[EdgeRow]:
    """Every enrolled edge, by name."""
    return [
        EdgeRow(str(edge), str(state), str(serving), last_seen, int(applied), str(status), str(why))
        for edge, state, serving, last_seen, applied, status, why in store.conn.execute(
            "SELECT edge, state, serving, last_seen, config_applied, "
            "coalesce(config_status, ''), coalesce(config_reason, '') FROM edges ORDER BY edge"
        )
    ]


def in_force_documents(store: Store) -> list[tuple[str, str]]:
    """(edge, desired config document) of the config version each edge applied; an edge
    whose applied version is not in the store (none yet, or pruned) is left out."""
    return [
        (str(edge), str(document))
        for edge, document in store.conn.execute(
            "SELECT d.edge, d.document FROM desired d JOIN edges e ON e.edge = d.edge "
            "WHERE d.kind = ? AND d.version = e.config_applied",
            (CONFIG,),
        )
    ]


def newest_config_versions(store: Store) -> dict[str, NewestDesired]:
    """Each edge's newest desired config version (an edge with none is left out)."""
    # SQLite's bare columns beside max() come from the row that has the max.
    return {
        str(edge): NewestDesired(int(version), float(created), published)
        for edge, version, created, published in store.conn.execute(
            "SELECT edge, max(version), created_at, published_at FROM desired WHERE kind = ? "
            "GROUP BY edge",
            (CONFIG,),
        )
    }


def prediction_counts(store: Store) -> dict[str, tuple[int, int]]:
    """Each edge's (predictions, of which rejects); an edge with none is left out."""
    return {
        str(edge): (int(n), int(rejects))
        for edge, n, rejects in store.conn.execute(
            "SELECT edge, count(*), coalesce(sum(decision='reject'), 0) FROM predictions "
            "GROUP BY edge"
        )
    }


def gaps(store: Store) -> list[tuple[str, Gap]]:
    """Every open gap with its edge, each edge's by stream and start as ``Fleet.show``
    lists them."""
    return [
        (str(edge), Gap(str(stream), int(from_seq), int(to_seq)))
        for edge, stream, from_seq, to_seq in store.conn.execute(
            "SELECT edge, stream, from_seq, to_seq FROM gaps ORDER BY edge, stream, from_seq"
        )
    ]


def labelled_predictions(store: Store) -> list[LabelledPrediction]:
    """One row per labelled prediction, from the labels (few) to their predictions."""
    return [
        LabelledPrediction(str(edge), str(model), str(decision), str(label))
        for edge, model, decision, label in store.conn.execute(
            "SELECT p.edge, p.model, p.decision, l.label FROM labels l JOIN predictions p "
            "ON p.prediction_id = l.prediction_id GROUP BY l.prediction_id"
        )
    ]
