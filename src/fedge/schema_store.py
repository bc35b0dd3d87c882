"""Schema versions of fedge's SQLite files, and their forward migrations (issue 27, item 4).

Every store (the manager's, the agent's, the aggregator's run store, the station's kept
images, the privacy ledger) numbers its schema in SQLite's ``PRAGMA user_version`` and
lists its :class:`Migration` s, 1 to N. Opening a file at version v < N applies
migrations v+1..N and sets the version in one ``BEGIN IMMEDIATE`` transaction: a kill
half-way leaves the file as it was, and of two processes opening it at once (``serve``
and a CLI command) one migrates and the other finds it done. A file at a version above N
was written by a newer fedge and is refused untouched, with an error that says so.

Version 0 is every file from before versions existed, in whatever state its release left
it, so migration 1 creates the store's whole current ``SCHEMA`` (``IF NOT EXISTS``) and
every migration is idempotent: it may find its change made already (:func:`add_column`).
A change to a store's ``SCHEMA`` comes with a new migration that makes it on an existing
file (tests/test_store_versions.py pins each ``SCHEMA`` to its version).

The error class is the caller's, so a refusal reaches the user as its package's error.
"""

import logging
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Migration:
    """Step ``version`` of a store's schema: ``apply`` runs inside the open transaction."""

    version: int
    why: str
    apply: Callable[[sqlite3.Connection], None]


def statements(script: str) -> list[str]:
    """A script's statements one by one (``executescript`` would COMMIT the migration's
    transaction first); comments stay with the statement they precede."""
    found: list[str] = []
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            found.append(pending.strip())
            pending = ""
    rest = [ln for ln in pending.splitlines() if ln.strip() and not ln.strip().startswith("--")]
    if rest:
        raise ValueError(f"an unfinished SQL statement at the end of a schema: {rest[0]!r}")
    return found


def run_script(conn: sqlite3.Connection, script: str) -> None:
    for statement in statements(script):
        conn.execute(statement)


def script(text: str) -> Callable[[sqlite3.Connection], None]:
    """A migration that runs ``text``'s statements."""
    return lambda conn: run_script(conn, text)


def add_column(conn: sqlite3.Connection, table: str, column: str, definition: str) -> None:
    """``ALTER TABLE ... ADD COLUMN`` unless the table has the column already (a file
    created by the current ``SCHEMA``, or one an older release had upgraded)."""
    present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
    if column not in present:
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")


def version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def _check(migrations: Sequence[Migration]) -> int:
    numbers = [m.version for m in migrations]
    if numbers != list(range(1, len(migrations) + 1)):
        raise ValueError(f"migrations must be numbered 1..N in order, got {numbers}")
    return len(migrations)


def _too_new(what: str, found: int, known: int) -> str:
    return (
        f"{what} has schema version {found}, newer than this fedge knows ({known}): it was "
        "written by a newer fedge. Run that version (or a newer one) on it, or restore a "
        "backup taken before the upgrade; this fedge left the file untouched"
    )


def refuse_newer(
    conn: sqlite3.Connection, what: str, migrations: Sequence[Migration], error: type[Exception]
) -> int:
    """For a read-only opener: the file's version, or ``error`` if this code is older."""
    known = _check(migrations)
    found = version(conn)
    if found > known:
        raise error(_too_new(what, found, known))
    return found


def migrate(
    conn: sqlite3.Connection, what: str, migrations: Sequence[Migration], error: type[Exception]
) -> int:
    """Bring the file on ``conn`` (autocommit mode) to the last migration's version.

    ``what`` names the file in messages (its path). Returns the version it is at now;
    raises ``error`` for a file newer than ``migrations`` know, changing nothing.
    """
    known = _check(migrations)
    if refuse_newer(conn, what, migrations, error) == known:
        return known  # the usual open: one read, no write lock
    conn.execute("BEGIN IMMEDIATE")
    try:
        found = version(conn)  # another opener may have migrated while we waited
        if found > known:
            raise error(_too_new(what, found, known))
        for migration in migrations[found:]:
            migration.apply(conn)
        # user_version lives in the file's header page: it commits with the changes.
        conn.execute(f"PRAGMA user_version = {known}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    if found:
        log.info("%s: schema upgraded from version %d to %d", what, found, known)
    return known
