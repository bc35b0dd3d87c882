"""Schema versions and forward migrations of fedge's SQLite files (fedge/schema_store.py)."""

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedge import schema_store
from fedge.errors import FedgeError
from fedge.schema_store import Migration


class _Refused(FedgeError):
    pass


@pytest.fixture()
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    connection = sqlite3.connect(str(tmp_path / "s.db"), isolation_level=None)
    yield connection
    connection.close()


STEPS = (
    Migration(1, "t", schema_store.script("CREATE TABLE IF NOT EXISTS t (a INTEGER);")),
    Migration(2, "t.b", lambda c: schema_store.add_column(c, "t", "b", "TEXT NOT NULL DEFAULT ''")),
)


def tables(conn: sqlite3.Connection) -> list[str]:
    return [r[0] for r in conn.execute("SELECT name FROM sqlite_master ORDER BY name")]


def test_statements_splits_a_script_and_keeps_semicolons_in_comments_and_strings() -> None:
    script = """
-- a comment; with a semicolon
CREATE TABLE a (x TEXT DEFAULT 'p;q');
CREATE INDEX IF NOT EXISTS a_x ON a (x)
    WHERE x != ';';
-- trailing comment
"""
    assert schema_store.statements(script) == [
        "-- a comment; with a semicolon\nCREATE TABLE a (x TEXT DEFAULT 'p;q');",
        "CREATE INDEX IF NOT EXISTS a_x ON a (x)\n    WHERE x != ';';",
    ]
    with pytest.raises(ValueError, match="unfinished"):
        schema_store.statements("CREATE TABLE b (x)")


def test_a_new_file_gets_every_step_and_the_last_version(conn: sqlite3.Connection) -> None:
    assert schema_store.migrate(conn, "s.db", STEPS, _Refused) == 2
    assert schema_store.version(conn) == 2
    assert [r[1] for r in conn.execute("PRAGMA table_info(t)")] == ["a", "b"]
    assert schema_store.migrate(conn, "s.db", STEPS, _Refused) == 2  # again: nothing to do


def test_an_older_file_runs_only_the_later_steps_keeping_its_rows(
    conn: sqlite3.Connection,
) -> None:
    assert schema_store.migrate(conn, "s.db", STEPS[:1], _Refused) == 1
    conn.execute("INSERT INTO t (a) VALUES (7)")
    assert schema_store.migrate(conn, "s.db", STEPS, _Refused) == 2
    assert conn.execute("SELECT a, b FROM t").fetchall() == [(7, "")]


def test_a_file_newer_than_the_code_is_refused_untouched(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE t (a INTEGER)")
    conn.execute("PRAGMA user_version = 3")
    with pytest.raises(_Refused, match=r"s\.db has schema version 3, newer than .* \(2\)"):
        schema_store.migrate(conn, "s.db", STEPS, _Refused)
    with pytest.raises(_Refused, match="written by a newer fedge"):
        schema_store.refuse_newer(conn, "s.db", STEPS, _Refused)
    assert schema_store.version(conn) == 3
    assert [r[1] for r in conn.execute("PRAGMA table_info(t)")] == ["a"]


def test_a_failing_step_leaves_the_file_as_it_was(conn: sqlite3.Connection) -> None:
    def fail(c: sqlite3.Connection) -> None:
        c.execute("CREATE TABLE half (x)")
        raise RuntimeError("step 3 failed")

    schema_store.migrate(conn, "s.db", STEPS[:1], _Refused)
    with pytest.raises(RuntimeError, match="step 3 failed"):
        schema_store.migrate(conn, "s.db", (*STEPS, Migration(3, "bad", fail)), _Refused)
    assert schema_store.version(conn) == 1
    assert tables(conn) == ["t"]
    assert not conn.in_transaction


def test_steps_must_be_numbered_in_order(conn: sqlite3.Connection) -> None:
    with pytest.raises(ValueError, match=r"numbered 1\.\.N"):
        schema_store.migrate(conn, "s.db", (STEPS[1],), _Refused)
