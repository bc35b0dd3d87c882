"""Which team owns a model version (``model_teams``, migration 11): recorded when a team's
queued job publishes it or ``fedge model publish --team`` names one.

No row leaves this module; teams.py decides who may see and deploy a team's model.
"""

from __future__ import annotations

from fedge.edge_manager.store import Store


def record(store: Store, name: str, version: int, team: str, *, who: str, at: float) -> None:
    """``team`` owns ``name:version`` (once: a version's owner never changes)."""
    with store.transaction() as conn:
        conn.execute(
            "INSERT INTO model_teams (name, version, team, recorded_at, recorded_by) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (name, version) DO NOTHING",
            (name, version, team, at, who),
        )


def owner(store: Store, name: str, version: int) -> str | None:
    rows = store.query(
        "SELECT team FROM model_teams WHERE name = ? AND version = ?", (name, version)
    )
    return str(rows[0]["team"]) if rows else None


def owners(store: Store) -> dict[tuple[str, int], str]:
    """(name, version) -> its team, for every version a team owns."""
    return {
        (str(r["name"]), int(r["version"])): str(r["team"])
        for r in store.query("SELECT name, version, team FROM model_teams")
    }
