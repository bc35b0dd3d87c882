"""Keeping signed desired documents from expiring: the manager's side of freshness.py.

The desired config and the trust chain carry ``expires_at`` (protocols/freshness.py),
signed with it when they are written. The serve loop stamps one that has none (written
by an older fedge) before it goes out, and re-signs the newest of every edge once less
than half of its lifetime is left (checked hourly): same version, same
content, only the expiry and the signature change, so an agent that applied it only
notes that its desired state is fresh. A trust chain is re-signed only by the key it ends
at (the serve loop follows a rotation before it refreshes).
"""

import dataclasses

from fedge.edge_manager.security import trust_store
from fedge.edge_manager.store import Store
from fedge.protocols import codec, topics
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ProtocolError
from fedge.protocols.freshness import expiry, needs_refresh
from fedge.protocols.rotation import parse_link, sign_chain
from fedge.protocols.signing import SigningKey, trusted, verify_envelope
from fedge.protocols.trust import TrustChain

CONFIG, TRUST = topics.Down.CONFIG.value, topics.Down.TRUST.value
EXPIRING_KINDS = (CONFIG, TRUST)
CHECK_EVERY_S = 3600.0


def stamp(
    store: Store, key: SigningKey, edge: str, kind: str, version: int, now: float
) -> str | None:
    """Re-sign ``edge``'s ``kind`` ``version`` with a fresh expiry if it is due (and mark
    it to be published again); the new envelope, or None if nothing was due."""
    if kind not in EXPIRING_KINDS:
        return None
    envelope_text = trust_store.signed_document(store, edge, kind, version)
    if envelope_text is None:
        return None
    try:
        # Only what this manager signed gets a new expiry under its key: a document
        # written into the store by anyone else (forged, or signed by a key a rotation
        # retired: re-signed by the publisher first) is left as it is, and edges refuse it.
        text = verify_envelope(envelope_text.encode(), trusted(key.public)).decode()
    except ProtocolError:
        return None
    if kind == CONFIG:
        config = codec.decode(text.encode(), EdgeConfig)
        if not needs_refresh(config.expires_at, now):
            return None
        document = codec.encode(dataclasses.replace(config, expires_at=expiry(now)))
        envelope = key.sign_payload(document).decode()
    else:
        chain = codec.decode(text.encode(), TrustChain)
        if not needs_refresh(chain.expires_at, now):
            return None
        if parse_link(chain.links[-1]).rotation.new_key != key.public.to_text():
            return None  # signed by the key the chain ends at only (after a reload)
        chain = dataclasses.replace(chain, expires_at=expiry(now))
        document = codec.encode(chain)
        envelope = sign_chain(key, chain).decode()
    trust_store.replace_signed(store, edge, kind, version, document.decode(), envelope)
    return envelope


def refresh_expiring(store: Store, key: SigningKey, now: float) -> int:
    """Re-sign every edge's newest config and trust chain that is due; how many."""
    done = 0
    for doc in trust_store.newest_of_kinds(store, EXPIRING_KINDS):
        if stamp(store, key, doc.edge, doc.kind, doc.version, now) is not None:
            done += 1
    return done
