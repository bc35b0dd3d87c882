"""The manager keys this agent trusts, and following the fleet's key rotations.

The key pinned in agent.toml is where trust starts. A retained ``down/trust`` chain
(protocols/trust.py) moves it on, one link signed by the key trusted at that point at a
time (protocols/rotation.py); the result is kept in the agent's store, so a restart keeps
the new key. Re-enrolling (a different key pinned in agent.toml) starts over from that key.

What the agent trusts is the :class:`KeyRing` every handler verifies with: an adoption
changes it in place, so the next config, deployment or label document is checked against
the new key only. Documents that arrived signed by a key not trusted yet (the retained
``down/config`` can come before ``down/trust``) are kept, one per kind, and handled again
once a rotation makes their signer trusted.

The fleet's root key, when agent.toml pins one, must have signed every rotation too; the
chain must be signed by the key it leads to and not expired (protocols/rotation.py). The
station's report also says when its signed desired state went stale (freshness.py).
"""

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from fedge.edge_agent.config.freshness import DesiredFreshness
from fedge.edge_agent.deploy.status import Report
from fedge.edge_agent.store import LocalStore
from fedge.protocols import codec, topics
from fedge.protocols.errors import ProtocolError
from fedge.protocols.rotation import Trust, TrustDecision, accept_chain
from fedge.protocols.signing import KeyRing, PublicKey, signer_of
from fedge.protocols.trust import TrustReport, TrustStatus

log = logging.getLogger(__name__)
_ENROLLED, _KEY, _SEQUENCE, _RETIRED = (
    "trust_enrolled_key",
    "trust_key",
    "trust_sequence",
    "trust_retired",
)


def load(store: LocalStore, pinned: PublicKey) -> tuple[Trust, set[str]]:
    """What this agent trusts: the store's key if it grew from ``pinned``, else ``pinned``."""
    if store.get(_ENROLLED) != pinned.to_text() or store.get(_KEY) is None:
        return Trust(pinned, 0), set()
    key = PublicKey.from_text(str(store.get(_KEY)))
    retired = set(json.loads(store.get(_RETIRED) or "[]"))
    return Trust(key, int(store.get(_SEQUENCE) or 0)), retired


class KeyTrust:
    def __init__(
        self,
        edge: str,
        fleet: str,
        pinned: PublicKey,
        store: LocalStore,
        counters: Counter[str],
        *,
        report: Report,
        handlers: Callable[[], dict[str, Callable[[bytes], None]]],
        freshness: DesiredFreshness,
        root: PublicKey | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.edge, self.fleet, self.pinned, self.root = edge, fleet, pinned, root
        self.freshness = freshness
        self._clock = clock
        self.store = store
        self.counters = counters
        self._report = report
        self._handlers = handlers
        self.trust, retired = load(store, pinned)
        self.keys = KeyRing(self.trust.key)
        self.keys.retired.update(retired)
        self.last_report: bytes | None = None
        self._last = TrustDecision(TrustStatus.CURRENT, self.trust)
        self._held: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @property
    def done_version(self) -> int:
        """The chain's version this agent is at (the gRPC poll's known version)."""
        return self.trust.sequence

    def hold_if_unknown(self, kind: str, envelope: bytes) -> None:
        """Keep ``envelope`` if a key this agent does not trust (yet) signed it."""
        try:
            signer = signer_of(envelope)
        except ProtocolError:
            return  # the kind's handler says what is wrong with it
        with self._lock:
            if signer not in self.keys:
                self._held[kind] = envelope
            else:
                self._held.pop(kind, None)

    def handle(self, payload: bytes) -> None:
        with self._lock:
            decision = accept_chain(
                self.trust, payload, self.fleet, root=self.root, now=self._clock()
            )
            if decision.trust != self.trust:
                old = self.trust.key
                retired = self.keys.retired | ({old.key_id} if decision.trust.key != old else set())
                # Stored before it counts: a crash after this comes back trusting the new key.
                self.store.put_many(
                    {
                        _ENROLLED: self.pinned.to_text(),
                        _KEY: decision.trust.key.to_text(),
                        _SEQUENCE: str(decision.trust.sequence),
                        _RETIRED: json.dumps(sorted(retired)),
                    }
                )
                self.trust = decision.trust
                self.keys.replace(decision.trust.key)
            held = [
                (kind, envelope)
                for kind, envelope in self._held.items()
                if decision.status is TrustStatus.ADOPTED and signer_of(envelope) in self.keys
            ]
            for kind, _ in held:
                del self._held[kind]
        if decision.status is not TrustStatus.REJECTED:
            self.freshness.note("trust", decision.expires_at)
        self._decided(decision)
        handlers = self._handlers()
        for kind, envelope in held:
            self.counters["trust.replayed"] += 1
            handlers[kind](envelope)

    def _decided(self, decision: TrustDecision) -> None:
        if decision.status is TrustStatus.REJECTED:
            self.counters["trust.rejected"] += 1
            log.error("key rotation refused: %s", decision.reason)
        elif decision.status is TrustStatus.ADOPTED:
            self.counters["trust.adopted"] += len(decision.adopted)
            log.warning(
                "manager key rotated to %s (sequence %s); documents signed by the old key "
                "are refused from now on",
                decision.trust.key.key_id,
                decision.trust.sequence,
            )
        elif self.last_report is not None:
            return  # still current: said already
        self._last = decision
        self._send_report()

    def check_freshness(self) -> None:
        """Report (and log) the moment the signed desired state goes stale or is fresh
        again (called periodically)."""
        if self.freshness.changed() is not None:
            self._send_report()

    def _send_report(self) -> None:
        decision, stale = self._last, self.freshness.staleness()
        reason = decision.reason
        if stale.stale:
            reason = f"desired state {stale.describe()}" + (f"; {reason}" if reason else "")
        report = TrustReport(
            self.edge,
            decision.status,
            decision.trust.key.key_id,
            decision.trust.sequence,
            reason[:1000],
            time.time(),
            stale_since=(stale.refreshed_at or 0.0) if stale.stale else None,
        )
        self.last_report = codec.encode(report)
        self._report(topics.Up.TRUST, self.last_report, True)
