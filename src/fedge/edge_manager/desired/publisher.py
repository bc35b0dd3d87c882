"""The serve loop's side of desired documents: from the store to retained ``down/`` topics.

Operators (and rollouts, the gate) write signed desired documents to the store; the
manager's worker thread publishes each one retained at QoS 1 and marks it published only
on the broker's PUBACK (a document whose publish was lost is sent again). After a broker
that lost its retained messages, the newest published version of each is sent again.

It also follows ``fedge manager rotate-key`` (key_rotation.py) while ``serve`` runs:
the key file is re-read when it changes, and a document still signed by a key a rotation
retired is re-signed before it goes out -- never one signed by any other key.

Configs and trust chains go out with an expiry, and are re-signed (same version) before
it comes: stamped here before their first publish, and refreshed hourly once less than
half their lifetime is left (desired_refresh.py; a freeze attack, issue 24).
"""

import logging
import time
from collections import Counter
from pathlib import Path

from fedge.edge_manager.desired import refresh as desired_refresh
from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.security import key_rotation
from fedge.protocols import topics
from fedge.protocols.errors import ProtocolError
from fedge.protocols.signing import signer_of
from fedge.transport.session import PublishResult, Session

log = logging.getLogger(__name__)
DocumentKey = tuple[str, str, int]  # edge, kind, version


def _signer(envelope: bytes) -> str:
    try:
        return signer_of(envelope)
    except ProtocolError:
        return ""  # not an envelope: published as it is, and the edge says what is wrong


def _file_id(path: Path) -> tuple[int, int]:
    try:
        stat = path.stat()
    except OSError:
        return (0, 0)
    return (stat.st_ino, stat.st_mtime_ns)


class DesiredPublisher:
    """Used by the manager's worker thread only (no lock: paho callbacks only enqueue)."""

    def __init__(
        self, home: ManagerHome, fleet: str, mqtt: Session, counters: Counter[str]
    ) -> None:
        self.home = home
        self.fleet = fleet
        self.mqtt = mqtt
        self.counters = counters
        self._inflight: dict[int, DocumentKey] = {}
        self._key_file = _file_id(home.key_path)
        self._retired: set[str] | None = None  # read from the store on the first loop
        self._refreshed_at: float | None = None  # monotonic time of the last sweep

    def follow_key(self, fleet: Fleet) -> bool:
        """Sign with the key ``fedge manager rotate-key`` put in place while this runs;
        True when the key changed."""
        current = _file_id(self.home.key_path)
        if current == self._key_file and self._retired is not None:
            return False
        try:
            key = self.home.signing_key()
        except (OSError, ProtocolError) as exc:  # mid-replace: the next loop sees it whole
            log.warning("signing key not readable yet: %s", exc)
            return False
        self._key_file = current
        self._retired = key_rotation.retired_ids(fleet.store)
        if key.public.key_id == fleet.key.public.key_id:
            return False  # the first look at the store, at start
        fleet.use_key(key)
        self.counters["key.reloaded"] += 1
        log.warning("signing with the rotated manager key %s from now on", key.public.key_id)
        return True

    def publish_pending(self, fleet: Fleet) -> None:
        if not self.mqtt.connected.is_set():
            return
        retired = self._retired or set()
        now = time.time()
        if self._refreshed_at is None or time.monotonic() - self._refreshed_at >= (
            desired_refresh.CHECK_EVERY_S
        ):
            self._refreshed_at = time.monotonic()
            self.counters["refreshed"] += desired_refresh.refresh_expiring(
                fleet.store, fleet.key, now
            )
        for doc in desired_store.unpublished(fleet.store, skip=set(self._inflight.values())):
            envelope = doc.envelope.encode()
            stamped = desired_refresh.stamp(
                fleet.store, fleet.key, doc.edge, doc.kind, doc.version, now
            )
            if stamped is not None:  # due (or without expiry), signed by the key in use
                envelope = stamped.encode()
                self.counters["stamped"] += 1
            elif doc.kind != key_rotation.TRUST and _signer(envelope) in retired:
                # Written with a key a rotation retired (between its commit and this
                # loop's reload): edges would refuse it, so it goes out re-signed. A
                # document signed by any other key goes out as it is, and is refused.
                envelope = key_rotation.resign_desired(
                    fleet.store, fleet.key, doc.edge, doc.kind, doc.version
                ).encode()
                self.counters["resigned"] += 1
            self._publish((doc.edge, doc.kind, doc.version), envelope)

    def _publish(self, key: DocumentKey, envelope: bytes) -> None:
        edge, kind, _ = key
        topic = topics.down(self.fleet, edge, topics.Down(kind))
        mid = self.mqtt.publish(topic, envelope, qos=1, retain=True)
        self._inflight[mid] = key

    def mark_published(self, fleet: Fleet, result: PublishResult, now: float) -> None:
        key = self._inflight.pop(result.mid, None)
        if key is None:
            return
        if result.ok:
            desired_store.mark_published(fleet.store, *key, at=now)
            self.counters["published"] += 1
        else:
            log.error("broker refused desired document %s: %s", key, result.reason)

    def republish_latest(self, fleet: Fleet) -> None:
        """The newest published version of every document again (a broker that may have
        lost its retained messages); edges ignore versions they already applied."""
        for doc in desired_store.latest_published(fleet.store):
            self._publish((doc.edge, doc.kind, doc.version), doc.envelope.encode())
