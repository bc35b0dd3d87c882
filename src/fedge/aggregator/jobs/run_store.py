"""The aggregator's run store (SQLite via sqlite-utils): runs, rounds, party profiles.

Every round is recorded as it ends -- who was selected, who replied on time, who was late
and who failed (with the reason), the tier, the round's time and its metrics -- so an
operator can answer "why was round 41 slow?" after the fact, and a resumed job knows
where it stopped.
"""

import json
import math
import sqlite3
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import sqlite_utils
from flwr.app import Message

from fedge import schema_store
from fedge.aggregator.errors import AggregatorError
from fedge.aggregator.rounds.latency import LatencyProfile
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.tiers.groups import Tiers

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, manifest TEXT NOT NULL, state TEXT NOT NULL,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, last_round INTEGER NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS rounds (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, tier INTEGER,
    selected TEXT NOT NULL, on_time TEXT NOT NULL, late TEXT NOT NULL, failed TEXT NOT NULL,
    failures TEXT NOT NULL, round_time_s REAL NOT NULL, elapsed_s REAL NOT NULL,
    quorum INTEGER NOT NULL, quorum_met INTEGER NOT NULL, deadline_s REAL,
    stale_folded INTEGER NOT NULL, train_metrics TEXT NOT NULL, eval_metrics TEXT NOT NULL,
    recorded_at REAL NOT NULL, PRIMARY KEY (run_id, round));
CREATE TABLE IF NOT EXISTS profiles (
    run_id TEXT NOT NULL, party INTEGER NOT NULL, mean_s REAL NOT NULL, count INTEGER NOT NULL,
    last_s REAL NOT NULL, timeouts INTEGER NOT NULL, tier INTEGER,
    PRIMARY KEY (run_id, party));
CREATE TABLE IF NOT EXISTS parties (
    run_id TEXT NOT NULL, party INTEGER NOT NULL, name TEXT NOT NULL,
    PRIMARY KEY (run_id, party));
CREATE TABLE IF NOT EXISTS party_rounds (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, party INTEGER NOT NULL,
    metrics TEXT NOT NULL, PRIMARY KEY (run_id, round, party));
CREATE TABLE IF NOT EXISTS evaluations (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, party TEXT NOT NULL,
    accuracy REAL, examples INTEGER NOT NULL, error TEXT NOT NULL DEFAULT '',
    recorded_at REAL NOT NULL, PRIMARY KEY (run_id, round, party));
"""

# The run store's schema versions (fedge/schema_store.py; 0: written before versions). A
# change to SCHEMA is a new migration here.
MIGRATIONS: tuple[schema_store.Migration, ...] = (
    schema_store.Migration(1, "every table of SCHEMA", schema_store.script(SCHEMA)),
)
SCHEMA_VERSION = len(MIGRATIONS)

_U64 = 2**64
_I64_MAX = 2**63 - 1


def _party_in(party: int) -> int:
    """A party id as SQLite stores it: Flower's node ids are unsigned 64-bit, SQLite's
    integers signed, so ids past 2^63 are stored in two's complement (lossless)."""
    return party - _U64 if party > _I64_MAX else party


def _party_out(value: int) -> int:
    return value + _U64 if value < 0 else value


@dataclass(frozen=True)
class PartyEvaluation:
    """One party's evaluation of a round's global model on its own held-out data."""

    party: str
    accuracy: float | None  # None: it could not evaluate (``error`` says why)
    examples: int
    error: str = ""


CENTRAL_DP_ROW = "all stations (central DP)"
# Train-metric keys central DP (fedge.aggregator.privacy.central_dp) puts in each round's record.
STATION_EPSILON_KEY = "dp-epsilon-station"
RELEASED_KEY = "dp-released"

_JSON_COLUMNS = (
    "selected",
    "on_time",
    "late",
    "failed",
    "failures",
    "train_metrics",
    "eval_metrics",
)


class RunState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    HALTED = "halted"
    COMPLETED = "completed"
    FAILED = "failed"


