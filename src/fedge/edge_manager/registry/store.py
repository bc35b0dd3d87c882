"""The model registry's rows in the manager's store: the SQL side of ``models``.

:class:`fedge.edge_manager.registry.versions.Registry` decides what may be published and signs
it; the rows it writes and reads are here, and ``fedge manager rotate-key``
(key_rotation.py) re-signs every manifest through :func:`manifests` and
:func:`set_envelope`. Manifests come back as the JSON text they were stored as.
"""

from dataclasses import dataclass

from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class StoredModel:
    """One published version as stored: its manifest (JSON), signed envelope and the
    path of its artifact."""

    manifest: str
    envelope: str
    path: str


@dataclass(frozen=True)
class ModelRow:
    """One line of ``fedge model list``, with the manifest (JSON) it was read from."""

    name: str
    version: int
    sha256: str
    size: int
    parent_version: int | None
    run_id: str | None
    created_at: float
    manifest: str


@dataclass(frozen=True)
class ManifestText:
    """A version's manifest (JSON), to be signed again."""

    name: str
    version: int
    manifest: str


def exists(store: Store, name: str, version: int) -> bool:
    row = store.one("SELECT 1 AS x FROM models WHERE name=? AND version=?", (name, version))
    return row is not None


def add(
    store: Store,
    *,
    name: str,
    version: int,
    sha256: str,
    size: int,
    manifest: str,
    envelope: str,
    path: str,
    parent_version: int | None,
    run_id: str | None,
    created_at: float,
) -> None:
    """Store a published version (``manifest``: its JSON)."""
    store.db.table("models").insert(
        {
            "name": name,
            "version": version,
            "sha256": sha256,
            "size": size,
            "manifest": manifest,
            "envelope": envelope,
            "path": path,
            "parent_version": parent_version,
            "run_id": run_id,
            "created_at": created_at,
        }
    )


def latest_version(store: Store, name: str) -> int | None:
    value = store.scalar("SELECT max(version) FROM models WHERE name=?", (name,))
    return None if value is None else int(value)


def get(store: Store, name: str, version: int) -> StoredModel | None:
    row = store.one(
        "SELECT manifest, envelope, path FROM models WHERE name=? AND version=?",
        (name, version),
    )
    if row is None:
        return None
    return StoredModel(str(row["manifest"]), str(row["envelope"]), str(row["path"]))


def rows(store: Store) -> list[ModelRow]:
    """Every published version, by name then version."""
    return [
        ModelRow(**row)
        for row in store.query(
            "SELECT name, version, sha256, size, parent_version, run_id, created_at, manifest "
            "FROM models ORDER BY name, version"
        )
    ]


def manifests(store: Store) -> list[ManifestText]:
    """Every published version's manifest."""
    return [
        ManifestText(row["name"], row["version"], str(row["manifest"]))
        for row in store.query("SELECT name, version, manifest FROM models")
    ]


def set_envelope(store: Store, name: str, version: int, envelope: str) -> None:
    """Replace the signed envelope of ``name:version`` (its manifest is unchanged)."""
    store.conn.execute(
        "UPDATE models SET envelope=? WHERE name=? AND version=?", (envelope, name, version)
    )
