"""Store reads the Fleet library does not offer (yet): a config by version, its history.

Kept here, small and read-only, rather than grown into fleet.py (which other work owns);
no sqlite row leaves this module.
"""

from dataclasses import dataclass

from fedge.edge_manager.fleet import CONFIG, Fleet
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ProtocolError


@dataclass(frozen=True)
class ConfigVersion:
    version: int
    created_at: float
    published_at: float | None
    config: EdgeConfig


def config_at(fleet: Fleet, edge: str, version: int) -> EdgeConfig | None:
    """``edge``'s desired config of ``version``: the one in force once the edge applied it.

    None when it is gone (pruned history) or undecodable; version 0 is the agent's default.
    """
    if version == 0:
        return EdgeConfig(fleet.fleet, edge, version=1)  # the defaults an edge starts with
    row = fleet.store.one(
        "SELECT document FROM desired WHERE edge=? AND kind=? AND version=?",
        (edge, CONFIG, version),
    )
    if row is None:
        return None
    try:
        return codec.decode(str(row["document"]).encode(), EdgeConfig)
    except ProtocolError:
        return None


def config_history(fleet: Fleet, edge: str, limit: int = 20) -> list[ConfigVersion]:
    rows = fleet.store.query(
        "SELECT version, document, created_at, published_at FROM desired "
        "WHERE edge=? AND kind=? ORDER BY version DESC LIMIT ?",
        (edge, CONFIG, limit),
    )
    history = []
    for row in rows:
        try:
            config = codec.decode(str(row["document"]).encode(), EdgeConfig)
        except ProtocolError:
            continue  # shown as a gap in the history rather than failing the page
        published = row["published_at"]
        history.append(
            ConfigVersion(
                int(row["version"]),
                float(row["created_at"]),
                None if published is None else float(published),
                config,
            )
        )
    return history
