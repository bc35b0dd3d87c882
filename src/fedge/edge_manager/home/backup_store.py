"""The manager store's side of a backup (issue 27, item 3): a consistent copy of a live
SQLite file through SQLite's online backup API, and what that copy holds.

``sqlite3.Connection.backup`` with ``pages=-1`` copies every page in one step, inside one
read transaction: in WAL mode ``serve`` keeps writing meanwhile (readers never block the
writer), and the copy is the store exactly as of one committed transaction -- never half
of an ingest batch (https://sqlite.org/backup.html).
"""

import sqlite3
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from fedge.edge_manager.errors import ManagerError

# The record tables a backup counts, in the manifest and the restore's report.
RECORD_TABLES = ("predictions", "labels", "telemetry")


@dataclass(frozen=True)
class StoreFacts:
    """What a copied manager store holds: its schema version, the highest sequence number
    stored per (edge, stream) -- a batch above it, acknowledged after the copy, is what a
    restore from it lacks -- and its record counts."""

    schema_version: int
    stream_marks: dict[str, int]
    records: dict[str, int]


def snapshot(source: Path, target: Path) -> None:
    """Copy the SQLite file ``source`` (possibly open in other processes) to ``target``."""
    if not source.is_file():
        raise ManagerError(f"{source} does not exist: nothing to back up there")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with (
            closing(sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=30.0)) as src,
            closing(sqlite3.connect(str(target))) as dst,
        ):
            src.backup(dst, pages=-1)
            # One self-contained file: no -wal beside it in the archive.
            dst.execute("PRAGMA journal_mode=DELETE")
    except sqlite3.Error as exc:
        raise ManagerError(f"cannot copy {source} with SQLite's backup API: {exc}") from exc


def facts(path: Path) -> StoreFacts:
    """Read a copied manager store (never the live one: counting scans the tables)."""
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            marks = {
                f"{edge}/{stream}": int(seq)
                for edge, stream, seq in conn.execute(
                    "SELECT edge, stream, max_seq FROM streams ORDER BY edge, stream"
                )
            }
            records = {
                table: int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
                for table in RECORD_TABLES
            }
    except sqlite3.Error as exc:
        raise ManagerError(f"{path} is not a readable manager store: {exc}") from exc
    return StoreFacts(version, marks, records)


def check_integrity(path: Path) -> None:
    """SQLite's own check of a restored file (``PRAGMA integrity_check``)."""
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            verdict = [str(row[0]) for row in conn.execute("PRAGMA integrity_check")]
    except sqlite3.Error as exc:
        raise ManagerError(f"{path} is not a readable SQLite file: {exc}") from exc
    if verdict != ["ok"]:
        raise ManagerError(f"{path} failed SQLite's integrity check: {'; '.join(verdict[:3])}")


def rebase_artifacts(path: Path, artifacts: Path) -> int:
    """Point the registry's model paths of a restored store at ``artifacts``.

    The registry stores where it wrote each model (``<home>/artifacts/<name>/<version>/
    model.onnx``, as the home was named then); a home restored elsewhere keeps the files
    under its own ``artifacts``. Returns how many rows moved.
    """
    moved = 0
    try:
        with closing(sqlite3.connect(str(path), isolation_level=None)) as conn:
            conn.execute("BEGIN IMMEDIATE")
            for name, version, stored in conn.execute(
                "SELECT name, version, path FROM models"
            ).fetchall():
                parts = Path(str(stored)).parts
                if "artifacts" not in parts:
                    continue
                tail = parts[len(parts) - parts[::-1].index("artifacts") :]
                rebased = str(artifacts.joinpath(*tail))
                if rebased != stored:
                    conn.execute(
                        "UPDATE models SET path=? WHERE name=? AND version=?",
                        (rebased, name, version),
                    )
                    moved += 1
            conn.execute("COMMIT")
    except sqlite3.Error as exc:
        raise ManagerError(f"cannot point {path}'s registry at {artifacts}: {exc}") from exc
    return moved
