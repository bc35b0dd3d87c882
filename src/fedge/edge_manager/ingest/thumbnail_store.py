"""The thumbnails stations share, kept by the manager only while their config says so.

A station's images stay on the station unless its config shares thumbnails
(protocols.thumbnails). The manager enforces that too: a thumbnail batch from a station
whose newest desired config does not share them is stored as a batch (its sequence
number counts, so no gap opens) but its images are dropped and counted, never written.
Each station keeps its newest :data:`KEEP_PER_EDGE`; retention prunes them with the
predictions (retention.py).
"""

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fedge.edge_manager.store import Store
from fedge.protocols.thumbnails import ThumbnailRecord, check_png

KEEP_PER_EDGE = 500


@dataclass(frozen=True)
class Stored:
    stored: int
    withheld: int  # sent while the station's config does not share thumbnails


def shares(conn: sqlite3.Connection, edge: str) -> bool:
    """Whether ``edge``'s newest desired config shares thumbnails (the operator's will,
    in force at the manager from the moment it is set)."""
    row = conn.execute(
        "SELECT json_extract(document, '$.thumbnails') IS NOT NULL FROM desired "
        "WHERE edge=? AND kind='config' ORDER BY version DESC LIMIT 1",
        (edge,),
    ).fetchone()
    return bool(row and row[0])


def store(
    conn: sqlite3.Connection, edge: str, records: Sequence[ThumbnailRecord], now: float
) -> Stored:
    """Store a batch's thumbnails inside the caller's transaction (validated already)."""
    if not records:
        return Stored(0, 0)
    if not shares(conn, edge):
        return Stored(0, len(records))
    rows = []
    for record in records:
        png = record.image()
        width, height = check_png(png)
        rows.append((edge, record.prediction_id, record.at, png, width, height, now))
    added = conn.executemany(
        "INSERT OR IGNORE INTO thumbnails (edge, prediction_id, at, png, width, height, "
        "received_at) VALUES (?,?,?,?,?,?,?)",
        rows,
    ).rowcount
    conn.execute(
        "DELETE FROM thumbnails WHERE edge=? AND rowid NOT IN (SELECT rowid FROM thumbnails "
        "WHERE edge=? ORDER BY at DESC LIMIT ?)",
        (edge, edge, KEEP_PER_EDGE),
    )
    return Stored(added, 0)


@dataclass(frozen=True)
class Thumbnail:
    edge: str
    prediction_id: str
    at: float
    png: bytes
    width: int
    height: int


def get(db: Store, edge: str, prediction_id: str) -> Thumbnail | None:
    row = db.one(
        "SELECT edge, prediction_id, at, png, width, height FROM thumbnails "
        "WHERE edge=? AND prediction_id=?",
        (edge, prediction_id),
    )
    return None if row is None else Thumbnail(**row)


def available(db: Store, keys: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
    """Which of these (edge, prediction_id) pairs have a thumbnail."""
    wanted = list(keys)
    if not wanted:
        return set()
    found: set[tuple[str, str]] = set()
    for start in range(0, len(wanted), 400):  # SQLite's bound-parameter limit
        chunk = wanted[start : start + 400]
        clause = " OR ".join("(edge=? AND prediction_id=?)" for _ in chunk)
        params = tuple(value for pair in chunk for value in pair)
        for row in db.query(f"SELECT edge, prediction_id FROM thumbnails WHERE {clause}", params):
            found.add((str(row["edge"]), str(row["prediction_id"])))
    return found


def count(db: Store, edge: str) -> int:
    return int(db.scalar("SELECT count(*) FROM thumbnails WHERE edge=?", (edge,)))
