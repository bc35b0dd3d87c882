"""``fedge manager backup`` / ``restore`` (issue 27, item 3): a manager home in one file.

What a backup holds (see layout.py for the home)::

    backup.json          the manifest: fleet, when, fedge version, every file's sha256,
                         the store's schema version, stream marks and record counts
    manager.toml         settings
    manager.db           the store, copied through SQLite's online backup API
    superlink/superlink.db   the fleet SuperLink's state (its registered SuperNode keys)
    keys/                the manifest signing key, the pinned fleet root, staged keys
    pki/                 the fleet CA (its key as it is: encrypted when the home's is),
                         server and client certificates, the CRL
    secrets/             operator accounts, and the passwords of an --insecure home
    artifacts/           the model registry's files

Left out, because the manager makes them again: run/ (locks, serve.json), logs/, the
broker's configuration and save file (broker/: a restored home starts a fresh broker;
retained documents are published again by serve) and the SuperLink's log.

A backup is consistent where it matters: the store and the SuperLink are each copied
as of one committed transaction while ``serve`` keeps ingesting; the files are copied
after the store, so every artifact the copied registry names is in the archive.

What a restore lacks: records the manager acknowledged after the store was copied.
Stations delete a batch once the broker has it, so those are not sent again; a station's
next batch then opens a gap from the backup's mark (backup.json's ``stream_marks``) that
the manager records and ``fedge doctor`` shows. Records in stations' outboxes when the
manager went down are sent again, and what the copy holds already is recognised as a
duplicate by its (edge, stream, seq) and stored once.

With a passphrase, the archive is sealed (sealing.py): scrypt and AES-256-GCM.
"""

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import fedge
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.home import backup_store, run_dir, sealing
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.store import Store

FORMAT = "fedge-manager-backup"
FORMAT_VERSION = 1
MANIFEST = "backup.json"
DATABASES = ("manager.db", "superlink/superlink.db")
TREES = ("keys", "pki", "secrets", "artifacts")
FILES = ("manager.toml",)
# Never copied from a tree: locks and SQLite's side files of a live database.
SKIPPED_SUFFIXES = (".lock", "-wal", "-shm", "-journal")
SECRET_TREES = ("keys", "secrets", "pki")


@dataclass(frozen=True)
class BackupReport:
    path: str
    sealed: bool
    fleet: str
    created_at: float
    files: int
    bytes: int
    schema_version: int
    stream_marks: dict[str, int]
    records: dict[str, int]
    # From the start of the store's copy to the end of the backup (the window in which
    # acknowledged records are not in it).
    copy_s: float


@dataclass(frozen=True)
class RestoreReport:
    home: str
    fleet: str
    created_at: float
    files: int
    schema_version: int  # of the store as restored (upgraded if it was older)
    records: dict[str, int]
    moved_aside: str  # where a replaced home went ('' when there was none)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _tree_files(root: Path, tree: str) -> Iterator[Path]:
    base = root / tree
    if not base.is_dir():
        return
    for path in sorted(base.rglob("*")):
        if path.is_file() and not path.is_symlink() and not path.name.endswith(SKIPPED_SUFFIXES):
            yield path


