"""Config reads the Fleet library does not offer (yet): a config by version, its history.

Kept here, small and read-only, rather than grown into fleet.py (which other work owns);
the statements are in views_store.py, the decoding here.
"""

from dataclasses import dataclass

from fedge.console import views_store
from fedge.edge_manager.fleet.operations import Fleet
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
    document = views_store.config_document(fleet.store, edge, version)
    if document is None:
        return None
    try:
        return codec.decode(document.encode(), EdgeConfig)
    except ProtocolError:
        return None


def config_history(fleet: Fleet, edge: str, limit: int = 20) -> list[ConfigVersion]:
    history = []
    for row in views_store.config_documents(fleet.store, edge, limit):
        try:
            config = codec.decode(row.document.encode(), EdgeConfig)
        except ProtocolError:
            continue  # shown as a gap in the history rather than failing the page
        history.append(ConfigVersion(row.version, row.created_at, row.published_at, config))
    return history
