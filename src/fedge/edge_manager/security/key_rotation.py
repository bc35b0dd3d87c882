"""``fedge manager rotate-key``: a new signing key for the fleet, co-signed by old and new.

A rotation, in order (each step safe to be cut short by a crash):

1. The new key is made and written to ``keys/next/`` (0600).
2. One transaction stores the rotation link (signed by the current key, the new key and,
   when the fleet has an offline root key -- ``keys/root.pub`` pins its public half --
   by the root key the operator brings, protocols/rotation.py), gives every edge the
   whole chain, signed by the new key with an expiry, as its next ``trust`` desired
   document, and re-signs with the new key what edges may still be sent: every
   model manifest in the registry and each edge's newest desired document of every kind
   (deployments and evaluations carry manifests, which are swapped for the re-signed
   ones). Re-signed documents keep their version and are published again; an edge that
   already applied that version ignores it.
3. The new key replaces ``keys/manager.key``; the old private key is gone.

:func:`settle` finishes step 3 when the store has the link but the key file is still the
old one, and drops a ``keys/next/`` key that no stored link names (a rotation cut short
before its transaction). ``manager serve`` notices the new key file and signs with it
(service.py); a document it wrote with the old key in between is re-signed before it is
published (:func:`resign_desired`). The statements are in trust_store.py (links, edge
trust, desired documents) and model_store.py (manifests).
"""

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.registry import store as model_store
from fedge.edge_manager.security import trust_store
from fedge.edge_manager.security.trust_store import EdgeTrust as EdgeTrust
from fedge.edge_manager.store import Store
from fedge.protocols import codec
from fedge.protocols.deployment import DeploymentDesired
from fedge.protocols.evaluation import EvaluationRequest
from fedge.protocols.freshness import expiry
from fedge.protocols.rotation import rotation_link, sign_chain
from fedge.protocols.signing import PublicKey, SigningKey
from fedge.protocols.trust import TrustChain

TRUST = "trust"


@dataclass(frozen=True)
class Rotation:
    sequence: int
    old_key_id: str
    new_key_id: str
    edges: int  # edges given the new chain
    documents: int  # desired documents re-signed
    manifests: int  # registry manifests re-signed


def settle(home: ManagerHome) -> str:
    """Finish or drop a rotation a crash cut short; what was done ("" if nothing)."""
    pending = home.key_path.parent / "next" / home.key_path.name
    if not pending.exists():
        return ""
    new = SigningKey.load(pending)
    store = Store(home.db_path)
    try:
        newest = trust_store.newest_key(store)
    finally:
        store.close()
    if newest == new.public.to_text():
        _install(home, pending)
        return f"finished the rotation to key {new.public.key_id}"
    shutil.rmtree(pending.parent)
    return f"dropped key {new.public.key_id}: its rotation was never stored"


def _install(home: ManagerHome, pending: Path) -> None:
    staged = home.key_path.parent / "next"
    # The public half first: a crash between the two leaves a stale .pub, which the next
    # settle rewrites (the private key is what signs).
    os.replace(staged / home.public_key_path.name, home.public_key_path)
    os.replace(pending, home.key_path)
    staged.rmdir()


def root_pub_path(home: ManagerHome) -> Path:
    """Where the public half of the fleet's offline root key is pinned (the private half
    never is on the manager)."""
    return home.key_path.parent / "root.pub"


def fleet_root(home: ManagerHome) -> PublicKey | None:
    """The fleet's root key (None: the fleet has none)."""
    path = root_pub_path(home)
    return PublicKey.load(path) if path.exists() else None


def make_root_key(out: Path) -> SigningKey:
    """A new offline root key written to ``out`` (0600, and ``out``.pub): on an
    operator's machine or a USB stick, not in the manager's home."""
    if out.exists():
        raise ManagerError(f"{out} exists; a root key is never overwritten")
    key = SigningKey.generate()
    key.save(out)
    return key


def pin_root(home: ManagerHome, public: PublicKey) -> None:
    """Pin ``public`` as the fleet's root key: stations enrolled from now on pin it too
    and follow a rotation only with its signature."""
    current = fleet_root(home)
    if current is not None and current != public:
        raise ManagerError(
            f"this fleet already pins root key {current.key_id}; replacing a root key is "
            "not supported (stations pinned it at enrollment)"
        )
    root_pub_path(home).write_text(public.to_text() + "\n")


