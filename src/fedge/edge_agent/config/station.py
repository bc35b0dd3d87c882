"""The station's config: a signed ``down/config`` document verified, decided, kept, reported.

A config that arrives expired (protocols/freshness.py) is refused; a verified one with a
later expiry -- the manager's refresh of the version in force, or a new version -- marks
the desired state fresh (freshness.py) without applying anything again.

The decision is pure (decisions.decide_config, then the station's privacy budget,
privacy_budget.admit_budget); this module is the adapter around it: it verifies the
envelope with the keys the agent trusts, persists an applied config before it counts
(after a crash the agent comes back with what it reported), commits it to the agent's
serving state (:mod:`fedge.edge_agent.serving`, under its lock), and states the outcome
on the retained ``up/config`` topic.
"""

import logging
import time
from collections import Counter
from collections.abc import Callable

from fedge.edge_agent.config.decisions import ConfigAction, decide_config
from fedge.edge_agent.config.freshness import DesiredFreshness
from fedge.edge_agent.config.privacy_budget import admit_budget
from fedge.edge_agent.deploy.models import Deployments
from fedge.edge_agent.deploy.status import Report
from fedge.edge_agent.serving import ServingState
from fedge.edge_agent.settings import AgentSettings
from fedge.edge_agent.store import LocalStore
from fedge.protocols import codec, topics
from fedge.protocols.config import ConfigReport, ConfigStatus, EdgeConfig
from fedge.protocols.errors import ProtocolError
from fedge.protocols.freshness import check_not_expired
from fedge.protocols.records import Stream
from fedge.protocols.signing import TrustedKeys, open_signed

log = logging.getLogger(__name__)


class Configs:
    def __init__(
        self,
        settings: AgentSettings,
        store: LocalStore,
        keys: TrustedKeys,
        counters: Counter[str],
        *,
        serving: ServingState,
        deployments: Deployments,
        applied: Callable[[], None],
        report: Report,
        freshness: DesiredFreshness,
    ) -> None:
        self.settings = settings
        self.freshness = freshness
        self.store = store
        self.keys = keys
        self.counters = counters
        self._serving = serving
        self._deployments = deployments
        self._applied = applied  # called after the commit, without the lock
        self._report_status = report
        self.last_report: bytes | None = None

    def handle(self, envelope: bytes) -> None:
        try:
            offered = open_signed(envelope, EdgeConfig, self.keys)
            check_not_expired(f"config v{offered.version}", offered.expires_at, time.time())
        except ProtocolError as exc:
            self.counters[f"config.rejected.{exc.reason}"] += 1
            log.error("config rejected (%s): %s", exc.reason, exc)
            self._report(ConfigStatus.REJECTED, 0, f"{exc.reason}: {exc}")
            return
        with self._serving.lock:
            decision = decide_config(
                self._serving.config,
                offered,
                self.settings.fleet,
                self.settings.edge,
                self._deployments.config_done_version,
            )
            if decision.action is ConfigAction.APPLY:
                # The station's privacy budget is in its ledger before the config counts.
                decision = admit_budget(self.settings.data_dir, offered)
            if decision.action is ConfigAction.APPLY:
                # Persist first: after a crash the agent comes back with what it reported;
                # remembered as its model's config, should a rollback go back to that model.
                self.store.put_many(
                    {
                        "applied_config": codec.encode(offered).decode(),
                        **self._deployments.config_writes(offered),
                    }
                )
                self._serving.commit(offered)
                if offered.thumbnails is None:
                    # Sharing is off: thumbnails not yet sealed into a batch never leave.
                    dropped = self.store.drop_pending(Stream.THUMBNAILS)
                    self.counters["thumbnails.dropped"] += dropped
        if decision.action is not ConfigAction.REJECT and self.freshness.note(
            "config", offered.expires_at
        ):
            self.counters["config.refreshed"] += 1
        if decision.action is ConfigAction.APPLY:
            self._applied()
            self.counters["config.applied"] += 1
            log.info(
                "applied config v%d (threshold %.3f)", offered.version, offered.default_threshold
            )
            self._report(ConfigStatus.APPLIED, offered.version, "")
        elif decision.action is ConfigAction.IGNORE:
            self.counters["config.stale"] += 1
            if self.last_report is None:
                self._report(ConfigStatus.APPLIED, offered.version, "")
        else:
            self.counters["config.rejected.invalid"] += 1
            log.error("config rejected: %s", decision.reason)
            self._report(ConfigStatus.REJECTED, offered.version, decision.reason)

    def _report(self, status: ConfigStatus, offered: int, reason: str) -> None:
        current = self._serving.config
        report = ConfigReport(
            self.settings.edge,
            status,
            0 if current is None else current.version,
            offered,
            reason[:1000],
            time.time(),
        )
        payload = codec.encode(report)
        self.last_report = payload
        self._report_status(topics.Up.CONFIG, payload, True)
