"""A station's training set: the images it scored, their operator labels, a held-out share.

The agent keeps every image it scores (the file's own bytes, so a later model may
prepare them differently) and every label an operator gives, joined by prediction id.
The station's trainer reads them back; nothing here sends an image anywhere.

    <data_dir>/station/station.db            images (prediction id, file, bytes, time)
                                             and labels (the newest per prediction)
    <data_dir>/station/images/<id><suffix>   the image bytes, written before their row

A retention policy bounds what is kept: a count, a total size and an age; the oldest
images go first, with their labels. Keeping an image costs the same whatever the store
holds (issue 25): the count, the bytes and the oldest time are running totals, and once a
limit is passed by a batch (:data:`PRUNE_BATCH` images or half the count limit, 1/64 of
the bytes, 1 % of the age) a pruner thread deletes the oldest rows a bounded batch at a
time, walking the ``(at, prediction_id)`` index from the oldest, off the scoring path.
Files left without a row and labels whose image is gone are swept periodically
(:data:`SWEEP_EVERY_S`).

A share of the predictions (chosen by a hash of the prediction id, so it never changes and
needs no state) is held out: the trainer never trains on it, it is the station's own test
set, before and after a federated job.

No torch and no Flower here: the inference-only agent imports this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fedge import schema_store
from fedge.party.errors import StationDataError

log = logging.getLogger(__name__)

# images_oldest is the walk from the oldest image that pruning takes (it replaced
# images_at, which left ties unordered); labels_at bounds the sweep of orphaned labels.
SCHEMA = """
CREATE TABLE IF NOT EXISTS images (
    prediction_id TEXT PRIMARY KEY, file TEXT NOT NULL, bytes INTEGER NOT NULL,
    at REAL NOT NULL);
