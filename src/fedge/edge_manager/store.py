"""The manager's SQLite store (sqlite-utils), the source of truth of the control plane.

One writer per process (the serve loop's worker thread, or a CLI command); WAL lets the
CLI and ``serve`` share the file. No sqlite row leaves this module: readers get dicts of
plain values or dataclasses.

Code outside the storage modules (``store.py``, ``*_store.py``) holds an open
transaction as a :data:`Transaction` and hands it to a store function; it never runs a
statement on it and does not import ``sqlite3`` (tests/test_storage_boundary.py).
"""

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias

import sqlite_utils

from fedge import schema_store
from fedge.edge_manager.errors import ManagerError

SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT NOT NULL, version INTEGER NOT NULL, sha256 TEXT NOT NULL, size INTEGER NOT NULL,
    manifest TEXT NOT NULL, envelope TEXT NOT NULL, path TEXT NOT NULL,
    parent_version INTEGER, run_id TEXT, created_at REAL NOT NULL,
    PRIMARY KEY (name, version));
CREATE TABLE IF NOT EXISTS edges (
    edge TEXT PRIMARY KEY, enrolled_at REAL NOT NULL, token_sha256 TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'never-seen', session INTEGER NOT NULL DEFAULT -1,
    last_seen REAL, agent_version TEXT NOT NULL DEFAULT '', serving TEXT NOT NULL DEFAULT '',
    config_applied INTEGER NOT NULL DEFAULT 0, config_status TEXT NOT NULL DEFAULT '',
    config_reason TEXT NOT NULL DEFAULT '', config_reported_at REAL,
    deploy_id TEXT NOT NULL DEFAULT '', deploy_stage TEXT NOT NULL DEFAULT '',
    deploy_reason TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS desired (
    edge TEXT NOT NULL, kind TEXT NOT NULL, version INTEGER NOT NULL,
    document TEXT NOT NULL, envelope TEXT NOT NULL, created_at REAL NOT NULL,
    published_at REAL, superseded INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (edge, kind, version));
CREATE INDEX IF NOT EXISTS desired_unpublished ON desired (created_at)
    WHERE published_at IS NULL AND superseded = 0;
CREATE TABLE IF NOT EXISTS fleet_jobs (
    job_dir TEXT PRIMARY KEY, name TEXT NOT NULL, model TEXT NOT NULL,
    prepared_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS trust_links (
    sequence INTEGER PRIMARY KEY, signer TEXT NOT NULL, new_key TEXT NOT NULL,
    envelope TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS edge_trust (
    edge TEXT PRIMARY KEY, status TEXT NOT NULL, key_id TEXT NOT NULL,
    sequence INTEGER NOT NULL, reason TEXT NOT NULL, reported_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS deployments (
    deployment_id TEXT PRIMARY KEY, model_name TEXT NOT NULL, model_version INTEGER NOT NULL,
    edges TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS deploy_events (
    edge TEXT NOT NULL, deployment_id TEXT NOT NULL, stage TEXT NOT NULL,
    reason TEXT NOT NULL, serving TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    edge TEXT NOT NULL, stream TEXT NOT NULL, seq INTEGER NOT NULL, session INTEGER NOT NULL,
    n_records INTEGER NOT NULL, received_at REAL NOT NULL,
    PRIMARY KEY (edge, stream, seq)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS streams (
    edge TEXT NOT NULL, stream TEXT NOT NULL, max_seq INTEGER NOT NULL,
    batches INTEGER NOT NULL, duplicates INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (edge, stream));
CREATE TABLE IF NOT EXISTS gaps (
    edge TEXT NOT NULL, stream TEXT NOT NULL, from_seq INTEGER NOT NULL, to_seq INTEGER NOT NULL,
    detected_at REAL NOT NULL, PRIMARY KEY (edge, stream, from_seq));
-- Records are stored without a unique key on purpose: exactly-once is enforced by the
-- batches table, and a duplicate would show up here (the ingest benchmark counts them).
CREATE TABLE IF NOT EXISTS telemetry (
    edge TEXT NOT NULL, seq INTEGER NOT NULL, idx INTEGER NOT NULL,
    name TEXT NOT NULL, value REAL NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS predictions (
    prediction_id TEXT NOT NULL, edge TEXT NOT NULL, seq INTEGER NOT NULL, at REAL NOT NULL,
    model TEXT NOT NULL, scores TEXT NOT NULL, decision TEXT NOT NULL, threshold REAL NOT NULL,
    config_version INTEGER NOT NULL, latency_ms REAL NOT NULL, source TEXT NOT NULL,
    stats TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS predictions_id ON predictions (prediction_id);
CREATE INDEX IF NOT EXISTS predictions_edge ON predictions (edge);
CREATE TABLE IF NOT EXISTS labels (
    label_id TEXT PRIMARY KEY, prediction_id TEXT NOT NULL, edge TEXT NOT NULL,
    label TEXT NOT NULL, who TEXT NOT NULL, at REAL NOT NULL, origin TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS labels_prediction ON labels (prediction_id);
-- One current label per prediction in `labels` (labels.py, issue 15); the labels it
-- replaced, and late ones older than it, with what replaced them and when.
CREATE TABLE IF NOT EXISTS label_history (
    label_id TEXT PRIMARY KEY, prediction_id TEXT NOT NULL, edge TEXT NOT NULL,
    label TEXT NOT NULL, who TEXT NOT NULL, at REAL NOT NULL, origin TEXT NOT NULL,
    replaced_by TEXT NOT NULL, replaced_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS label_history_prediction ON label_history (prediction_id);
CREATE INDEX IF NOT EXISTS label_history_at ON label_history (at);
CREATE TABLE IF NOT EXISTS rejections (
    at REAL NOT NULL, edge TEXT NOT NULL, topic TEXT NOT NULL, reason TEXT NOT NULL,
    detail TEXT NOT NULL);
-- Retention (retention.py): records are pruned oldest first by their own time; per
-- stream, the highest seq whose batch key was pruned (a redelivered pruned batch is
-- still a duplicate); and the rows pruned so far.
CREATE INDEX IF NOT EXISTS predictions_at ON predictions (at);
CREATE INDEX IF NOT EXISTS telemetry_at ON telemetry (at);
CREATE INDEX IF NOT EXISTS labels_at ON labels (at);
CREATE TABLE IF NOT EXISTS pruned_batches (
    edge TEXT NOT NULL, stream TEXT NOT NULL, through_seq INTEGER NOT NULL,
    batches INTEGER NOT NULL, PRIMARY KEY (edge, stream));
CREATE TABLE IF NOT EXISTS retention_totals (
    what TEXT PRIMARY KEY, rows INTEGER NOT NULL, last_at REAL NOT NULL);
-- The closed loop (issue "The closed loop"). The validation gate's verdicts: the newest
-- row of a model is its verdict; ``evidence`` is JSON (per station and overall accuracy
-- of the candidate and the serving model, the policy, the evaluation it came from).
CREATE TABLE IF NOT EXISTS gate_results (
    name TEXT NOT NULL, version INTEGER NOT NULL, blessed INTEGER NOT NULL,
    evidence TEXT NOT NULL, eval_id TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (name, version, at));
-- What stations report when the gate asks them to score their held-out labelled images
-- with a model: one row per (evaluation, edge, prediction, model); ``scores`` and
-- ``stats`` are JSON objects (class -> probability; monitoring.features.image_stats).
-- The images never leave the station; these rows also train the MPP predictor.
CREATE TABLE IF NOT EXISTS evaluations (
    eval_id TEXT NOT NULL, edge TEXT NOT NULL, prediction_id TEXT NOT NULL,
    model TEXT NOT NULL, label TEXT NOT NULL, scores TEXT NOT NULL, stats TEXT NOT NULL,
    at REAL NOT NULL, PRIMARY KEY (eval_id, edge, prediction_id, model));
-- One row per station report of an evaluation (edge_manager/gate/reports.py): done or
-- failed (and why), how many held-out labelled images the station has, how many items it
-- sent; the gate reads which stations answered here, their items in `evaluations`.
CREATE TABLE IF NOT EXISTS evaluation_reports (
    eval_id TEXT NOT NULL, edge TEXT NOT NULL, version INTEGER NOT NULL, status TEXT NOT NULL,
    reason TEXT NOT NULL, holdout INTEGER NOT NULL, items INTEGER NOT NULL,
    reported_at REAL NOT NULL, received_at REAL NOT NULL, foreign_items INTEGER NOT NULL
    DEFAULT 0, rejected_items INTEGER NOT NULL DEFAULT 0, dropped_reason TEXT NOT NULL
    DEFAULT '', PRIMARY KEY (eval_id, edge));
-- Alerts (drift, estimated accuracy) per edge: open while cleared_at IS NULL.
CREATE TABLE IF NOT EXISTS alerts (
    alert_id TEXT PRIMARY KEY, edge TEXT NOT NULL, model TEXT NOT NULL, kind TEXT NOT NULL,
    value REAL NOT NULL, threshold REAL NOT NULL, detail TEXT NOT NULL,
    raised_at REAL NOT NULL, cleared_at REAL);
CREATE INDEX IF NOT EXISTS alerts_edge ON alerts (edge, raised_at);
-- Continuous training (fedge.loop): a policy per model (JSON of loop.policy.LoopPolicy),
-- its runs (job -> gate -> rollout, loop.pipeline) and every step they took.
CREATE TABLE IF NOT EXISTS loop_policies (
    model TEXT PRIMARY KEY, policy TEXT NOT NULL, enabled INTEGER NOT NULL,
    updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS loop_runs (
    run_id TEXT PRIMARY KEY, model TEXT NOT NULL, state TEXT NOT NULL, trigger TEXT NOT NULL,
    started_at REAL NOT NULL, updated_at REAL NOT NULL, job_dir TEXT NOT NULL,
    candidate TEXT NOT NULL, rollout_id TEXT NOT NULL, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS loop_events (
    run_id TEXT NOT NULL, at REAL NOT NULL, step TEXT NOT NULL, detail TEXT NOT NULL);
-- Label-free accuracy per edge, model and window: the MPP estimate, the calibration
-- baseline, and the true accuracy over the window's labelled predictions (if any).
CREATE TABLE IF NOT EXISTS estimates (
    edge TEXT NOT NULL, model TEXT NOT NULL, window_start REAL NOT NULL,
    window_end REAL NOT NULL, n INTEGER NOT NULL, mpp REAL, calibration REAL,
    labelled INTEGER NOT NULL, true_accuracy REAL,
    PRIMARY KEY (edge, model, window_start));
-- The MPP predictor of a model (monitoring.mpp.MppPredictor JSON), fitted on the model's
-- `evaluations` rows; refitted when their number changes (a new gate evaluation).
CREATE INDEX IF NOT EXISTS evaluations_model ON evaluations (model, edge);
-- Retention keeps each model's newest evaluations (retention/store.py): grouped by this.
CREATE INDEX IF NOT EXISTS evaluations_gates ON evaluations (model, eval_id, at);
CREATE TABLE IF NOT EXISTS mpp_models (
    model TEXT PRIMARY KEY, predictor TEXT NOT NULL, n_rows INTEGER NOT NULL,
    accuracy REAL NOT NULL, fitted_at REAL NOT NULL);
-- Operators' acknowledgements of alerts (`fedge alerts clear`): an acknowledged condition
-- is not raised again for its (edge, model, kind) until it has stopped holding once
-- (rearmed_at, set by the monitor); published_at: when serve announced the clearing.
CREATE TABLE IF NOT EXISTS alert_acks (
    alert_id TEXT PRIMARY KEY, edge TEXT NOT NULL, model TEXT NOT NULL, kind TEXT NOT NULL,
    who TEXT NOT NULL, note TEXT NOT NULL, at REAL NOT NULL, rearmed_at REAL,
    published_at REAL);
-- Staged rollouts (edge_manager/rollout/service.py, rollout.py): the plan is JSON
-- (rollout/plan.RolloutPlan); state pending|canary|wave|paused|completed|degraded|
-- aborted|rolled_back, wave the last wave moved (-1: none yet, 0: the canary); finished_at is set
-- once nothing more will happen. Per edge: its wave, state (waiting|moved|rolling_back|
-- rolled_back|unconfirmed: did not confirm its rollback in time), what it ran before it
-- moved (model ref, desired config JSON or NULL) to go back to, and the deployment and
-- config versions the rollout wrote for it. Events include unconfirmed, forced, error.
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT PRIMARY KEY, model_name TEXT NOT NULL, model_version INTEGER NOT NULL,
    plan TEXT NOT NULL, state TEXT NOT NULL, wave INTEGER NOT NULL,
    forced_unblessed INTEGER NOT NULL, reason TEXT NOT NULL, created_at REAL NOT NULL,
    updated_at REAL NOT NULL, finished_at REAL);
CREATE TABLE IF NOT EXISTS rollout_edges (
    rollout_id TEXT NOT NULL, edge TEXT NOT NULL, wave INTEGER NOT NULL, state TEXT NOT NULL,
    previous_model TEXT, previous_config TEXT, moved_at REAL, deployment_id TEXT,
    config_version INTEGER, restore_deployment_id TEXT, restore_config_version INTEGER,
    restored_at REAL, PRIMARY KEY (rollout_id, edge));
CREATE TABLE IF NOT EXISTS rollout_events (
    rollout_id TEXT NOT NULL, at REAL NOT NULL, kind TEXT NOT NULL, edge TEXT NOT NULL,
    detail TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS rollout_events_id ON rollout_events (rollout_id, at);
-- A rollout reads each moved edge's deploy events every tick (settled, failed, passed).
CREATE INDEX IF NOT EXISTS deploy_events_edge ON deploy_events (edge, deployment_id);
-- The monitor's reads per tick (edge_manager/monitor/tick.py) stay bounded as the store grows:
-- evaluation counts per (model, edge) from the index alone, open alerts, an (edge, model)'s
-- acknowledgements and the unpublished ones without a table scan. Predictions get no new
-- index (it would slow ingest): the monitor walks predictions_edge newest first. The
-- index evaluations_counts (model, edge, augmented) is created by the monitor: `augmented`
-- is an added column (ADDED_COLUMNS), absent when this script runs on an older store.
CREATE INDEX IF NOT EXISTS alerts_open ON alerts (cleared_at);
CREATE INDEX IF NOT EXISTS alert_acks_pair ON alert_acks (edge, model, kind);
CREATE INDEX IF NOT EXISTS alert_acks_unpublished ON alert_acks (at) WHERE published_at IS NULL;
-- The drift reference of an (edge, model) taken from its first predictions (no gate
-- evaluation there): the predictions' rowid bounds and the rows themselves (JSON list of
-- {scores, stats, at}; ~25 kB), so a restarted monitor compares with the same window even
-- after retention pruned it, never with whatever is oldest then (maybe the drift).
CREATE TABLE IF NOT EXISTS drift_references (
    edge TEXT NOT NULL, model TEXT NOT NULL, first_rowid INTEGER NOT NULL,
    last_rowid INTEGER NOT NULL, rows TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (edge, model));
-- The fleet CA's issued certificates (issue 13; serial as text: 160-bit numbers) and
-- enrollment tokens (only their SHA-256 is kept; single use, short-lived).
CREATE TABLE IF NOT EXISTS certificates (
    serial TEXT PRIMARY KEY, identity TEXT NOT NULL, role TEXT NOT NULL,
    fingerprint TEXT NOT NULL, not_after REAL NOT NULL, issued_at REAL NOT NULL,
    revoked_at REAL, pem TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS certificates_identity ON certificates (identity);
-- Thumbnails a station shares (thumbnail_store.py; only while its config says so),
-- keyed by edge too: one station cannot overwrite another's.
CREATE TABLE IF NOT EXISTS thumbnails (
    edge TEXT NOT NULL, prediction_id TEXT NOT NULL, at REAL NOT NULL, png BLOB NOT NULL,
    width INTEGER NOT NULL, height INTEGER NOT NULL, received_at REAL NOT NULL,
    PRIMARY KEY (edge, prediction_id));
CREATE INDEX IF NOT EXISTS thumbnails_edge_at ON thumbnails (edge, at);
CREATE INDEX IF NOT EXISTS thumbnails_at ON thumbnails (at);
CREATE TABLE IF NOT EXISTS enrollment_tokens (
    token_hash TEXT PRIMARY KEY, edge TEXT NOT NULL, created_at REAL NOT NULL,
    expires_at REAL NOT NULL, used_at REAL);
"""

_NEWER_LABEL = (
    "SELECT n.label_id FROM labels n WHERE n.prediction_id = l.prediction_id "
    "AND (n.at > l.at OR (n.at = l.at AND n.rowid > l.rowid)) "
    "ORDER BY n.at DESC, n.rowid DESC LIMIT 1"
)
_ONE_LABEL_PER_PREDICTION = f"""
INSERT OR IGNORE INTO label_history (label_id, prediction_id, edge, label, who, at, origin,
    replaced_by, replaced_at)
    SELECT l.label_id, l.prediction_id, l.edge, l.label, l.who, l.at, l.origin,
        ({_NEWER_LABEL}), l.at FROM labels l WHERE ({_NEWER_LABEL}) IS NOT NULL;
DELETE FROM labels WHERE label_id IN (SELECT label_id FROM label_history);
CREATE UNIQUE INDEX IF NOT EXISTS labels_one_per_prediction ON labels (prediction_id);
"""

# The scheduler's queue (issue 31; edge_manager/scheduler/store.py): teams with a daily
# quota in station-hours, queued jobs with their state, and every state change (audit).
JOBS_SCHEMA = """
CREATE TABLE IF NOT EXISTS teams (
    team TEXT PRIMARY KEY, quota_station_hours REAL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS queue_jobs (
    job_id TEXT PRIMARY KEY, kind TEXT NOT NULL, team TEXT NOT NULL REFERENCES teams (team),
    demand INTEGER NOT NULL, stations TEXT NOT NULL, grace_s REAL NOT NULL,
    max_preemptions INTEGER NOT NULL, priority INTEGER NOT NULL, job_dir TEXT NOT NULL,
    submitted_at REAL NOT NULL, submitted_by TEXT NOT NULL, state TEXT NOT NULL,
    preemptions INTEGER NOT NULL DEFAULT 0, queued_at REAL NOT NULL,
    waited_s REAL NOT NULL DEFAULT 0, ran_s REAL NOT NULL DEFAULT 0, started_at REAL,
    assigned TEXT NOT NULL DEFAULT '', updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS queue_events (
    job_id TEXT NOT NULL REFERENCES queue_jobs (job_id), at REAL NOT NULL, state TEXT NOT NULL,
    who TEXT NOT NULL, detail TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS queue_events_job ON queue_events (job_id, at);
"""

# Who holds which role in a team (issue 31 item 4; edge_manager/scheduler/team_store.py):
# viewer, submitter or admin, and who granted it when.
TEAM_MEMBERS_SCHEMA = """
CREATE TABLE IF NOT EXISTS team_members (
    team TEXT NOT NULL REFERENCES teams (team), member TEXT NOT NULL, role TEXT NOT NULL,
    granted_at REAL NOT NULL, granted_by TEXT NOT NULL, PRIMARY KEY (team, member));
CREATE INDEX IF NOT EXISTS team_members_member ON team_members (member);
"""

# Which team owns a model version (issue 31 item 4; scheduler/model_team_store.py): the
# one whose queued job published it, or named by `fedge model publish --team`. A version
# with no row belongs to no team: everyone sees and deploys it, as before teams.
MODEL_TEAMS_SCHEMA = """
CREATE TABLE IF NOT EXISTS model_teams (
    name TEXT NOT NULL, version INTEGER NOT NULL, team TEXT NOT NULL REFERENCES teams (team),
    recorded_at REAL NOT NULL, recorded_by TEXT NOT NULL, PRIMARY KEY (name, version));
CREATE INDEX IF NOT EXISTS model_teams_team ON model_teams (team);
"""

# Columns added to existing tables after a release (table, column, definition); a store
# from before gets them with their default (``CREATE TABLE IF NOT EXISTS`` leaves an old
# table as it was). predictions.stats: the image statistics of the prediction as JSON (''
# when the agent sent none), issue "The closed loop". evaluations.augmented: 0 for a
# held-out image as it is, k for its k-th re-lit copy (whose prediction_id is then
# "<id>~k", edge_manager/evaluations.py): the gate and drift references read 0 only, the
# MPP fit reads all. evaluation_reports: the items the manager dropped from a station's
# report, and why (evaluations.py).
ADDED_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("predictions", "stats", "TEXT NOT NULL DEFAULT ''"),
    ("evaluations", "augmented", "INTEGER NOT NULL DEFAULT 0"),
    ("evaluation_reports", "foreign_items", "INTEGER NOT NULL DEFAULT 0"),
    ("evaluation_reports", "rejected_items", "INTEGER NOT NULL DEFAULT 0"),
    ("evaluation_reports", "dropped_reason", "TEXT NOT NULL DEFAULT ''"),
    # Where the station serves its images to the manager (its birth's images_at, issue 30).
    ("edges", "images_at", "TEXT NOT NULL DEFAULT ''"),
    # Per monitor window, what the console draws over time (issue 27, item 8): the
    # window's rejected predictions, and the input and score drift (the largest PSI,
    # monitoring/drift.py) judged on it; NULL where the monitor did not judge drift.
    ("estimates", "rejects", "INTEGER"),
    ("estimates", "input_drift", "REAL"),
    ("estimates", "score_drift", "REAL"),
    # Issue 28: the anomaly model scored beside the classifier ('' / NULL: none), and
    # whether the part was novel (not recognised as a known defect, scored over the
    # station's anomaly threshold: PredictionRecord.novel; NULL: no verdict, no anomaly
    # model or no threshold in force): the label queue puts novel parts first, the
    # monitor's novel_rate counts them.
    ("predictions", "anomaly_model", "TEXT NOT NULL DEFAULT ''"),
    ("predictions", "anomaly_score", "REAL"),
    ("predictions", "novel", "INTEGER"),
    # Issue 28: the anomaly model an edge served beside its classifier before a staged
    # rollout moved it (NULL: none), which its rollback restores with the classifier.
    ("rollout_edges", "previous_anomaly", "TEXT"),
    # Issue 28: the station's anomaly threshold the part was judged against (NULL: none in
    # force, or an agent of before): how far over it a novel part scored weighs in the
    # monitor's novel_rate CUSUM (monitor/novel.py).
    ("predictions", "anomaly_threshold", "REAL"),
)


def _columns(*names: str) -> Callable[[sqlite3.Connection], None]:
    added = [spec for spec in ADDED_COLUMNS if spec[1] in names]

    def apply(conn: sqlite3.Connection) -> None:
        for table, column, definition in added:
            schema_store.add_column(conn, table, column, definition)

    return apply


def _anomaly_columns(conn: sqlite3.Connection) -> None:
    _columns("anomaly_model", "anomaly_score", "novel")(conn)
    # Novel parts are few; the label queue reads them first, newest first.
    conn.execute("CREATE INDEX IF NOT EXISTS predictions_novel ON predictions (at) WHERE novel = 1")


def _one_label_per_prediction(conn: sqlite3.Connection) -> None:
    # A store from before issue 15 may hold several labels of one prediction: all but the
    # newest move to the history, then the index keeps it one.
    if conn.execute(
        "SELECT 1 FROM sqlite_master WHERE name='labels_one_per_prediction'"
    ).fetchone():
        return
    schema_store.run_script(conn, _ONE_LABEL_PER_PREDICTION)


# The manager store's schema versions (fedge/schema_store.py): a store at version 0 was
# written before versions existed, by any earlier release; each step is idempotent. A
# change to SCHEMA is a new migration here that makes it on an existing store.
MIGRATIONS: tuple[schema_store.Migration, ...] = (
    schema_store.Migration(1, "every table and index of SCHEMA", schema_store.script(SCHEMA)),
    schema_store.Migration(2, "predictions.stats (issue 'The closed loop')", _columns("stats")),
    schema_store.Migration(3, "evaluations.augmented (re-lit copies)", _columns("augmented")),
    schema_store.Migration(
        4,
        "evaluation_reports: dropped items and why",
        _columns("foreign_items", "rejected_items", "dropped_reason"),
    ),
    schema_store.Migration(
        5, "one current label per prediction (issue 15)", _one_label_per_prediction
    ),
    schema_store.Migration(6, "the job queue (issue 31)", schema_store.script(JOBS_SCHEMA)),
    schema_store.Migration(
        7, "edges.images_at: where a station serves its images (issue 30)", _columns("images_at")
    ),
    schema_store.Migration(
        8,
        "estimates.rejects, input_drift, score_drift: trends per window (issue 27)",
        _columns("rejects", "input_drift", "score_drift"),
    ),
    schema_store.Migration(
        9,
        "predictions.anomaly_model, anomaly_score, novel and their index (issue 28)",
        _anomaly_columns,
    ),
    schema_store.Migration(
        10, "team_members: roles per team (issue 31)", schema_store.script(TEAM_MEMBERS_SCHEMA)
    ),
    schema_store.Migration(
        11,
        "model_teams: the team owning a model (issue 31)",
        schema_store.script(MODEL_TEAMS_SCHEMA),
    ),
    schema_store.Migration(
        12,
        "rollout_edges.previous_anomaly: the anomaly model a rollout restores (issue 28)",
        _columns("previous_anomaly"),
    ),
    schema_store.Migration(
        13,
        "predictions.anomaly_threshold: the threshold a part was judged against (issue 28)",
        _columns("anomaly_threshold"),
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)


Transaction: TypeAlias = sqlite3.Connection
"""An open transaction on the store, passed through to the ``*_store`` functions (a
rollout tick, a label, an evaluation report) so several of them commit or roll back
together."""

StoreError = sqlite3.Error
"""What a failed statement raises (the driver's base error)."""

# SQLite's primary result codes that say the store cannot take a write now, whatever the
# statement (https://sqlite.org/rescode.html): no room (FULL), the disk or file system
# failed (IOERR, CANTOPEN), it is read-only (READONLY), another writer holds it (BUSY,
# LOCKED) or memory ran out (NOMEM). A transaction that failed so is worth trying again
# once the cause is gone (issue 33); any other error is about the statement itself.
# BUSY, LOCKED, NOMEM, READONLY, IOERR, FULL, CANTOPEN
_UNWRITABLE_CODES = frozenset({5, 6, 7, 8, 10, 13, 14})


def unwritable(exc: BaseException) -> bool:
    """Whether ``exc`` says the store cannot be written now (not that a statement is wrong)."""
    if not isinstance(exc, sqlite3.Error):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return (code & 0xFF) in _UNWRITABLE_CODES
    # An error raised before SQLite answered (no code): judge by the driver's words.
    return "disk is full" in str(exc) or "disk I/O error" in str(exc)


class Store:
    def __init__(self, path: Path | str) -> None:
        self.path = path
        # Autocommit mode: transactions are explicit (see `transaction`).
        conn = sqlite3.connect(str(path), isolation_level=None, timeout=30.0)
        self.db = sqlite_utils.Database(conn)
        self.db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode survives a process crash (SIGKILL); only an OS crash can lose
        # the last transactions, which QoS 1 redelivery then fills in.
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        try:
            schema_store.migrate(conn, str(path), MIGRATIONS, ManagerError)
        except ManagerError:
            conn.close()
            raise

    @property
    def conn(self) -> sqlite3.Connection:
        return self.db.conn

    def transaction(self, immediate: bool = True) -> "_Transaction":
        return _Transaction(self.conn, immediate)

    def query(
        self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()
    ) -> list[dict[str, Any]]:
        return list(self.db.query(sql, params))

    def one(self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> dict[str, Any] | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    def scalar(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        row = self.conn.execute(sql, params).fetchone()
        return None if row is None else row[0]

    def close(self) -> None:
        self.conn.close()


class _Transaction:
    def __init__(self, conn: sqlite3.Connection, immediate: bool) -> None:
        self.conn = conn
        self.immediate = immediate

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE" if self.immediate else "BEGIN")
        return self.conn

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            try:
                self.conn.execute("COMMIT")
            except sqlite3.Error:
                # A COMMIT that failed (SQLITE_FULL, issue 33) leaves the transaction open:
                # end it, or the next BEGIN fails ("within a transaction") for good.
                self._rollback()
                raise
        else:
            self._rollback()

    def _rollback(self) -> None:
        # SQLite may have rolled back already (it does on SQLITE_FULL and IOERR in some
        # statements); a ROLLBACK then would raise and hide the error that caused it.
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")
