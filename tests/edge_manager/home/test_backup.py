"""`manager backup` / `restore` as a library (issue 27, item 3): what the file holds, the
seal, restoring into a new directory or over an old home, and damage refused."""

import io
import os
import sqlite3
import tarfile
import threading
from pathlib import Path

import pytest

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.home import backup as backups
from fedge.edge_manager.home import sealing
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.edge_manager.store import SCHEMA_VERSION, Store

PASSPHRASE = b"correct horse battery staple"


@pytest.fixture()
def home(tmp_path: Path) -> ManagerHome:
    manager = ManagerHome(tmp_path / "old-host" / "home")
    manager.init(ManagerSettings(fleet="plant-a"))
    model = manager.artifacts / "inspect" / "1" / "model.onnx"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"onnx bytes")
    store = Store(manager.db_path)
    with store.transaction() as tx:
        tx.execute(
            "INSERT INTO models (name, version, sha256, size, manifest, envelope, path, "
            "created_at) VALUES ('inspect', 1, 'ab', 10, '{}', '{}', ?, 1.0)",
            (str(model),),
        )
        tx.execute("INSERT INTO streams VALUES ('st-01', 'predictions', 7, 7, 0)")
    store.close()
    return manager


def _tree(root: Path) -> dict[str, bytes]:
    skip = ("manager.db", "-wal", "-shm", ".lock")
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not p.name.endswith(skip)
    }


def test_seal_and_unseal_over_several_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sealing, "CHUNK", 1000)
    plain = os.urandom(3500)
    sealed = io.BytesIO()
    sealing.seal(io.BytesIO(plain), sealed, PASSPHRASE)
    assert plain not in sealed.getvalue()
    opened = io.BytesIO()
    sealing.unseal(io.BytesIO(sealed.getvalue()), opened, PASSPHRASE)
    assert opened.getvalue() == plain
    with pytest.raises(sealing.SealError, match="wrong passphrase"):
        sealing.unseal(io.BytesIO(sealed.getvalue()), io.BytesIO(), b"not the passphrase")
    flipped = bytearray(sealed.getvalue())
    flipped[-20] ^= 1
    with pytest.raises(sealing.SealError, match=r"chunk 3 .* altered"):
        sealing.unseal(io.BytesIO(bytes(flipped)), io.BytesIO(), PASSPHRASE)
    # Cut after a whole chunk: the last one left is not marked last.
    cut = sealed.getvalue()[: len(sealing.MAGIC) + 26 + 3 * (4 + 1016)]
    with pytest.raises(sealing.SealError, match="altered or cut short"):
        sealing.unseal(io.BytesIO(cut), io.BytesIO(), PASSPHRASE)
    with pytest.raises(ManagerError, match="at least 8 characters"):
        sealing.seal(io.BytesIO(b"x"), io.BytesIO(), b"short")


def test_a_sealed_backup_restores_the_home_on_another_path(
    home: ManagerHome, tmp_path: Path
) -> None:
    out = tmp_path / "backups" / "plant-a.fbk"
    report = backups.backup(home, out, PASSPHRASE)
    assert report.sealed and report.stream_marks == {"st-01/predictions": 7}
    assert report.schema_version == SCHEMA_VERSION
    assert sealing.is_sealed(out) and out.stat().st_mode & 0o777 == 0o600
    assert b"BEGIN" not in out.read_bytes()  # no PEM in the clear
    with pytest.raises(ManagerError, match="exists: a backup never overwrites"):
        backups.backup(home, out)
    with pytest.raises(ManagerError, match="is sealed: give its passphrase"):
        backups.restore(out, tmp_path / "new-host" / "home")

    target = tmp_path / "new-host" / "home"
    restored = backups.restore(out, target, PASSPHRASE)
    assert restored.fleet == "plant-a" and restored.moved_aside == ""
    assert _tree(target) == _tree(home.root)
    new = ManagerHome(target)
    assert new.signing_key().public.key_id == home.signing_key().public.key_id
    assert (target / "keys" / "manager.key").stat().st_mode & 0o777 == 0o600
    assert (target / "pki" / "ca.key").stat().st_mode & 0o777 == 0o600
    store = Store(new.db_path)
    assert store.scalar("SELECT path FROM models") == str(
        target.resolve() / "artifacts" / "inspect" / "1" / "model.onnx"
    )
    assert store.scalar("SELECT max_seq FROM streams") == 7
    store.close()


def test_restore_refuses_a_home_unless_asked_and_then_keeps_it_aside(
    home: ManagerHome, tmp_path: Path
) -> None:
    out = tmp_path / "plain.fbk"
    backups.backup(home, out)
    with pytest.raises(ManagerError, match=r"exists and is not empty.*--replace"):
        backups.restore(out, home.root)
    before = _tree(home.root)
    report = backups.restore(out, home.root, replace=True, clock=lambda: 1234.0)
    aside = home.root.with_name("home.replaced-1234")
    assert report.moved_aside == str(aside) and _tree(aside) == before
    assert _tree(home.root) == before


def test_a_damaged_backup_is_refused_and_nothing_is_written(
    home: ManagerHome, tmp_path: Path
) -> None:
    out = tmp_path / "plain.fbk"
    backups.backup(home, out)
    damaged = tmp_path / "damaged.fbk"
    with tarfile.open(out, "r:gz") as src, tarfile.open(damaged, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member)
            body = data.read() if data is not None else b""
            if member.name == "keys/manager.pub":
                body = body[:-2] + b"xx"
            member.size = len(body)
            dst.addfile(member, io.BytesIO(body))
    target = tmp_path / "new"
    with pytest.raises(ManagerError, match=r"keys/manager\.pub is missing or differs"):
        backups.restore(damaged, target)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir() if "restore" in p.name] == []
    with pytest.raises(ManagerError, match="not a fedge manager backup"):
        (tmp_path / "junk.tgz").write_bytes(b"junk")
        backups.restore(tmp_path / "junk.tgz", target)


def test_the_copy_holds_whole_transactions_while_a_writer_keeps_writing(
    home: ManagerHome, tmp_path: Path
) -> None:
    """Each transaction writes a batch key and its two records: the copy has both
    records of every batch it has, never one."""
    stop = threading.Event()

    def write() -> None:
        store = Store(home.db_path)
        seq = 0
        while not stop.is_set():
            seq += 1
            with store.transaction() as tx:
                tx.execute(
                    "INSERT INTO batches VALUES ('st-02', 'telemetry', ?, 1, 2, 1.0)", (seq,)
                )
                for idx in range(2):
                    tx.execute(
                        "INSERT INTO telemetry VALUES ('st-02', ?, ?, 'temp', 1.0, 1.0)",
                        (seq, idx),
                    )
        store.close()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for n in range(3):
            backups.backup(home, tmp_path / f"b{n}.fbk")
    finally:
        stop.set()
        writer.join()
    for n in range(3):
        target = tmp_path / f"restored-{n}"
        backups.restore(tmp_path / f"b{n}.fbk", target)
        with sqlite3.connect(str(target / "manager.db")) as conn:
            batches = conn.execute("SELECT count(*) FROM batches WHERE edge='st-02'").fetchone()
            records = conn.execute("SELECT count(*) FROM telemetry").fetchone()
        assert records[0] == 2 * batches[0]