DROP INDEX IF EXISTS images_at;
CREATE INDEX IF NOT EXISTS images_oldest ON images (at, prediction_id);
CREATE TABLE IF NOT EXISTS labels (
    prediction_id TEXT PRIMARY KEY, label TEXT NOT NULL, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS labels_at ON labels (at);
"""
# The file's schema versions (fedge/schema_store.py; 0: written before versions). A change
# to SCHEMA is a new migration here.
MIGRATIONS: tuple[schema_store.Migration, ...] = (
    schema_store.Migration(1, "every table and index of SCHEMA", schema_store.script(SCHEMA)),
)
SCHEMA_VERSION = len(MIGRATIONS)
# Rows one prune transaction deletes at most: short enough that a keep() waiting for the
# store's lock waits well under a millisecond, large enough that pruning is rare.
PRUNE_BATCH = 64
# How often the pruner thread sweeps files without a row and labels without an image.
SWEEP_EVERY_S = 3600.0
# Training copies the keeper thread may be behind by before keep() writes its own.
KEEP_QUEUE = 256
# A file younger than this is never an orphan: keep() writes the file before its row.
ORPHAN_GRACE_S = 60.0
# In the background mode, keep() prunes a batch itself once the pruner thread is this many
# batches behind (a starved thread must not let the disk fill).
BACKSTOP_BATCHES = 8
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".pgm"})
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


@dataclass(frozen=True)
class Retention:
    """How much of what a station scored it keeps for training (0 disables a limit's data)."""

    max_images: int = 5000
    max_bytes: int = 512 * 2**20
    max_age_s: float = 30 * 86400.0
    holdout_percent: int = 20

    def __post_init__(self) -> None:
        if self.max_images < 0 or self.max_bytes < 0 or self.max_age_s < 0:
            raise StationDataError("retention limits must be >= 0")
        if not 0 <= self.holdout_percent <= 90:
            raise StationDataError(
                f"holdout_percent must be in [0, 90], got {self.holdout_percent}"
            )

    @property
    def keeps_images(self) -> bool:
        return self.max_images > 0 and self.max_bytes > 0 and self.max_age_s > 0


@dataclass(frozen=True)
class LabelledImage:
    prediction_id: str
    path: Path
    label: str
    holdout: bool


def is_holdout(prediction_id: str, percent: int) -> bool:
    """Whether a prediction belongs to the station's held-out share (stable, stateless)."""
    digest = hashlib.sha256(prediction_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < percent


def station_dir(data_dir: Path) -> Path:
    return data_dir / "station"


class StationData:
    """The station's kept images and labels (thread-safe; one writer process: the agent).

    ``background`` (the agent's mode): retention runs on a pruner thread, started by the
    first :meth:`keep` and stopped by :meth:`close`, and the training copy itself is
    written by a keeper thread, so a line camera's reply never waits for it (issue 25:
    the copy was half of what the station added to a model call). A copy not written yet
    is seen by every read of this object (they wait for the queue first); one lost to a
    crash costs a training image, never a prediction (that is in the agent's store before
    the reply). Without ``background`` :meth:`keep` writes and prunes on the caller's
    thread: the same bounded work.
    """

    def __init__(
        self,
        data_dir: Path,
        retention: Retention | None = None,
        *,
        readonly: bool = False,
        background: bool = True,
    ) -> None:
        self.root = station_dir(data_dir)
        self.images_dir = self.root / "images"
        self.retention = retention or Retention()
        self.readonly = readonly
        self.background = background and not readonly
        db = self.root / "station.db"
        if readonly:
            if not db.is_file():
                raise StationDataError(
                    f"{db} does not exist: this station has kept no images yet "
                    "(the agent keeps what it scores from its inbox or HTTP API)"
                )
            uri = f"file:{db}?mode=ro"
            self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=30.0)
            try:
                schema_store.refuse_newer(self._conn, str(db), MIGRATIONS, StationDataError)
            except StationDataError:
                self._conn.close()
                raise
        else:
            self.images_dir.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(
                str(db), isolation_level=None, check_same_thread=False, timeout=30.0
            )
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            try:
                schema_store.migrate(self._conn, str(db), MIGRATIONS, StationDataError)
            except StationDataError:
                self._conn.close()
                raise
        self._lock = threading.Lock()
        # Running totals of the images table (read once here, then kept by keep and the
        # pruner), so deciding whether anything must go costs nothing per image.
        count, size, oldest = self._conn.execute(
            "SELECT count(*), coalesce(sum(bytes), 0), min(at) FROM images"
        ).fetchone()
        self._count, self._bytes = int(count), int(size)
        self._oldest_at: float | None = None if oldest is None else float(oldest)
        self._wake = threading.Event()
        self._closing = False
        self._pruner: threading.Thread | None = None
        self._caught_up = threading.Event()  # set by the pruner after each pass
        self.pruned = 0  # images retention removed, for the agent's counters and tests
        self.prune_failures = 0
        # Training copies waiting for the keeper thread (background mode); bounded, so a
        # disk slower than the line pushes back on the callers instead of filling memory.
        self._pending: queue.Queue[tuple[str, str, bytes, float] | None] = queue.Queue(
            maxsize=KEEP_QUEUE
        )
        self._keeper: threading.Thread | None = None
        self.keep_failures = 0
        # Copies handed to the keeper and copies it finished (written or failed): a flush
        # waits for the ones queued before it, not for an empty queue, which a line as
        # fast as the disk might never leave (review of issue 25).
        self._handed = 0
        self._finished = 0
        self._progress = threading.Condition()
        self._closed = False

    def close(self) -> None:
        self._closed = True  # keep() refuses from now on: nothing is queued to a dead keeper
        self.flush()
        if self._keeper is not None:
            self._pending.put(None)
            self._keeper.join(timeout=30.0)
        self._closing = True
        self._wake.set()
        if self._pruner is not None and self._pruner is not threading.current_thread():
            self._pruner.join(timeout=30.0)
        with self._lock:
            self._conn.close()

    # -- the agent writes

    def keep(self, prediction_id: str, data: bytes, suffix: str, at: float | None = None) -> bool:
        """Keep a scored image's bytes; returns False when retention keeps no images.

        Constant work whatever the store holds: one file, one primary-key lookup, one
        insert; retention is applied a bounded batch at a time once a limit is passed by
        a batch (on the pruner thread in the background mode).
        """
        if not self.retention.keeps_images:
            return False
        _check_id(prediction_id)
        suffix = suffix.lower()
        if suffix not in IMAGE_SUFFIXES:
            raise StationDataError(
                f"image suffix {suffix!r} is not one of {sorted(IMAGE_SUFFIXES)}"
            )
        if self._closed:
            raise StationDataError("the station's image store is closed; nothing was kept")
        name = f"{prediction_id}{suffix}"
        when = time.time() if at is None else at
        if self.background:
            self._start_keeper()
            with self._progress:
                try:
                    self._pending.put_nowait((prediction_id, name, data, when))
                    self._handed += 1
                    return True
                except queue.Full:
                    pass  # the keeper is behind: this caller writes its own copy
        self._write(prediction_id, name, data, when)
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the training copies handed to :meth:`keep` before this call are
        written (or failed); False if ``timeout`` ran out first."""
        with self._progress:
            target = self._handed
            return self._progress.wait_for(lambda: self._finished >= target, timeout)

    def _start_keeper(self) -> None:
        if self._keeper is None:
            with self._lock:
                if self._keeper is None:
                    self._keeper = threading.Thread(
                        target=self._keeper_loop, name="station-keeper", daemon=True
                    )
                    self._keeper.start()

    def _keeper_loop(self) -> None:
        while (item := self._pending.get()) is not None:
            try:
                self._write(*item)
            except Exception as exc:  # the keeper must outlive any one copy (flush waits)
                # The prediction is recorded; only its training copy is lost.
                self.keep_failures += 1
                log.error("could not keep %s for training: %s", item[0], exc)
            finally:
                with self._progress:
                    self._finished += 1
                    self._progress.notify_all()

    def _write(self, prediction_id: str, name: str, data: bytes, when: float) -> None:
        suffix = name[len(prediction_id) :]
        path = self.images_dir / name
        tmp = path.with_suffix(suffix + ".tmp")
        # The file first, then its row: a crash in between leaves a file without a row,
        # which the orphan sweep removes; never a row without its file.
        with open(tmp, "wb") as handle:
            handle.write(data)
        tmp.replace(path)
        with self._lock:
            # A prediction kept again (never, with uuid ids; but correct) replaces its row.
            old = self._conn.execute(
                "SELECT bytes FROM images WHERE prediction_id=?", (prediction_id,)
            ).fetchone()
            self._conn.execute(
                "INSERT OR REPLACE INTO images VALUES (?,?,?,?)",
                (prediction_id, name, len(data), when),
            )
            if old is None:
                self._count += 1
                self._bytes += len(data)
            else:
                self._bytes += len(data) - int(old[0])
            if self._oldest_at is None or when < self._oldest_at:
                self._oldest_at = when
            due = self._due(time.time())
            behind = self._count >= self.retention.max_images + BACKSTOP_BATCHES * PRUNE_BATCH
        if due and (not self.background or behind):
            self._unlink(self._prune_batch(time.time()))
        if due and self.background:
            self._wake_pruner()

    def label(self, prediction_id: str, label: str, at: float | None = None) -> None:
        """Record an operator's label; a newer label of the same prediction replaces it."""
        _check_id(prediction_id)
        when = time.time() if at is None else at
        with self._lock:
            self._conn.execute(
                "INSERT INTO labels VALUES (?,?,?) ON CONFLICT (prediction_id) DO UPDATE "
                "SET label=excluded.label, at=excluded.at WHERE excluded.at >= labels.at",
                (prediction_id, label, when),
            )

    def unlabel(self, prediction_id: str, at: float) -> bool:
        """Withdraw the prediction's label if it is no newer than ``at`` (a withdrawal an
        operator made then; a label given later stands); returns whether one went."""
        _check_id(prediction_id)
        with self._lock:
            cursor = self._conn.execute(
                "DELETE FROM labels WHERE prediction_id=? AND at <= ?", (prediction_id, at)
            )
        return cursor.rowcount > 0

    def image(self, prediction_id: str) -> tuple[Path, int] | None:
        """Where a kept image's bytes are, and how many: None when it was never kept or
        retention removed it (issue 30: shown to an operator, never sent elsewhere)."""
        _check_id(prediction_id)
        self.flush()
        with self._lock:
            row = self._conn.execute(
                "SELECT file, bytes FROM images WHERE prediction_id=?", (prediction_id,)
            ).fetchone()
        return None if row is None else (self.images_dir / str(row[0]), int(row[1]))

    def prune(self, now: float | None = None) -> int:
        """Apply the retention policy now, exactly (oldest first); returns how many went.

        Bounded batches, each its own short transaction, until every limit holds; then
        the labels past the age limit whose image is gone.
        """
        self.flush()
        now = time.time() if now is None else now
        removed = 0
        while batch := self._prune_batch(now):
            removed += len(batch)
            self._unlink(batch)
        with self._lock:
            self._drop_orphan_labels(now)
        return removed

    def sweep_orphans(self) -> int:
        """Remove image files that have no row (a crash between file and row), and the
        labels past the age limit whose image is gone; returns how many files went.

        A file younger than :data:`ORPHAN_GRACE_S` is left alone: it may be an image
        whose row keep() is about to write.
        """
        self.flush()
        started = time.time()
        with self._lock:
            known = {r[0] for r in self._conn.execute("SELECT file FROM images")}
            self._drop_orphan_labels(started)
        removed = 0
        for path in self.images_dir.iterdir():
            if path.name in known:
                continue
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < started - ORPHAN_GRACE_S:
                    path.unlink()
                    removed += 1
        return removed

    def settled(self, timeout: float) -> bool:
        """Wait until no retention work is due (the pruner caught up); False on timeout."""
        self.flush()
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._due(time.time()):
                    return True
            self._caught_up.clear()
            self._wake_pruner()
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._caught_up.wait(remaining):
                return False

    # -- retention internals

    def _due(self, now: float) -> bool:
        """Whether a limit is passed by a batch (the caller holds the lock)."""
        policy = self.retention
        return (
            self._count >= policy.max_images + min(PRUNE_BATCH, max(1, policy.max_images // 2))
            or self._bytes > policy.max_bytes + policy.max_bytes // 64
            or (
                self._oldest_at is not None
                and self._oldest_at < now - policy.max_age_s - policy.max_age_s / 100
            )
        )

    def _prune_batch(self, now: float) -> list[str]:
        """Delete up to :data:`PRUNE_BATCH` of the oldest images past a limit, in one
        transaction; returns their file names (to unlink, outside the lock)."""
        policy = self.retention
        cutoff = now - policy.max_age_s
        with self._lock:
            excess = self._count - policy.max_images
            over = self._bytes - policy.max_bytes
            aged = self._oldest_at is not None and self._oldest_at < cutoff
            if excess <= 0 and over <= 0 and not aged:
                return []
            rows = self._conn.execute(
                "SELECT prediction_id, file, bytes, at FROM images "
                "ORDER BY at, prediction_id LIMIT ?",
                (PRUNE_BATCH,),
            ).fetchall()
            doomed: list[tuple[str, str, int]] = []
            last: tuple[float, str] = (0.0, "")
            for prediction_id, file, size, at in rows:
                if excess <= 0 and over <= 0 and at >= cutoff:
                    break  # oldest first: everything after this one stays too
                doomed.append((str(prediction_id), str(file), int(size)))
                last = (float(at), str(prediction_id))
                excess -= 1
                over -= int(size)
            if not doomed:
                return []
            # The doomed rows are exactly the index's prefix up to ``last`` (nothing is
            # inserted meanwhile: the lock is held), so one range delete per table.
            self._conn.execute("BEGIN")
            try:
                self._conn.execute(
                    "DELETE FROM labels WHERE prediction_id IN (SELECT prediction_id FROM "
                    "images WHERE (at, prediction_id) <= (?, ?))",
                    last,
                )
                self._conn.execute("DELETE FROM images WHERE (at, prediction_id) <= (?, ?)", last)
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._count -= len(doomed)
            self._bytes -= sum(d[2] for d in doomed)
            oldest = self._conn.execute("SELECT min(at) FROM images").fetchone()[0]
            self._oldest_at = None if oldest is None else float(oldest)
            self.pruned += len(doomed)
        return [d[1] for d in doomed]

    def _drop_orphan_labels(self, now: float) -> None:
        # Labels whose image was never kept (or is gone) go by age too (labels_at bounds
        # the walk to the old ones). The caller holds the lock.
        self._conn.execute(
            "DELETE FROM labels WHERE at < ? AND prediction_id NOT IN "
            "(SELECT prediction_id FROM images)",
            (now - self.retention.max_age_s,),
        )

    def _unlink(self, files: list[str]) -> None:
        for file in files:
            with contextlib.suppress(FileNotFoundError):
                (self.images_dir / file).unlink()

    def _wake_pruner(self) -> None:
        if self._pruner is None:
            with self._lock:
                if self._pruner is None and not self._closing:
                    self._pruner = threading.Thread(
                        target=self._pruner_loop, name="station-pruner", daemon=True
                    )
                    self._pruner.start()
        self._wake.set()

    def _pruner_loop(self) -> None:
        last_sweep = time.monotonic()
        while True:
            self._wake.wait(timeout=SWEEP_EVERY_S)
            self._wake.clear()
            if self._closing:
                return
            try:
                while not self._closing and (batch := self._prune_batch(time.time())):
                    self._unlink(batch)
                if time.monotonic() - last_sweep >= SWEEP_EVERY_S:
                    last_sweep = time.monotonic()
                    self.sweep_orphans()
                self._caught_up.set()
            except (sqlite3.Error, OSError) as exc:
                # The next image over the limit wakes the pruner again; the backstop in
                # keep() bounds the store meanwhile.
                self.prune_failures += 1
                log.error("station retention failed (will retry): %s", exc)

    # -- the trainer reads

    def labelled(self) -> list[LabelledImage]:
        """Every kept image that has a label, oldest first, with its held-out flag."""
        self.flush()
        with self._lock:
            rows = self._conn.execute(
                "SELECT images.prediction_id, images.file, labels.label FROM images "
                "JOIN labels USING (prediction_id) ORDER BY images.at, images.prediction_id"
            ).fetchall()
        percent = self.retention.holdout_percent
        return [
            LabelledImage(
                str(pid), self.images_dir / str(file), str(label), is_holdout(pid, percent)
            )
            for pid, file, label in rows
        ]

    def counts(self) -> dict[str, int]:
        self.flush()
        with self._lock:
            if self.readonly:  # another process writes: its totals are not ours
                images, size = self._conn.execute(
                    "SELECT count(*), coalesce(sum(bytes), 0) FROM images"
                ).fetchone()
            else:
                images, size = self._count, self._bytes
            labelled = self._conn.execute(
                "SELECT count(*) FROM images JOIN labels USING (prediction_id)"
            ).fetchone()[0]
        return {"images": int(images), "bytes": int(size), "labelled": int(labelled)}


def _check_id(prediction_id: str) -> None:
    # Prediction ids become file names: refuse anything that could leave the directory.
    if not prediction_id or len(prediction_id) > 128 or not set(prediction_id) <= _ID_CHARS:
        raise StationDataError(f"prediction id {prediction_id[:80]!r} is not a safe file name")
    if prediction_id.startswith("."):
        raise StationDataError(f"prediction id {prediction_id[:80]!r} is not a safe file name")
