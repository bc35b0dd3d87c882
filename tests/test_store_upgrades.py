"""Every SQLite store opens a file written by the previous release and upgrades it
(issue 27, item 4).

tests/fixtures/stores/*.db were written by commit 221958da (the tree before the layout of
issue 26, before schema versions) with tests/fixtures/stores/make_old_stores.py. Each is
copied, opened with today's code, and must come out at today's version with its rows, and
with the same tables, columns and indexes as a store created new. A file from a newer
fedge is refused untouched.
"""

import hashlib
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from fedge.aggregator.errors import AggregatorError
from fedge.aggregator.jobs import run_store
from fedge.aggregator.jobs.run_store import RunStore
from fedge.edge_agent import store as agent_store
from fedge.edge_agent.errors import AgentError
from fedge.edge_agent.store import LocalStore
from fedge.edge_manager import store as manager_store
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.store import Store
from fedge.party import budget_store, station_store
from fedge.party.budget import BudgetLedger
from fedge.party.errors import StationDataError
from fedge.party.station_store import Retention, StationData
from fedge.privacy.settings import PrivacyError

FIXTURES = Path(__file__).parent / "fixtures" / "stores"
KEEP_ALL = Retention(max_age_s=100 * 365 * 86400.0)


def _station(path: Path) -> Callable[[], object]:
    return lambda: StationData(path.parent.parent, KEEP_ALL, background=False)


# fixture file -> (the module with SCHEMA and MIGRATIONS, where a copy goes under tmp,
# how today's code opens it, the error a newer file gets)
STORES: dict[str, tuple[ModuleType, str, Callable[[Path], Callable[[], object]], type]] = {
    "manager.db": (manager_store, "manager.db", lambda p: lambda: Store(p), ManagerError),
    "agent.db": (agent_store, "agent.db", lambda p: lambda: LocalStore(p), AgentError),
    "runs.db": (run_store, "runs.db", lambda p: lambda: RunStore(p), AggregatorError),
    "station.db": (station_store, "data/station/station.db", _station, StationDataError),
    "privacy.db": (budget_store, "privacy.db", lambda p: lambda: BudgetLedger(p), PrivacyError),
}

# Each store's SCHEMA and the version it was pinned at. A failure here means SCHEMA
# changed: add a migration that makes the change on an existing file (CREATE ... IF NOT
# EXISTS, or schema_store.add_column), then pin the new text's digest at the new version.
PINNED = {
    "manager.db": (6, "c5f33789e1308aed8a98df1e381c0f08b38b927f2ee3070905c8e33c76f1f06a"),
    "agent.db": (2, "22f261a47ac63f01fe0cbc9e8f903264271bc692c8cce20d9d749068abcc9a08"),
    "runs.db": (1, "33caae3a87321f852355eb3ce57b2b44d888a6dcae73312dac521458c4ce195b"),
    "station.db": (1, "9ec7e1e0c03c9a7c0432f0cbda37d19f5bd4cc7184ebf4c7de6681de1a7fb809"),
    "privacy.db": (1, "fd8af2e68b826fba0a84c5484c05f88ac3066a0e9e86bc24699b679f8f9664fd"),
}

# What make_old_stores.py wrote, per table.
ROWS = {
    "manager.db": {"edges": 1, "models": 1, "batches": 3, "predictions": 6, "labels": 1},
    "agent.db": {"kv": 3, "predictions": 4, "labels": 1, "outbox": 3, "pending": 1},
    "runs.db": {"runs": 1, "parties": 1, "profiles": 1},
    "station.db": {"images": 2, "labels": 1},
    "privacy.db": {"dp_releases": 2, "dp_lifetime": 1},
}


def _copy(name: str, tmp_path: Path) -> Path:
    target = tmp_path / STORES[name][1]
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(FIXTURES / name, target)
    return target


def _open(name: str, path: Path) -> None:
    opened = STORES[name][2](path)()
    opened.close()  # type: ignore[attr-defined]


