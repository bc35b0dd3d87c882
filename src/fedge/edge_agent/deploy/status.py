"""The agent's deploy statuses: built, kept as the last one, published on ``up/deploy``.

The last status is kept in the agent's store (``last_deploy_status``) and re-stated
(retained) by every new session after the birth; a status that goes with other state
(an activation, a rollback) is stored by the caller in the same transaction as that
state, then published here.
"""

import time
from collections.abc import Callable

from fedge.edge_agent.serving import ServingState
from fedge.edge_agent.store import LocalStore
from fedge.protocols import codec, topics
from fedge.protocols.deployment import DeployStage, DeployStatus

Report = Callable[[topics.Up, bytes, bool], None]

LAST = "last_deploy_status"


def ref_of(model: str) -> tuple[str, int]:
    """("inspect", 4) of "inspect:4"."""
    name, _, version = model.rpartition(":")
    return name, int(version)


class DeployReports:
    def __init__(
        self, edge: str, store: LocalStore, *, serving: ServingState, report: Report
    ) -> None:
        self.edge = edge
        self.store = store
        self._serving = serving
        self._report = report
        stored = store.get(LAST)
        # Re-stated (retained) by every new session, after the birth.
        self.last_status: bytes | None = None if stored is None else stored.encode()

    def status(
        self,
        deployment_id: str,
        deployment_version: int,
        ref: tuple[str, int],
        stage: DeployStage,
        reason: str,
        serving: str,
    ) -> bytes:
        name, version = ref
        return codec.encode(
            DeployStatus(
                self.edge,
                deployment_id,
                deployment_version,
                name or "unknown",
                version,
                stage,
                reason[:1000],
                serving,
                time.time(),
            )
        )

    def publish(self, payload: bytes) -> None:
        """A deploy status already stored: retained, re-stated by every session."""
        self.last_status = payload
        self._report(topics.Up.DEPLOY, payload, True)

    def stage(
        self,
        deployment_id: str,
        deployment_version: int,
        ref: tuple[str, int],
        stage: DeployStage,
        reason: str,
    ) -> None:
        """A stage that changes nothing else: stored as the last status and published."""
        payload = self.status(
            deployment_id, deployment_version, ref, stage, reason, self._serving.ref
        )
        self.store.put(LAST, payload.decode())
        self.publish(payload)

    def rejected(self, reason: str) -> None:
        """Tell the manager a deployment envelope was refused (forged, malformed, foreign).

        Nothing in such an envelope can be trusted, so the status names no deployment
        (``unknown``, version 0) and reports the model still serving. It is neither kept as
        the last deploy status nor retained: the real deployment state stays what a
        reconnecting manager or agent sees; this report is for the manager listening now.
        """
        status = DeployStatus(
            self.edge,
            "unknown",
            0,
            "unknown",
            0,
            DeployStage.FAILED,
            reason[:1000],
            self._serving.ref,
            time.time(),
        )
        self._report(topics.Up.DEPLOY, codec.encode(status), False)