def _check_root(home: ManagerHome, root_key: SigningKey | None) -> None:
    pinned = fleet_root(home)
    if pinned is None and root_key is not None:
        raise ManagerError(
            "this fleet has no root key: run without --root-key, or pin one first "
            "(`fedge manager root-key init --out /media/usb/fleet-root.key`)"
        )
    if pinned is not None and root_key is None:
        raise ManagerError(
            f"this fleet's stations follow a rotation only with the signature of its root "
            f"key {pinned.key_id}: pass --root-key FILE (the offline key)"
        )
    if pinned is not None and root_key is not None and root_key.public != pinned:
        raise ManagerError(
            f"--root-key is key {root_key.public.key_id}, not the fleet's root key "
            f"{pinned.key_id} (keys/root.pub)"
        )


def rotate(
    home: ManagerHome, *, now: float | None = None, root_key: SigningKey | None = None
) -> Rotation:
    """Rotate to a new key, the link signed by the old and the new key, and by
    ``root_key`` (required when the fleet pins a root key, refused otherwise)."""
    _check_root(home, root_key)
    settle(home)
    fleet = home.settings().fleet
    old = home.signing_key()
    new = SigningKey.generate()
    pending = home.key_path.parent / "next" / home.key_path.name
    new.save(pending)
    at = time.time() if now is None else now
    store = Store(home.db_path)
    try:
        with store.transaction() as conn:
            sequence = trust_store.last_sequence(store) + 1
            newest = trust_store.newest_key(store)
            if newest is not None and newest != old.public.to_text():
                raise ManagerError(
                    "keys/manager.key is not the key the last rotation introduced; restore "
                    "that key before rotating again"
                )
            link = rotation_link(
                old, new, fleet=fleet, sequence=sequence, issued_at=at, root=root_key
            )
            trust_store.add_link(conn, sequence, old.public.key_id, new.public.to_text(), link, at)
            edges = edge_store.names(store)
            for edge in edges:
                give_chain(store, fleet, edge, at, new)
            manifests = resign_manifests(store, new)
            latest = trust_store.newest_documents(store, TRUST)
            for doc in latest:
                resign_desired(store, new, doc.edge, doc.kind, doc.version)
    except BaseException:
        shutil.rmtree(pending.parent, ignore_errors=True)
        raise
    finally:
        store.close()
    _install(home, pending)
    return Rotation(
        sequence, old.public.key_id, new.public.key_id, len(edges), len(latest), manifests
    )


def key_since(home: ManagerHome) -> float:
    """When the signing key in use took over: the newest rotation's time, else (never
    rotated) when the home's key file was written."""
    store = Store(home.db_path)
    try:
        links = trust_store.links(store)
    finally:
        store.close()
    return _since(home, links[-1].created_at if links else None)


def _since(home: ManagerHome, newest_rotation_at: float | None) -> float:
    # Never rotated: the key file's time, so a copy that drops file times looks younger.
    return home.key_path.stat().st_mtime if newest_rotation_at is None else newest_rotation_at


def rotation_due(since: float, now: float, max_age_days: float) -> bool:
    """Whether a key in use since ``since`` is past ``max_age_days`` at ``now`` (a
    rotation schedule run from cron or a systemd timer; NIST SP 800-57 calls the span a
    key may sign its cryptoperiod)."""
    return now - since >= max_age_days * 86400.0


def rotate_if_due(
    home: ManagerHome,
    max_age_days: float,
    *,
    now: float | None = None,
    root_key: SigningKey | None = None,
) -> Rotation | None:
    """:func:`rotate` when the key in use is at least ``max_age_days`` old, else None
    (``root_key``: as for :func:`rotate`, needed once the fleet pins one)."""
    at = time.time() if now is None else now
    if not rotation_due(key_since(home), at, max_age_days):
        return None
    return rotate(home, now=at, root_key=root_key)