def backup(
    home: ManagerHome,
    out: Path,
    passphrase: bytes | None = None,
    clock: Callable[[], float] = time.time,
) -> BackupReport:
    """Write the home's backup to ``out`` (sealed with ``passphrase`` if given); the
    home's processes may be running."""
    settings = home.settings()
    if passphrase is not None:
        sealing.check_passphrase(passphrase)
    if out.exists():
        raise ManagerError(f"{out} exists: a backup never overwrites a file; name a new one")
    if out.resolve().is_relative_to(home.root.resolve()):
        raise ManagerError(f"{out} is inside the home it backs up; write it elsewhere")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fedge-backup-", dir=out.parent) as scratch:
        staged = Path(scratch)
        if not home.db_path.exists():
            Store(home.db_path).close()  # a home serve never ran in: an empty store
        created_at = clock()
        started = time.monotonic()
        for name in DATABASES:
            if (home.root / name).is_file():
                backup_store.snapshot(home.root / name, staged / name)
        facts = backup_store.facts(staged / "manager.db")
        members: dict[str, Path] = {name: staged / name for name in DATABASES}
        members = {name: path for name, path in members.items() if path.is_file()}
        for name in FILES:
            members[name] = home.root / name
        for tree in TREES:
            for path in _tree_files(home.root, tree):
                members[path.relative_to(home.root).as_posix()] = path
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "fedge_version": fedge.__version__,
            "fleet": settings.fleet,
            "created_at": created_at,
            "schema_version": facts.schema_version,
            "stream_marks": facts.stream_marks,
            "records": facts.records,
            "files": {name: _sha256(path) for name, path in sorted(members.items())},
        }
        (staged / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        archive = staged / "archive.tar.gz"
        with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
            tar.add(staged / MANIFEST, MANIFEST)
            for name, path in sorted(members.items()):
                tar.add(path, name, recursive=False)
        part = out.with_name(out.name + ".part")
        part.unlink(missing_ok=True)
        # Created 0600 from the first byte (keys inside, sealed or not): a file made with
        # the umask and narrowed afterwards could be opened by anyone meanwhile.
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as target, open(archive, "rb") as plain:
            if passphrase is None:
                shutil.copyfileobj(plain, target)
            else:
                sealing.seal(plain, target, passphrase)
        part.replace(out)
    return BackupReport(
        path=str(out),
        sealed=passphrase is not None,
        fleet=settings.fleet,
        created_at=created_at,
        files=len(members),
        bytes=out.stat().st_size,
        schema_version=facts.schema_version,
        stream_marks=facts.stream_marks,
        records=facts.records,
        copy_s=time.monotonic() - started,
    )


def read_manifest(archive: Path, passphrase: bytes | None = None) -> dict[str, object]:
    """The manifest of a backup file (to look before restoring)."""
    with _opened(archive, passphrase) as plain, _tar(plain, archive) as tar:
        return _manifest(tar)


@contextmanager
def _opened(archive: Path, passphrase: bytes | None) -> Iterator[Path]:
    """The plain tar.gz of ``archive`` (unsealed into a private temporary file if sealed)."""
    if not archive.is_file():
        raise ManagerError(f"{archive} does not exist: name a file `manager backup` wrote")
    if not sealing.is_sealed(archive):
        yield archive
        return
    if passphrase is None:
        raise ManagerError(f"{archive} is sealed: give its passphrase (--passphrase-file)")
    with tempfile.TemporaryDirectory(prefix=".fedge-restore-") as scratch:
        plain = Path(scratch) / "archive.tar.gz"
        with open(archive, "rb") as sealed, open(plain, "wb") as out:
            sealing.unseal(sealed, out, passphrase)
        yield plain


@contextmanager
def _tar(plain: Path, archive: Path) -> Iterator[tarfile.TarFile]:
    """The archive opened for reading; a file that is not one is a ManagerError."""
    try:
        with tarfile.open(plain, "r:gz") as tar:
            yield tar
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise ManagerError(
            f"{archive} is not a fedge manager backup, or is damaged ({exc}): name a file "
            "`manager backup` wrote, copied whole"
        ) from exc


def _manifest(tar: tarfile.TarFile) -> dict[str, object]:
    try:
        member = tar.extractfile(MANIFEST)
        manifest = json.loads(member.read()) if member is not None else None
    except (KeyError, ValueError) as exc:
        raise ManagerError(f"not a fedge manager backup (no readable {MANIFEST}): {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ManagerError(f"not a fedge manager backup ({MANIFEST} is not its manifest)")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ManagerError(
            f"backup format {manifest.get('format_version')!r}; this fedge reads "
            f"{FORMAT_VERSION}: restore it with the fedge that wrote it "
            f"({manifest.get('fedge_version')})"
        )
    return manifest


def _occupied(target: Path) -> bool:
    return target.exists() and (not target.is_dir() or any(target.iterdir()))


def restore(
    archive: Path,
    target: Path,
    passphrase: bytes | None = None,
    replace: bool = False,
    clock: Callable[[], float] = time.time,
) -> RestoreReport:
    """Make ``target`` the home ``archive`` holds.

    An existing home (or any non-empty directory) is refused unless ``replace``; then it
    is moved aside to ``<target>.replaced-<time>``, never deleted, and only when none of
    its processes runs. Every file is checked against the manifest and the store by
    SQLite before anything at ``target`` changes; a store of an older release is upgraded
    (schema_store), one of a newer fedge refused.
    """
    if _occupied(target):
        if not replace:
            raise ManagerError(
                f"{target} exists and is not empty: restore into a new directory, or pass "
                "--replace to move it aside (it is kept, renamed)"
            )
        for role in run_dir.Role:
            held = run_dir.running(target, role)
            if held is not None:
                raise ManagerError(
                    f"{role.value} is running on {target} (pid {held.pid}): stop it "
                    "(`fedge manager down`) before replacing the home"
                )
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{target.name}.restore-", dir=target.parent))
    try:
        with _opened(archive, passphrase) as plain, _tar(plain, archive) as tar:
            manifest = _manifest(tar)
            # The "data" filter refuses absolute names, .. and links out of the tree.
            tar.extractall(staged, filter="data")
        files = manifest.get("files")
        if not isinstance(files, dict):
            raise ManagerError(f"{archive}: its manifest lists no files")
        for name, digest in files.items():
            path = staged / name
            if not path.is_file() or _sha256(path) != digest:
                raise ManagerError(
                    f"{archive}: {name} is missing or differs from the manifest; the backup "
                    "is damaged: restore an earlier one"
                )
        (staged / MANIFEST).unlink()  # checked; the home's own files are what remain
        _secure(staged)
        backup_store.check_integrity(staged / "manager.db")
        store = Store(staged / "manager.db")  # upgrades an older schema, refuses a newer
        store.close()
        backup_store.rebase_artifacts(staged / "manager.db", target.resolve() / "artifacts")
        facts = backup_store.facts(staged / "manager.db")
        moved_aside = ""
        if _occupied(target):
            aside = target.with_name(f"{target.name}.replaced-{int(clock())}")
            target.rename(aside)
            moved_aside = str(aside)
        elif target.exists():
            target.rmdir()
        staged.rename(target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    home = ManagerHome(target)
    return RestoreReport(
        home=str(target),
        fleet=home.settings().fleet,
        created_at=float(str(manifest.get("created_at", 0.0))),
        files=len(files),
        schema_version=facts.schema_version,
        records=facts.records,
        moved_aside=moved_aside,
    )


def _secure(root: Path) -> None:
    """Keys, secrets and the CA readable by the owner only, as `manager init` makes them."""
    os.chmod(root, 0o700)
    for tree in SECRET_TREES:
        base = root / tree
        if not base.is_dir():
            continue
        os.chmod(base, 0o700)
        for path in base.rglob("*"):
            secret = path.suffix == ".key" or tree == "secrets"
            os.chmod(path, 0o700 if path.is_dir() else 0o600 if secret else 0o644)


def report_json(report: BackupReport | RestoreReport) -> str:
    return json.dumps(asdict(report), indent=1, sort_keys=True)
