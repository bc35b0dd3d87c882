"""SQL lives in the storage layer: modules named ``store.py`` or ``*_store.py``.

Issue "One-way layers": the manager's store promised that no SQLite row leaves it, while
ingest passed a connection through every handler and operations ran SQL of their own.
A storage module holds the statements and returns values or dataclasses; everything
else calls it. This test finds SQL statements (string literals that start with a
statement keyword) in every module under ``src/fedge``. ``KNOWN_SQL_DEBT`` lists the
modules outside the storage layer that still run SQL; it may only shrink: a module not
listed that gains SQL fails, and a listed one that no longer has any must leave the list.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "fedge"
STATEMENT = re.compile(
    r"^\s*(SELECT|INSERT|UPDATE|DELETE|CREATE|ALTER|PRAGMA|BEGIN|SAVEPOINT|ROLLBACK|RELEASE"
    r"|COMMIT|WITH)\b"
)
# Paid down so far: ingest (ingest_store.IngestTransaction) and the Fleet operations
# (desired_store, edge_store, deployment_store). Each line is a module to move into a
# store module, or to rename where it is one (party/dataset.py is the station's image
# index, loop/runs.py the loop's run records).
KNOWN_SQL_DEBT = {
    "bench/chaos/plant.py",
    "bench/chaos/runner.py",
    "bench/config_push.py",
    "bench/console.py",
    "bench/fleet_round.py",
    "bench/footprint.py",
    "bench/ingest.py",
    "bench/rollout.py",
    "cli/deploy.py",
    "cli/loop.py",
    "console/accounts.py",
    "console/audit.py",
    "console/fleet_table.py",
    "console/histograms.py",
    "console/jobs.py",
    "console/queries.py",
    "console/registry_views.py",
    "demo/closed_loop.py",
    "demo/fleet.py",
    "demo/learning.py",
    "demo/report.py",
    "demo/security.py",
    "demo/timeline.py",
    "edge_manager/credentials.py",
    "edge_manager/evaluations.py",
    "edge_manager/fleet_labels.py",
    "edge_manager/fleet_views.py",
    "edge_manager/gating.py",
    "edge_manager/key_rotation.py",
    "edge_manager/labels.py",
    "edge_manager/monitor.py",
    "edge_manager/monitor_windows.py",
    "edge_manager/predictions.py",
    "edge_manager/registry.py",
    "edge_manager/retention.py",
    "edge_manager/rollout_guard.py",
    "edge_manager/rollout_health.py",
    "edge_manager/rollout_views.py",
    "edge_manager/rollout_writes.py",
    "edge_manager/rollouts.py",
    "federation/prepare.py",
    "loop/runs.py",
    "loop/steps.py",
    "party/budget.py",
    "party/dataset.py",
}


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
    for name in ("ingest.py", "ingest_records.py", "ingest_checks.py"):
        source = (ROOT / "edge_manager" / name).read_text(encoding="utf-8")
        assert not runs_sql(ROOT / "edge_manager" / name), name
        assert "sqlite3" not in source and ".conn" not in source, name
    assert not runs_sql(ROOT / "edge_manager" / "fleet.py")


def test_the_scan_finds_a_statement_in_a_literal_and_an_f_string(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('table = "x"\nq = f"DELETE FROM {table} WHERE at < ?"\n')
    assert runs_sql(sample)
    sample.write_text('message = "select a model first"\n')
    assert not runs_sql(sample)
