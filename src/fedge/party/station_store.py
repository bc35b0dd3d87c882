"""A station's training set: the images it scored, their operator labels, a held-out share.

The agent keeps every image it scores (the file's own bytes, so a later model may
prepare them differently) and every label an operator gives, joined by prediction id.
The station's trainer reads them back; nothing here sends an image anywhere.

    <data_dir>/station/station.db            images (prediction id, file, bytes, time)
                                             and labels (the newest per prediction)
    <data_dir>/station/images/<id><suffix>   the image bytes, written before their row

A retention policy bounds what is kept: a count, a total size and an age; the oldest
images go first, with their labels. A share of the predictions (chosen by a hash of the
prediction id, so it never changes and needs no state) is held out: the trainer never
trains on it, it is the station's own test set, before and after a federated job.

No torch and no Flower here: the inference-only agent imports this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fedge.party.errors import StationDataError

SCHEMA = """
CREATE TABLE IF NOT EXISTS images (
    prediction_id TEXT PRIMARY KEY, file TEXT NOT NULL, bytes INTEGER NOT NULL,
    at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS images_at ON images (at);
CREATE TABLE IF NOT EXISTS labels (
    prediction_id TEXT PRIMARY KEY, label TEXT NOT NULL, at REAL NOT NULL);
"""
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
    """The station's kept images and labels (thread-safe; one writer process: the agent)."""

    def __init__(
        self, data_dir: Path, retention: Retention | None = None, *, readonly: bool = False
    ) -> None:
        self.root = station_dir(data_dir)
        self.images_dir = self.root / "images"
        self.retention = retention or Retention()
        self.readonly = readonly
        db = self.root / "station.db"
        if readonly:
            if not db.is_file():
                raise StationDataError(
                    f"{db} does not exist: this station has kept no images yet "
                    "(the agent keeps what it scores from its inbox or HTTP API)"
                )
            uri = f"file:{db}?mode=ro"
            self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=30.0)
        else:
            self.images_dir.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(
                str(db), isolation_level=None, check_same_thread=False, timeout=30.0
            )
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # -- the agent writes

    def keep(self, prediction_id: str, data: bytes, suffix: str, at: float | None = None) -> bool:
        """Keep a scored image's bytes; returns False when retention keeps no images."""
        if not self.retention.keeps_images:
            return False
        _check_id(prediction_id)
        suffix = suffix.lower()
        if suffix not in IMAGE_SUFFIXES:
            raise StationDataError(
                f"image suffix {suffix!r} is not one of {sorted(IMAGE_SUFFIXES)}"
            )
        name = f"{prediction_id}{suffix}"
        path = self.images_dir / name
        tmp = path.with_suffix(suffix + ".tmp")
        # The file first, then its row: a crash in between leaves a file without a row,
        # which the next prune removes; never a row without its file.
        with open(tmp, "wb") as handle:
            handle.write(data)
        tmp.replace(path)
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO images VALUES (?,?,?,?)",
                (prediction_id, name, len(data), time.time() if at is None else at),
            )
        self.prune()
        return True

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

    def prune(self, now: float | None = None) -> int:
        """Apply the retention policy (oldest first); returns how many images went."""
        policy = self.retention
        now = time.time() if now is None else now
        with self._lock:
            doomed: list[tuple[str, str]] = self._conn.execute(
                "SELECT prediction_id, file FROM images WHERE at < ?",
                (now - policy.max_age_s,),
            ).fetchall()
            rows = self._conn.execute(
                "SELECT prediction_id, file, bytes FROM images WHERE at >= ? "
                "ORDER BY at DESC, prediction_id DESC",
                (now - policy.max_age_s,),
            ).fetchall()
            total = 0
            for index, (prediction_id, file, size) in enumerate(rows):
                total += int(size)
                if index >= policy.max_images or total > policy.max_bytes:
                    doomed.append((prediction_id, file))
            # Labels whose image was never kept (or is gone) go by age too.
            self._conn.execute(
                "DELETE FROM labels WHERE at < ? AND prediction_id NOT IN "
                "(SELECT prediction_id FROM images)",
                (now - policy.max_age_s,),
            )
            if doomed:
                self._conn.execute("BEGIN")
                self._conn.executemany(
                    "DELETE FROM images WHERE prediction_id=?", [(d[0],) for d in doomed]
                )
                self._conn.executemany(
                    "DELETE FROM labels WHERE prediction_id=?", [(d[0],) for d in doomed]
                )
                self._conn.execute("COMMIT")
        for _, file in doomed:
            with contextlib.suppress(FileNotFoundError):
                (self.images_dir / file).unlink()
        return len(doomed)

    def sweep_orphans(self) -> int:
        """Remove image files that have no row (a crash between file and row)."""
        with self._lock:
            known = {r[0] for r in self._conn.execute("SELECT file FROM images")}
        removed = 0
        for path in self.images_dir.iterdir():
            if path.name not in known:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                removed += 1
        return removed

    # -- the trainer reads

    def labelled(self) -> list[LabelledImage]:
        """Every kept image that has a label, oldest first, with its held-out flag."""
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
        with self._lock:
            images, size = self._conn.execute(
                "SELECT count(*), coalesce(sum(bytes), 0) FROM images"
            ).fetchone()
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
