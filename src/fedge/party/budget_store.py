"""The privacy ledger's SQLite file: its schema and every statement the ledger runs.

:mod:`fedge.party.budget` decides (a release within both bounds or not) and owns the
lock and the error wording; this module only reads and writes the file. One file per
station or simulated party; WAL with ``synchronous=FULL`` so a reservation is on disk
before training starts.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedge import schema_store
from fedge.privacy.settings import DpRelease, PrivacyError

SCHEMA = """
CREATE TABLE IF NOT EXISTS dp_releases (
    job TEXT NOT NULL, server_round INTEGER NOT NULL, attempt TEXT NOT NULL DEFAULT '',
    noise_multiplier REAL NOT NULL, sample_rate REAL NOT NULL, steps INTEGER NOT NULL,
    recorded_at REAL NOT NULL, PRIMARY KEY (job, server_round, attempt));
CREATE TABLE IF NOT EXISTS dp_lifetime (
    id INTEGER PRIMARY KEY CHECK (id = 1), epsilon REAL, delta REAL NOT NULL);
CREATE TABLE IF NOT EXISTS dp_floor (
    id INTEGER PRIMARY KEY CHECK (id = 1), floor TEXT, written_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS dp_evaluations (
    job TEXT NOT NULL, attempt TEXT NOT NULL, noise_multiplier REAL NOT NULL,
    recorded_at REAL NOT NULL, PRIMARY KEY (job, attempt));
"""
# The ledger's schema versions (fedge/schema_store.py; 0: written before versions). A
# change to SCHEMA is a new migration here.
MIGRATIONS: tuple[schema_store.Migration, ...] = (
    schema_store.Migration(1, "every table of SCHEMA", schema_store.script(SCHEMA)),
)
SCHEMA_VERSION = len(MIGRATIONS)
RELEASE_COLUMNS = frozenset(
    {"job", "server_round", "attempt", "noise_multiplier", "sample_rate", "steps"}
)
DEFAULT_LIFETIME_DELTA = 1e-3


def connect(path: Path) -> sqlite3.Connection:
    """Open (or create) a ledger file; sqlite3 and OS errors propagate."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30.0)


def prepare(conn: sqlite3.Connection, path: Path) -> frozenset[str]:
    """WAL, full sync and the schema at its version; returns dp_releases' columns
    (DatabaseError on a file that is not a database, PrivacyError on one written by a
    newer fedge)."""
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    schema_store.migrate(conn, str(path), MIGRATIONS, PrivacyError)
    return frozenset(row[1] for row in conn.execute("PRAGMA table_info(dp_releases)"))


@contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE: the station's ClientApp and its agent may share the file."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def lifetime(conn: sqlite3.Connection) -> tuple[float | None, float]:
    row = conn.execute("SELECT epsilon, delta FROM dp_lifetime WHERE id = 1").fetchone()
    if row is None:
        return None, DEFAULT_LIFETIME_DELTA
    return (None if row[0] is None else float(row[0])), float(row[1])


def set_lifetime(conn: sqlite3.Connection, epsilon: float | None, delta: float) -> None:
    conn.execute(
        "INSERT INTO dp_lifetime (id, epsilon, delta) VALUES (1, ?, ?) "
        "ON CONFLICT (id) DO UPDATE SET epsilon = excluded.epsilon, delta = excluded.delta",
        (epsilon, delta),
    )


def floor(conn: sqlite3.Connection) -> tuple[bool, str | None]:
    """(whether the agent wrote a floor record, the floor's JSON or None: opted out)."""
    row = conn.execute("SELECT floor FROM dp_floor WHERE id = 1").fetchone()
    if row is None:
        return False, None
    return True, None if row[0] is None else str(row[0])


def set_floor(conn: sqlite3.Connection, floor_json: str | None) -> None:
    conn.execute(
        "INSERT INTO dp_floor (id, floor, written_at) VALUES (1, ?, ?) "
        "ON CONFLICT (id) DO UPDATE SET floor = excluded.floor, written_at = excluded.written_at",
        (floor_json, time.time()),
    )


def evaluations(conn: sqlite3.Connection, job: str | None) -> list[DpRelease]:
    """The evaluation releases of ``job`` (None: every job's): one Gaussian count each."""
    query = "SELECT noise_multiplier FROM dp_evaluations"
    params: tuple[str, ...] = ()
    if job is not None:
        query += " WHERE job = ?"
        params = (job,)
    rows = conn.execute(query + " ORDER BY rowid", params).fetchall()
    return [DpRelease(float(sigma), 1.0, 1) for (sigma,) in rows]


def insert_evaluation(conn: sqlite3.Connection, job: str, attempt: str, sigma: float) -> None:
    conn.execute(
        "INSERT INTO dp_evaluations (job, attempt, noise_multiplier, recorded_at) "
        "VALUES (?, ?, ?, ?)",
        (job, attempt, sigma, time.time()),
    )


def history(conn: sqlite3.Connection, job: str | None) -> list[DpRelease]:
    """The releases of ``job`` (None: every job's), in the order they were made."""
    query = "SELECT noise_multiplier, sample_rate, steps FROM dp_releases"
    params: tuple[str, ...] = ()
    if job is not None:
        query += " WHERE job = ?"
        params = (job,)
    rows = conn.execute(query + " ORDER BY rowid", params).fetchall()
    return [DpRelease(float(sigma), float(q), int(steps)) for sigma, q, steps in rows]


def insert(
    conn: sqlite3.Connection, job: str, server_round: int, attempt: str, release: DpRelease
) -> bool:
    """Record a release; False if that (job, round, attempt) is recorded already."""
    cursor = conn.execute(
        "INSERT INTO dp_releases (job, server_round, attempt, noise_multiplier, "
        "sample_rate, steps, recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (job, server_round, attempt) DO NOTHING",
        (
            job,
            server_round,
            attempt,
            release.noise_multiplier,
            release.sample_rate,
            release.steps,
            time.time(),
        ),
    )
    return cursor.rowcount == 1


def replace(
    conn: sqlite3.Connection, job: str, server_round: int, attempt: str, release: DpRelease
) -> None:
    conn.execute(
        "UPDATE dp_releases SET noise_multiplier = ?, sample_rate = ?, steps = ?, "
        "recorded_at = ? WHERE job = ? AND server_round = ? AND attempt = ?",
        (
            release.noise_multiplier,
            release.sample_rate,
            release.steps,
            time.time(),
            job,
            server_round,
            attempt,
        ),
    )


def delete(conn: sqlite3.Connection, job: str, server_round: int, attempt: str) -> None:
    conn.execute(
        "DELETE FROM dp_releases WHERE job = ? AND server_round = ? AND attempt = ?",
        (job, server_round, attempt),
    )