def _read(path: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return conn.execute(sql).fetchall()


def _shape(path: Path) -> dict[str, object]:
    """Tables with their columns, and indexes with their definitions."""
    shape: dict[str, object] = {}
    for kind, name, sql in _read(path, "SELECT type, name, sql FROM sqlite_master"):
        if kind == "table" and not str(name).startswith("sqlite_"):
            shape[str(name)] = [r[1:3] for r in _read(path, f"PRAGMA table_info({name})")]
        elif kind == "index":
            shape[str(name)] = sql
    return shape


@pytest.mark.parametrize("name", sorted(STORES))
def test_a_store_of_the_previous_release_is_upgraded_with_its_rows(
    name: str, tmp_path: Path
) -> None:
    old = _copy(name, tmp_path)
    assert _read(old, "PRAGMA user_version") == [(0,)], "the fixture predates versions"
    _open(name, old)
    module = STORES[name][0]
    assert _read(old, "PRAGMA user_version") == [(module.SCHEMA_VERSION,)]
    for table, count in ROWS[name].items():
        assert _read(old, f"SELECT count(*) FROM {table}") == [(count,)], table
    new = tmp_path / "new" / STORES[name][1]
    new.parent.mkdir(parents=True, exist_ok=True)
    _open(name, new)
    assert _shape(old) == _shape(new)
    _open(name, old)  # a second open finds nothing to do
    assert _read(old, "PRAGMA user_version") == [(module.SCHEMA_VERSION,)]


def test_the_upgraded_stores_work_as_before(tmp_path: Path) -> None:
    agent = LocalStore(_copy("agent.db", tmp_path))
    assert agent.backlog() == {"pending_records": 1, "outbox_batches": 3}
    assert [e.seq for e in agent.outbox(10, set())][:2] == [0, 1]
    assert agent.get("session") == "3" and agent.next_session() == 4
    agent.close()
    manager = Store(_copy("manager.db", tmp_path))
    assert manager.scalar("SELECT count(*) FROM predictions WHERE stats = ''") == 6
    assert manager.scalar("SELECT max_seq FROM streams WHERE edge='st-01'") == 3
    manager.close()
    ledger = BudgetLedger(_copy("privacy.db", tmp_path))
    assert len(ledger.history("job-1")) == 2 and ledger.lifetime() == (8.0, 1e-3)
    ledger.close()
    station = StationData(_copy("station.db", tmp_path).parent.parent, KEEP_ALL, background=False)
    assert station.counts() == {"images": 2, "bytes": 26, "labelled": 1}
    station.close()
    runs = RunStore(_copy("runs.db", tmp_path))
    assert [r["run_id"] for r in runs.runs()] == ["run-1"]
    runs.close()


@pytest.mark.parametrize("name", sorted(STORES))
def test_a_store_written_by_a_newer_fedge_is_refused_untouched(name: str, tmp_path: Path) -> None:
    path = _copy(name, tmp_path)
    _open(name, path)
    newer = STORES[name][0].SCHEMA_VERSION + 1
    with sqlite3.connect(str(path)) as conn:
        conn.execute(f"PRAGMA user_version = {newer}")
    before = _shape(path)
    with pytest.raises(STORES[name][3], match=f"schema version {newer}, newer than this fedge"):
        _open(name, path)
    assert _read(path, "PRAGMA user_version") == [(newer,)]
    assert _shape(path) == before


def test_a_read_only_station_file_of_a_newer_fedge_is_refused(tmp_path: Path) -> None:
    path = _copy("station.db", tmp_path)
    with sqlite3.connect(str(path)) as conn:
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(StationDataError, match="schema version 99"):
        StationData(path.parent.parent, readonly=True)


@pytest.mark.parametrize("name", sorted(STORES))
def test_a_schema_change_comes_with_a_migration(name: str) -> None:
    module = STORES[name][0]
    digest = hashlib.sha256(module.SCHEMA.encode()).hexdigest()
    pinned_at, pinned = PINNED[name]
    assert pinned_at <= module.SCHEMA_VERSION
    assert digest == pinned, (
        f"{module.__name__}.SCHEMA changed: add a migration that makes the change on an "
        "existing file, then pin the new digest at the new SCHEMA_VERSION"
    )