def _use_wal(conn: sqlite3.Connection, wait_s: float = 30.0) -> None:
    """Switch a run store to WAL, waiting out another opener.

    The switch needs the file to itself, and SQLite answers "database is locked" at once
    rather than through the busy timeout: a ``fedge aggregator run`` preparing its job
    died that way while a reader (``fedge job status``, a test) opened the same file.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


class RunStore:
    def __init__(self, path: Path | str) -> None:
        conn = sqlite3.connect(str(path), isolation_level=None, timeout=30.0)
        self.db = sqlite_utils.Database(conn)
        _use_wal(conn)
        self.db.execute("PRAGMA synchronous=NORMAL")
        try:
            schema_store.migrate(conn, str(path), MIGRATIONS, AggregatorError)
        except AggregatorError:
            conn.close()
            raise

    @classmethod
    def read_only(cls, path: Path | str) -> "RunStore":
        """The store opened for reading only (a metrics scrape of a running job): no WAL
        switch, no migration, never a write lock; a store of a newer fedge is refused."""
        conn = sqlite3.connect(
            f"file:{Path(path).resolve()}?mode=ro", uri=True, isolation_level=None, timeout=30.0
        )
        try:
            schema_store.refuse_newer(conn, str(path), MIGRATIONS, AggregatorError)
        except (AggregatorError, sqlite3.Error):
            conn.close()
            raise
        store = cls.__new__(cls)
        store.db = sqlite_utils.Database(conn)
        return store

    @property
    def conn(self) -> sqlite3.Connection:
        return self.db.conn

    def close(self) -> None:
        self.conn.close()

    # -- runs

    def create_run(self, run_id: str, manifest: str, state: RunState = RunState.QUEUED) -> None:
        now = time.time()
        self.conn.execute(
            "INSERT INTO runs (run_id, manifest, state, created_at, updated_at) VALUES (?,?,?,?,?)",
            (run_id, manifest, state.value, now, now),
        )

    def set_state(self, run_id: str, state: RunState, error: str = "") -> None:
        self.conn.execute(
            "UPDATE runs SET state=?, error=?, updated_at=? WHERE run_id=?",
            (state.value, error[:2000], time.time(), run_id),
        )

    def run(self, run_id: str) -> dict[str, Any] | None:
        rows = list(self.db.query("SELECT * FROM runs WHERE run_id=?", (run_id,)))
        return rows[0] if rows else None

    def runs(self) -> list[dict[str, Any]]:
        return list(
            self.db.query(
                "SELECT run_id, state, last_round, created_at, updated_at, error FROM runs "
                "ORDER BY created_at"
            )
        )

    # -- rounds

    def record_round(self, run_id: str, record: RoundRecord) -> None:
        """Idempotent per (run, round): a resumed run re-recording a round overwrites it."""
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.execute(
                "INSERT OR REPLACE INTO rounds VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    run_id,
                    record.server_round,
                    record.tier,
                    json.dumps(record.selected),
                    json.dumps(record.on_time),
                    json.dumps(record.late),
                    json.dumps(record.failed),
                    json.dumps({str(k): v for k, v in record.failures.items()}),
                    record.round_time_s,
                    record.elapsed_s,
                    record.quorum,
                    int(record.quorum_met),
                    record.deadline_s,
                    record.stale_folded,
                    json.dumps(record.train_metrics),
                    json.dumps(record.eval_metrics),
                    time.time(),
                ),
            )
            self.conn.execute(
                "UPDATE runs SET last_round=max(last_round, ?), updated_at=? WHERE run_id=?",
                (record.server_round, time.time(), run_id),
            )

    def rounds(self, run_id: str) -> list[dict[str, Any]]:
        rows = list(self.db.query("SELECT * FROM rounds WHERE run_id=? ORDER BY round", (run_id,)))
        for row in rows:
            for key in _JSON_COLUMNS:
                row[key] = json.loads(row[key])
        return rows

    # -- profiles

    def save_profiles(
        self, run_id: str, profiles: dict[int, LatencyProfile], tiers: Tiers | None
    ) -> None:
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                "INSERT OR REPLACE INTO profiles VALUES (?,?,?,?,?,?,?)",
                [
                    (
                        run_id,
                        _party_in(party),
                        p.mean_s,
                        p.count,
                        p.last_s,
                        p.timeouts,
                        None if tiers is None else tiers.tier_of(party),
                    )
                    for party, p in profiles.items()
                ],
            )

    def profiles(self, run_id: str) -> list[dict[str, Any]]:
        rows = list(self.db.query("SELECT * FROM profiles WHERE run_id=?", (run_id,)))
        for row in rows:
            row["party"] = _party_out(int(row["party"]))
        return sorted(rows, key=lambda row: int(row["party"]))

    # -- parties by name, and their own evaluations (fleet jobs)

    def name_parties(self, run_id: str, names: dict[int, str]) -> None:
        """Record which party id is which station (ids are what rounds and profiles hold)."""
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                "INSERT OR REPLACE INTO parties VALUES (?,?,?)",
                [(run_id, _party_in(party), name) for party, name in names.items()],
            )

    def party_names(self, run_id: str) -> dict[int, str]:
        rows = self.conn.execute(
            "SELECT party, name FROM parties WHERE run_id=?", (run_id,)
        ).fetchall()
        return {_party_out(int(party)): str(name) for party, name in rows}

    def record_party_metrics(
        self, run_id: str, server_round: int, metrics: dict[int, dict[str, float]]
    ) -> None:
        """What each on-time party reported for a round (examples, train time, accuracy)."""
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                "INSERT OR REPLACE INTO party_rounds VALUES (?,?,?,?)",
                [(run_id, server_round, _party_in(p), json.dumps(m)) for p, m in metrics.items()],
            )

    def record_replies(self, run_id: str, server_round: int, replies: dict[int, Message]) -> None:
        """The numeric metrics of each on-time reply (a strategy's reply observer)."""
        per_party: dict[int, dict[str, float]] = {}
        for party, reply in replies.items():
            values: dict[str, float] = {}
            for metric_record in reply.content.metric_records.values():
                for key, value in metric_record.items():
                    if isinstance(value, int | float) and math.isfinite(float(value)):
                        values[key] = float(value)
            per_party[party] = values
        self.record_party_metrics(run_id, server_round, per_party)

    def privacy_spent(self, run_id: str) -> list[dict[str, Any]]:
        """Per party: DP-SGD rounds trained and epsilon spent in this job (newest report).

        Rows ``{"party", "name", "rounds", "epsilon_job", "epsilon_total", "last_round"}``;
        parties that never reported a DP round are left out. A central-DP job adds one row
        first (``party`` None, :data:`CENTRAL_DP_ROW`): the station-level epsilon its
        released rounds cost every station (:meth:`central_privacy_spent`).
        """
        central = self.central_privacy_spent(run_id)
        names = self.party_names(run_id)
        spent: dict[int, dict[str, Any]] = {}
        for row in self.party_metrics(run_id):
            metrics = row["metrics"]
            if "dp-epsilon-job" not in metrics:
                continue
            party = int(row["party"])
            entry = spent.setdefault(
                party, {"party": party, "name": names.get(party, str(party)), "rounds": 0}
            )
            entry["rounds"] += 1
            entry["epsilon_job"] = float(metrics["dp-epsilon-job"])
            entry["epsilon_total"] = float(
                metrics.get("dp-epsilon-total", metrics["dp-epsilon-job"])
            )
            entry["last_round"] = int(row["round"])
        return [*central, *(spent[p] for p in sorted(spent))]

    def central_privacy_spent(self, run_id: str) -> list[dict[str, Any]]:
        """Central DP's row: rounds released and the station epsilon after the newest round
        recorded (``dp-epsilon-station`` in the rounds' train metrics); none without."""
        row: dict[str, Any] | None = None
        for recorded in self.rounds(run_id):
            metrics = recorded["train_metrics"]
            if STATION_EPSILON_KEY not in metrics:
                continue
            row = row or {"party": None, "name": CENTRAL_DP_ROW, "rounds": 0, "last_round": 0}
            row["epsilon_job"] = row["epsilon_total"] = float(metrics[STATION_EPSILON_KEY])
            if metrics.get(RELEASED_KEY, 1.0):
                row["rounds"] += 1
                row["last_round"] = int(recorded["round"])
        return [] if row is None else [row]

    def party_metrics(self, run_id: str) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT round, party, metrics FROM party_rounds WHERE run_id=? ORDER BY round, party",
            (run_id,),
        ).fetchall()
        return [
            {"round": r, "party": _party_out(int(p)), "metrics": json.loads(m)} for r, p, m in rows
        ]

    def record_evaluation(
        self, run_id: str, server_round: int, results: list[PartyEvaluation]
    ) -> None:
        """Every party's evaluation of one round's model (round 0: the starting model)."""
        now = time.time()
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                "INSERT OR REPLACE INTO evaluations VALUES (?,?,?,?,?,?,?)",
                [
                    (run_id, server_round, r.party, r.accuracy, r.examples, r.error, now)
                    for r in results
                ],
            )

    def evaluations(self, run_id: str) -> list[dict[str, Any]]:
        return list(
            self.db.query(
                "SELECT round, party, accuracy, examples, error FROM evaluations "
                "WHERE run_id=? ORDER BY round, party",
                (run_id,),
            )
        )

    def last_evaluation_at(self, run_id: str, server_round: int) -> float | None:
        """When the last party's evaluation of ``server_round``'s model was recorded
        (None: none was)."""
        row = self.conn.execute(
            "SELECT max(recorded_at) FROM evaluations WHERE run_id=? AND round=?",
            (run_id, server_round),
        ).fetchone()
        return None if row[0] is None else float(row[0])
