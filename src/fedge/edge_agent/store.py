"""The agent's own SQLite file: durable state, the outbox, and local labels.

Several threads (inference, publisher, MQTT callbacks) and the ``fedge agent label``
command share it, so each method takes the lock and commits before returning. WAL with
``synchronous=NORMAL`` survives a SIGKILL of the agent; a record is in the file before
``score()`` returns.

Records go through two tables: ``pending`` (one row per record, written by the producer)
and ``outbox`` (numbered batches, the exact bytes to publish). A batch row is deleted
only when the broker acknowledged it.
"""

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge import schema_store
from fedge.edge_agent.errors import AgentError
from fedge.protocols import codec
from fedge.protocols.records import (
    BATCH_LIMIT,
    RECORD_TYPE,
    LabelRecord,
    PredictionRecord,
    Record,
    RecordBatch,
    Stream,
)

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pending (
    id INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT NOT NULL, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT NOT NULL, seq INTEGER NOT NULL,
    n_records INTEGER NOT NULL, payload BLOB NOT NULL, UNIQUE (stream, seq));
CREATE TABLE IF NOT EXISTS labels (
    label_id TEXT PRIMARY KEY, prediction_id TEXT NOT NULL, label TEXT NOT NULL,
    who TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS predictions (
    prediction_id TEXT PRIMARY KEY, at REAL NOT NULL, model TEXT NOT NULL,
    decision TEXT NOT NULL, source TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS predictions_source ON predictions (source);
CREATE INDEX IF NOT EXISTS predictions_at ON predictions (at);
CREATE INDEX IF NOT EXISTS labels_at ON labels (at);
"""

# Added after the first release: which inbox arrival a prediction scored (see
# fedge.edge_agent.inference.watcher.arrival_key; '' for API and CLI predictions). Files written by
# older agents gain the column on open (migration 2).
ARRIVAL_COLUMN = "arrival"


def _arrival(conn: sqlite3.Connection) -> None:
    schema_store.add_column(conn, "predictions", ARRIVAL_COLUMN, "TEXT NOT NULL DEFAULT ''")
    conn.execute(
        f"CREATE INDEX IF NOT EXISTS predictions_arrival ON predictions ({ARRIVAL_COLUMN}) "
        f"WHERE {ARRIVAL_COLUMN} != ''"
    )


# Added for issue 28: the anomaly model a prediction was scored with beside the
# classifier, and its score ('' and NULL without one). Files of before gain them on open.
ANOMALY_COLUMNS = (("anomaly_model", "TEXT NOT NULL DEFAULT ''"), ("anomaly_score", "REAL"))


def _anomaly(conn: sqlite3.Connection) -> None:
    for column, definition in ANOMALY_COLUMNS:
        schema_store.add_column(conn, "predictions", column, definition)


# The agent file's schema versions (fedge/schema_store.py; 0: written before versions,
# by any earlier agent). A change to SCHEMA is a new migration here.
MIGRATIONS: tuple[schema_store.Migration, ...] = (
    schema_store.Migration(1, "every table and index of SCHEMA", schema_store.script(SCHEMA)),
    schema_store.Migration(2, "predictions.arrival and its index", _arrival),
    schema_store.Migration(3, "predictions.anomaly_model, anomaly_score (issue 28)", _anomaly),
)
SCHEMA_VERSION = len(MIGRATIONS)


def _record_json(record: Record) -> str:
    # Records are flat dataclasses of plain values: their __dict__ is their JSON form
    # (a prediction's anomaly score is the one nested dataclass, issue 28).
    plain = vars(record)
    anomaly = getattr(record, "anomaly", None)
    if anomaly is not None:
        plain = {**plain, "anomaly": vars(anomaly)}
    return json.dumps(plain, separators=(",", ":"))


@dataclass(frozen=True)
class OutboxEntry:
    id: int
    stream: Stream
    seq: int
    payload: bytes


# The write-ahead log is checkpointed into the file by a thread of its own, every
# CHECKPOINT_EVERY_S, so that scoring calls rarely pay for it: SQLite's automatic
# checkpoint runs in the COMMIT that crosses its threshold (1,000 pages by default), and
# at a prediction's ~8 pages that was one request in ~125 taking ~4 ms more (issue 25: the
# line camera's p99). The log rewinds only when a checkpoint finishes between two
# commits, so under back-to-back scoring it still grows to the automatic checkpoint,
# kept as the backstop at 4x the default: one commit in ~500 then pays, for what the
# thread has not copied yet. (A larger log slows every commit's page lookups; at 16,384
# pages the median commit was 15 % slower.)
CHECKPOINT_EVERY_S = 0.5
BACKSTOP_CHECKPOINT_PAGES = 4096


class LocalStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._conn = sqlite3.connect(
            str(path), isolation_level=None, check_same_thread=False, timeout=30.0
        )
        self._lock = threading.Lock()
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_CHECKPOINT_PAGES}")
        # Under BEGIN IMMEDIATE: `fedge agent label` may open the file while the agent
        # starts, and only one of them migrates it.
        try:
            schema_store.migrate(self._conn, str(path), MIGRATIONS, AgentError)
        except AgentError:
            self._conn.close()
            raise
        self._closing = threading.Event()
        self.checkpoint_failures = 0
        self._checkpointer = threading.Thread(
            target=self._checkpoint_loop, name="agent-db-checkpoint", daemon=True
        )
        self._checkpointer.start()

    def close(self) -> None:
        self._closing.set()
        if self._checkpointer is not threading.current_thread():
            self._checkpointer.join(timeout=30.0)
        with self._lock:
            self._conn.close()

    def _checkpoint_loop(self) -> None:
        """PASSIVE checkpoints on a connection of this thread's own: they copy what no
        reader still needs and never wait for the writer, which goes on committing."""
        conn = sqlite3.connect(str(self.path), isolation_level=None, timeout=30.0)
        failing = False
        try:
            while not self._closing.wait(CHECKPOINT_EVERY_S):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as exc:  # a full disk: the backstop still bounds the log
                    self.checkpoint_failures += 1  # counted every time, said once a run
                    if not failing:
                        log.warning("agent.db checkpoint failed (%s); retrying", exc)
                    failing = True
                    continue
                if failing:
                    log.info("agent.db checkpoints work again")
                failing = False
        finally:
            conn.close()

    @contextmanager
    def _transaction(self, begin: str = "BEGIN") -> Iterator[sqlite3.Connection]:
        """One transaction under the lock, rolled back on any failure.

        A full disk fails an INSERT or the COMMIT itself; rolled back, the connection is
        usable again and what was committed before stays (nothing half-written), so the
        outbox keeps every batch that was already durable.
        """
        with self._lock:
            self._conn.execute(begin)
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    # -- key/value state

    def get(self, key: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def put(self, key: str, value: str) -> None:
        with self._lock:
            self._conn.execute(
                "INSERT INTO kv (key, value) VALUES (?,?) "
                "ON CONFLICT (key) DO UPDATE SET value=excluded.value",
                (key, value),
            )

    def put_many(self, values: Mapping[str, str]) -> None:
        """Several keys in one transaction: a kill leaves all of them written or none
        (a deployment's pointers, its trial and its done version go together)."""
        with self._transaction() as conn:
            conn.executemany(
                "INSERT INTO kv (key, value) VALUES (?,?) "
                "ON CONFLICT (key) DO UPDATE SET value=excluded.value",
                list(values.items()),
            )

    def next_session(self) -> int:
        """Increment and persist the session counter (one per connection attempt)."""
        with self._transaction("BEGIN IMMEDIATE") as conn:
            row = conn.execute("SELECT value FROM kv WHERE key='session'").fetchone()
            session = 0 if row is None else int(row[0]) + 1
            conn.execute(
                "INSERT INTO kv (key, value) VALUES ('session', ?) "
                "ON CONFLICT (key) DO UPDATE SET value=excluded.value",
                (str(session),),
            )
        return session

    # -- records

    def add_record(self, stream: Stream, record: Record) -> None:
        if isinstance(record, PredictionRecord):
            self.add_predictions([record])
            return
        with self._lock:
            self._conn.execute(
                "INSERT INTO pending (stream, record) VALUES (?,?)",
                (stream.value, _record_json(record)),
            )

    def add_predictions(
        self, records: Sequence[PredictionRecord], arrivals: Sequence[str] = ()
    ) -> None:
        """Queue predictions for reporting and index them, in one transaction.

        ``arrivals`` (one per record, or none) are the inbox arrivals they scored: in the
        same transaction, so a file scored before a crash is known to be (see
        :meth:`scored_arrival`).
        """
        if not records:
            return
        if arrivals and len(arrivals) != len(records):
            raise ValueError(f"{len(records)} predictions but {len(arrivals)} arrivals")
        keys = arrivals or [""] * len(records)
        pending = [(Stream.PREDICTIONS.value, _record_json(r)) for r in records]
        index = [
            (
                r.prediction_id,
                r.at,
                r.model,
                r.decision,
                r.source,
                key,
                "" if r.anomaly is None else r.anomaly.model,
                None if r.anomaly is None else r.anomaly.score,
            )
            for r, key in zip(records, keys, strict=True)
        ]
        with self._transaction() as conn:
            conn.executemany("INSERT INTO pending (stream, record) VALUES (?,?)", pending)
            conn.executemany(
                "INSERT OR IGNORE INTO predictions (prediction_id, at, model, decision, "
                f"source, {ARRIVAL_COLUMN}, anomaly_model, anomaly_score) "
                "VALUES (?,?,?,?,?,?,?,?)",
                index,
            )

    def add_label(self, label_id: str, prediction_id: str, label: str, who: str, at: float) -> bool:
        """Store a label locally (kept for local training) and queue it for reporting."""
        record = LabelRecord(label_id, prediction_id, label, who, at)
        with self._transaction() as conn:
            inserted = conn.execute(
                "INSERT OR IGNORE INTO labels VALUES (?,?,?,?,?)",
                (label_id, prediction_id, label, who, at),
            ).rowcount
            if inserted:
                conn.execute(
                    "INSERT INTO pending (stream, record) VALUES (?,?)",
                    (Stream.LABELS.value, json.dumps(codec.to_plain(record))),
                )
        return bool(inserted)

    def add_remote_label(
        self, label_id: str, prediction_id: str, label: str, who: str, at: float
    ) -> bool:
        """Store a label given at the manager (it is there already: nothing is queued up)."""
        with self._lock:
            inserted = self._conn.execute(
                "INSERT OR IGNORE INTO labels VALUES (?,?,?,?,?)",
                (label_id, prediction_id, label, who, at),
            ).rowcount
        return bool(inserted)

    def withdraw_label(self, prediction_id: str, at: float) -> int:
        """Drop the prediction's labels given at or before ``at`` (an operator's
        withdrawal then), unless a label given after stands; how many went. The same rule
        as the station's training set (StationData.unlabel), so the two agree; applying a
        withdrawal again removes nothing more."""
        with self._lock:
            return int(
                self._conn.execute(
                    "DELETE FROM labels WHERE prediction_id=? AND at <= ? AND NOT EXISTS "
                    "(SELECT 1 FROM labels WHERE prediction_id=? AND at > ?)",
                    (prediction_id, at, prediction_id, at),
                ).rowcount
            )

    def has_prediction(self, prediction_id: str) -> bool:
        with self._lock:
            row = self._conn.execute(
                "SELECT 1 FROM predictions WHERE prediction_id=?", (prediction_id,)
            ).fetchone()
        return row is not None

    def anomaly_models(self) -> dict[str, str]:
        """The anomaly model each prediction was scored with beside the classifier, by
        prediction id (issue 28; those scored without one are left out)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT prediction_id, anomaly_model FROM predictions WHERE anomaly_model != ''"
            ).fetchall()
        return {str(p): str(m) for p, m in rows}

    def has_source(self, source: str) -> bool:
        with self._lock:
            row = self._conn.execute(
                "SELECT 1 FROM predictions WHERE source=? LIMIT 1", (source,)
            ).fetchone()
        return row is not None

    def scored_arrival(self, arrival: str, source: str, modified_at: float) -> bool:
        """Whether the inbox arrival ``arrival`` was scored already (before a crash).

        A prediction an older agent recorded has no arrival; it covers a file of the same
        source only if the file was last written before that prediction was made (a file
        whose name is reused later is written later).
        """
        # "arrival != ''" lets SQLite use the partial index predictions_arrival (it
        # cannot prove a bound parameter non-empty): without it every inbox file cost a
        # scan of every prediction the station indexes (issue 25).
        with self._lock:
            row = self._conn.execute(
                f"SELECT 1 FROM predictions WHERE {ARRIVAL_COLUMN}=? AND {ARRIVAL_COLUMN}!='' "
                "UNION ALL "
                f"SELECT 1 FROM predictions WHERE {ARRIVAL_COLUMN}='' AND source=? AND at>=? "
                "LIMIT 1",
                (arrival, source, modified_at),
            ).fetchone()
        return row is not None

    def labels(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT label_id, prediction_id, label, who, at FROM labels ORDER BY at"
            ).fetchall()
        keys = ("label_id", "prediction_id", "label", "who", "at")
        return [dict(zip(keys, row, strict=True)) for row in rows]

    def seal_batches(self, edge: str, session: int, max_records: int) -> int:
        """Move pending records into numbered outbox batches; return how many were sealed.

        The seq counter, the new batch and the removal of its records commit together, so
        a crash leaves either the records pending or the batch in the outbox, never both.
        """
        sealed = 0
        for stream in Stream:
            # Large records (thumbnails) go fewer to a batch: it stays under the codec limit.
            limit = min(max_records, BATCH_LIMIT.get(stream, max_records))
            while self._seal_one(edge, session, stream, limit):
                sealed += 1
        return sealed

    def drop_pending(self, stream: Stream) -> int:
        """Forget ``stream``'s records not yet sealed into a batch; return how many."""
        with self._lock:
            return int(
                self._conn.execute("DELETE FROM pending WHERE stream=?", (stream.value,)).rowcount
            )

    def _seal_one(self, edge: str, session: int, stream: Stream, max_records: int) -> bool:
        with self._transaction("BEGIN IMMEDIATE") as conn:
            rows = conn.execute(
                "SELECT id, record FROM pending WHERE stream=? ORDER BY id LIMIT ?",
                (stream.value, max_records),
            ).fetchall()
            if not rows:
                return False
            decode = codec.decoder_for(RECORD_TYPE[stream])
            records = tuple(decode(json.loads(r[1]), "record") for r in rows)
            key = f"seq.{stream.value}"
            row = conn.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
            seq = 0 if row is None else int(row[0])
            batch = RecordBatch(edge, stream, session, seq, records)
            conn.execute(
                "INSERT INTO outbox (stream, seq, n_records, payload) VALUES (?,?,?,?)",
                (stream.value, seq, len(records), codec.encode(batch)),
            )
            conn.execute(
                "DELETE FROM pending WHERE stream=? AND id<=?", (stream.value, rows[-1][0])
            )
            conn.execute(
                "INSERT INTO kv (key, value) VALUES (?,?) "
                "ON CONFLICT (key) DO UPDATE SET value=excluded.value",
                (key, str(seq + 1)),
            )
        return True

    def outbox(self, limit: int, exclude: set[int]) -> list[OutboxEntry]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, stream, seq, payload FROM outbox ORDER BY id LIMIT ?",
                (limit + len(exclude),),
            ).fetchall()
        entries = [OutboxEntry(int(r[0]), Stream(r[1]), int(r[2]), bytes(r[3])) for r in rows]
        return [e for e in entries if e.id not in exclude][:limit]

    def acknowledge(self, entry_id: int) -> None:
        """Forget an acknowledged batch and note when: the station's last contact with
        the far side that survives a restart (``fedge agent status``, issue 27), in the
        same commit."""
        with self._transaction() as conn:
            conn.execute("DELETE FROM outbox WHERE id=?", (entry_id,))
            conn.execute(_PUT, (LAST_ACKNOWLEDGED, repr(time.time())))

    def facts(self) -> "StoreFacts":
        """What ``fedge agent status`` shows from this file (see :func:`read_facts`)."""
        with self._lock:
            return _facts(self._conn)

    def prune(self, before: float, limit: int = 5000) -> int:
        """Forget the predictions and labels recorded before ``before``; return how many.

        They are the station's own index (which predictions exist to be labelled, which
        inbox files were scored) and would grow with every image forever (issue 9,
        defect 8). What is still to be sent lives in ``pending`` and ``outbox``, which
        this never touches. At most ``limit`` rows of each per call: one short
        transaction, so scoring never waits long.
        """
        removed = 0
        with self._transaction() as conn:
            for table in ("predictions", "labels"):
                removed += conn.execute(
                    f"DELETE FROM {table} WHERE rowid IN "
                    f"(SELECT rowid FROM {table} WHERE at < ? LIMIT ?)",
                    (before, limit),
                ).rowcount
        return removed

    def backlog(self) -> dict[str, int]:
        with self._lock:
            pending = self._conn.execute("SELECT count(*) FROM pending").fetchone()[0]
            outbox = self._conn.execute("SELECT count(*) FROM outbox").fetchone()[0]
        return {"pending_records": int(pending), "outbox_batches": int(outbox)}

    def oldest_unsent_at(self) -> float | None:
        """When the oldest record the manager has not acknowledged was made (None: all
        sent): the first outbox batch's first record, else the first pending record."""
        with self._lock:
            return _oldest_unsent(self._conn)


# -- the file read from outside the agent (a benchmark checking what a station holds)


@contextmanager
def _read_only(path: Path) -> Iterator[sqlite3.Connection]:
    # Read-only, so a reader never writes the running agent's file (WAL lets it read).
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30.0)
    try:
        yield conn
    finally:
        conn.close()


def read_value(path: Path, key: str) -> str | None:
    """The state value ``key`` in the agent file at ``path`` (None: not set)."""
    with _read_only(path) as conn:
        row = conn.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
    return None if row is None else str(row[0])


def read_prediction_count(path: Path) -> int:
    """How many predictions the agent file at ``path`` indexes."""
    with _read_only(path) as conn:
        return int(conn.execute("SELECT count(*) FROM predictions").fetchone()[0])


@dataclass(frozen=True)
class LocalRecords:
    """What an agent file holds: its predictions (id -> source) and its labels' ids."""

    sources: Mapping[str, str]
    label_ids: frozenset[str]


def read_records(path: Path) -> LocalRecords:
    """The predictions and labels in the agent file at ``path``."""
    with _read_only(path) as conn:
        predictions = conn.execute("SELECT prediction_id, source FROM predictions").fetchall()
        labels = conn.execute("SELECT label_id FROM labels").fetchall()
    return LocalRecords(
        {str(p): str(s) for p, s in predictions}, frozenset(str(r[0]) for r in labels)
    )


# -- what `fedge agent status` shows (issue 27, item 7): from the running agent (its local
# API calls LocalStore.facts) or from the file alone, read-only, when it is not running.

LAST_ACKNOWLEDGED = "last_acknowledged_at"
_PUT = (
    "INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value=excluded.value"
)


def _oldest_unsent(conn: sqlite3.Connection) -> float | None:
    row = conn.execute(
        "SELECT json_extract(CAST(payload AS TEXT), '$.records[0].at') FROM outbox "
        "ORDER BY id LIMIT 1"
    ).fetchone()
    if row is None:
        row = conn.execute(
            "SELECT json_extract(record, '$.at') FROM pending ORDER BY id LIMIT 1"
        ).fetchone()
    return None if row is None or row[0] is None else float(row[0])


@dataclass(frozen=True)
class StoreFacts:
    """The station's counts and pointers as its file holds them. Predictions and labels
    are those still indexed (retention prunes them); ``None`` times: never / nothing."""

    predictions: int
    rejects: int
    labels: int
    pending_records: int
    outbox_batches: int
    oldest_unsent_at: float | None
    last_acknowledged_at: float | None
    active_model: str | None  # the active-model pointer (deploy/restore.py's JSON)
    applied_config: str | None  # the config in force (encoded EdgeConfig)


def _facts(conn: sqlite3.Connection) -> StoreFacts:
    def count(sql: str) -> int:
        return int(conn.execute(sql).fetchone()[0])

    def value(key: str) -> str | None:
        row = conn.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    acknowledged = value(LAST_ACKNOWLEDGED)
    return StoreFacts(
        predictions=count("SELECT count(*) FROM predictions"),
        rejects=count("SELECT count(*) FROM predictions WHERE decision='reject'"),
        labels=count("SELECT count(*) FROM labels"),
        pending_records=count("SELECT count(*) FROM pending"),
        outbox_batches=count("SELECT count(*) FROM outbox"),
        oldest_unsent_at=_oldest_unsent(conn),
        last_acknowledged_at=None if acknowledged is None else float(acknowledged),
        active_model=value("active_model"),
        applied_config=value("applied_config"),
    )


def read_facts(path: Path) -> StoreFacts:
    """:class:`StoreFacts` of the agent file at ``path``, read-only (the agent may be
    running, or not: WAL lets a reader in either way, and nothing is written)."""
    if not path.is_file():
        raise AgentError(f"no agent file at {path}: has this agent run with this data_dir yet?")
    try:
        with _read_only(path) as conn:
            return _facts(conn)
    except sqlite3.Error as exc:
        raise AgentError(f"cannot read {path}: {exc}; is it an agent's agent.db?") from None
