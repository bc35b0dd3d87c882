"""Labels an operator gave at the manager, arriving at the station (signed, retained).

Each label goes into the station's training set (:class:`~fedge.party.station_store.
StationData`) and the agent's label index, once: the document carries the newest labels
in full, so a document no newer than the last applied one is stale. A withdrawal leaves
both, unless a label given after it stands.
"""

import logging
from collections import Counter

from fedge.edge_agent.settings import AgentSettings
from fedge.edge_agent.store import LocalStore
from fedge.party.errors import StationDataError
from fedge.party.station_store import StationData
from fedge.protocols.errors import ProtocolError
from fedge.protocols.labels import StationLabels
from fedge.protocols.signing import TrustedKeys, open_signed

log = logging.getLogger(__name__)


def apply_labels(
    envelope: bytes,
    *,
    settings: AgentSettings,
    keys: TrustedKeys,
    store: LocalStore,
    station: StationData,
    counters: Counter[str],
) -> None:
    """Check the signed labels document and keep every label it brings, once."""
    try:
        document = open_signed(envelope, StationLabels, keys)
        if document.edge != settings.edge or document.fleet != settings.fleet:
            raise ProtocolError(f"labels are for {document.fleet}/{document.edge}")
    except ProtocolError as exc:
        counters[f"labels.rejected.{exc.reason}"] += 1
        log.error("labels document rejected (%s): %s", exc.reason, exc)
        return
    if document.version <= int(store.get("labels_version") or 0):
        counters["labels.stale"] += 1
        return
    applied = 0
    for record in document.labels:
        try:
            # The station's set first (an idempotent upsert), then the record that the
            # label was applied: a failure in between applies it again, not never.
            station.label(record.prediction_id, record.label, record.at)
        except (StationDataError, OSError) as exc:
            counters["labels.station_failed"] += 1
            log.error("label %s not kept for training: %s", record.label_id, exc)
            continue
        if store.add_remote_label(
            record.label_id, record.prediction_id, record.label, record.who, record.at
        ):
            applied += 1
    withdrawn = 0
    for withdrawal in document.withdrawn or ():
        # The agent's label index too (what `fedge agent label` and the status show), on
        # its own: each side is idempotent, so a failure of the other is retried alone.
        counters["labels.index_withdrawn"] += store.withdraw_label(
            withdrawal.prediction_id, withdrawal.at
        )
        try:
            # Only a label no newer than the one withdrawn goes: one given since stands.
            withdrawn += station.unlabel(withdrawal.prediction_id, withdrawal.at)
        except (StationDataError, OSError) as exc:
            counters["labels.station_failed"] += 1
            log.error("withdrawal of %s not applied: %s", withdrawal.label_id, exc)
    store.put("labels_version", str(document.version))
    counters["labels.from_manager"] += applied
    counters["labels.withdrawn"] += withdrawn
