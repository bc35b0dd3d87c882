"""SQL lives in the storage layer: modules named ``store.py`` or ``*_store.py``.

Issue "One-way layers": the manager's store promised that no SQLite row leaves it, while
ingest passed a connection through every handler and operations ran SQL of their own.
A storage module holds the statements and returns values or dataclasses; everything
else calls it. This test finds SQL statements (string literals that start with a
statement keyword) in every module under ``src/fedge``. ``KNOWN_SQL_DEBT`` listed the
45 modules outside the storage layer that ran SQL when this test was written; it may only
shrink (a listed module with no SQL left must leave it), and is empty now.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "fedge"
STATEMENT = re.compile(
    r"^\s*(SELECT|INSERT|UPDATE|DELETE|CREATE|ALTER|PRAGMA|BEGIN|SAVEPOINT|ROLLBACK|RELEASE"
    r"|COMMIT|WITH)\b"
)
# Empty since the issue "One-way layers" moved every statement into a store module: a
# module that gains SQL fails this test.
KNOWN_SQL_DEBT: set[str] = set()


def is_storage(relative: Path) -> bool:
    return relative.name == "store.py" or relative.name.endswith("_store.py")


def runs_sql(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        text = node.value if isinstance(node, ast.Constant) else None
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            text = first.value if isinstance(first, ast.Constant) else None
        if isinstance(text, str) and STATEMENT.match(text):
            return True
    return False


def modules_with_sql() -> set[str]:
    found = set()
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT)
        if path.name.startswith("fedge_pb2") or is_storage(relative):
            continue
        if runs_sql(path):
            found.add(relative.as_posix())
    return found


def test_no_sql_outside_the_storage_layer_but_the_known_debt() -> None:
    found = modules_with_sql()
    assert found - KNOWN_SQL_DEBT == set(), "SQL outside a store module: move it into one"
    assert KNOWN_SQL_DEBT - found == set(), "no SQL left: take these off KNOWN_SQL_DEBT"


def test_ingest_holds_no_sql_and_no_connection_and_fleet_no_sql() -> None:
    for name in ("messages.py", "records.py", "checks.py"):
        source = (ROOT / "edge_manager" / "ingest" / name).read_text(encoding="utf-8")
        assert not runs_sql(ROOT / "edge_manager" / "ingest" / name), name
        assert "sqlite3" not in source and ".conn" not in source, name
    assert not runs_sql(ROOT / "edge_manager" / "fleet" / "operations.py")


def test_the_managers_domain_code_holds_a_transaction_not_a_driver() -> None:
    """Outside the storage modules the manager and the console pass a
    ``store.Transaction`` along and catch ``store.StoreError``: none imports sqlite3."""
    importing = []
    for package in ("edge_manager", "console"):
        for path in (ROOT / package).rglob("*.py"):
            if is_storage(path.relative_to(ROOT)):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(n == "sqlite3" or n.startswith("sqlite3.") for n in names):
                    importing.append(path.relative_to(ROOT).as_posix())
    assert importing == [], "use fedge.edge_manager.store.Transaction / StoreError"


def test_the_scan_finds_a_statement_in_a_literal_and_an_f_string(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('table = "x"\nq = f"DELETE FROM {table} WHERE at < ?"\n')
    assert runs_sql(sample)
    sample.write_text('message = "select a model first"\n')
    assert not runs_sql(sample)
