"""What the viewing path reads of the manager's store: where a station serves images."""

from dataclasses import dataclass

from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class StationEndpoint:
    edge: str
    images_at: str  # '' : its births state none (image_port off, or an older agent)
    state: str  # online, lost, offline, never-seen


def endpoint(store: Store, edge: str) -> StationEndpoint | None:
    """None: ``edge`` is not enrolled."""
    row = store.conn.execute("SELECT images_at, state FROM edges WHERE edge=?", (edge,)).fetchone()
    return None if row is None else StationEndpoint(edge, str(row[0]), str(row[1]))


def endpoints(store: Store) -> dict[str, StationEndpoint]:
    return {
        str(e): StationEndpoint(str(e), str(at), str(state))
        for e, at, state in store.conn.execute("SELECT edge, images_at, state FROM edges")
    }