def give_chain(store: Store, fleet: str, edge: str, now: float, key: SigningKey) -> None:
    """Make the fleet's chain ``edge``'s newest ``trust`` document (none before the first
    rotation). Also for an edge enrolled after a rotation: it reports the key it trusts.
    ``key`` is the key the chain ends at, which signs it with an expiry."""
    chain = chain_of(store, fleet, expires_at=expiry(now))
    if chain is None:
        return
    version = len(chain.links)
    if trust_store.has_document(store, edge, TRUST, version):
        return
    # Each link carries its own signatures; the whole is signed by the newest key for
    # its expiry. Older unpublished chains are superseded (desired_store.write).
    document = codec.encode(chain).decode()
    envelope = sign_chain(key, chain).decode()
    desired_store.write(store.conn, edge, TRUST, version, document, envelope, now)


def retired_ids(store: Store) -> set[str]:
    """The ids of the keys this manager signed with before its rotations."""
    return trust_store.signers(store)


def chain_of(store: Store, fleet: str, *, expires_at: float | None = None) -> TrustChain | None:
    """The fleet's rotations so far (None before the first)."""
    links = trust_store.link_envelopes(store)
    return TrustChain(fleet, tuple(links), expires_at) if links else None


def resign_manifests(store: Store, key: SigningKey) -> int:
    manifests = model_store.manifests(store)
    for model in manifests:
        envelope = key.sign_payload(model.manifest.encode()).decode()
        model_store.set_envelope(store, model.name, model.version, envelope)
    return len(manifests)


def resign_desired(store: Store, key: SigningKey, edge: str, kind: str, version: int) -> str:
    """Sign ``edge``'s desired ``kind`` document ``version`` with ``key`` (the manifests it
    carries too) and mark it to be published again."""
    stored = trust_store.document(store, edge, kind, version)
    if stored is None:
        raise ManagerError(f"no desired {kind} v{version} for {edge}")
    document = stored.encode()
    # Ed25519 is deterministic: a manifest re-signed here is byte for byte the registry's.
    if kind == "deploy":
        desired = codec.decode(document, DeploymentDesired)
        manifest = key.resign(desired.manifest_envelope.encode()).decode()
        document = codec.encode(dataclasses.replace(desired, manifest_envelope=manifest))
    elif kind == "evaluate":
        request = codec.decode(document, EvaluationRequest)
        manifests = tuple(key.resign(e.encode()).decode() for e in request.manifest_envelopes)
        document = codec.encode(dataclasses.replace(request, manifest_envelopes=manifests))
    envelope = key.sign_payload(document).decode()
    trust_store.replace_signed(store, edge, kind, version, document.decode(), envelope)
    return envelope


# -- how far a rotation has reached


@dataclass(frozen=True)
class TrustView:
    key_id: str  # the key the manager signs with
    sequence: int  # its place in the chain (0: never rotated)
    since: float  # when it took over (key_since)
    links: tuple[tuple[int, str, str, float], ...]  # (sequence, signer id, new key id, at)
    edges: tuple[EdgeTrust, ...]  # every station but the revoked

    def on_current_key(self) -> list[str]:
        """Edges that said they trust the current key (before any rotation: all of them,
        each trusting the key it was enrolled with)."""
        return [e.edge for e in self.edges if e.key_id == self.key_id or not self.links]

    def behind(self) -> list[str]:
        """Edges not (yet) known to trust the current key: offline since the rotation, or
        refusing it."""
        current = set(self.on_current_key())
        return [e.edge for e in self.edges if e.edge not in current]


def edge_trust(store: Store, edge: str) -> EdgeTrust | None:
    """What ``edge`` last said it trusts, and whether its desired state is stale (None:
    not a station, or revoked)."""
    return next((e for e in trust_store.edge_trust(store) if e.edge == edge), None)


def trust_view(home: ManagerHome) -> TrustView:
    key = home.signing_key().public
    store = Store(home.db_path)
    try:
        links = tuple(
            (
                link.sequence,
                link.signer,
                PublicKey.from_text(link.new_key).key_id,
                link.created_at,
            )
            for link in trust_store.links(store)
        )
        # A revoked station (every certificate of it revoked) can no longer say what it
        # trusts: it is not waited for.
        edges = tuple(trust_store.edge_trust(store))
    finally:
        store.close()
    sequence = links[-1][0] if links else 0
    since = _since(home, links[-1][3] if links else None)
    return TrustView(key.key_id, sequence, since, links, edges)
