"""What the agent states about itself to the manager, on its up/ topics or over gRPC.

Its liveness (the birth of each session and the goodbye when it stops) and, after each
birth, the retained reports still in force: a new session states everything again, in
Sparkplug's order. For the gRPC desired poller, the version of each desired document the
agent is done with.
"""

import time

from fedge import __version__
from fedge.edge_agent.config.pace import current as current_pace
from fedge.edge_agent.config.station import Configs
from fedge.edge_agent.deploy.models import Deployments
from fedge.edge_agent.identity.trust import KeyTrust
from fedge.edge_agent.inference.evaluations import Evaluations
from fedge.edge_agent.store import LocalStore
from fedge.protocols import codec, topics
from fedge.protocols.liveness import EdgeState, Liveness


def liveness(
    edge: str,
    session: int,
    state: EdgeState,
    serving: str,
    applied_version: int,
    images_at: str | None = None,
) -> Liveness:
    """The agent's liveness now: a birth (online) or a goodbye (offline); ``images_at``:
    where it serves its images to the manager (edge_agent/viewing/server.py), if it does."""
    return Liveness(
        edge, session, state, __version__, serving, applied_version, time.time(), images_at
    )


def in_force(
    birth: Liveness,
    *,
    configs: Configs,
    deployments: Deployments,
    evaluations: Evaluations,
    trust: KeyTrust,
) -> list[tuple[topics.Up, bytes]]:
    """What a new session states, in order: the birth, then what is in force."""
    statements = [(topics.Up.STATE, codec.encode(birth))]
    if configs.last_report is not None:
        statements.append((topics.Up.CONFIG, configs.last_report))
    last_deploy = deployments.last_status
    if last_deploy is not None:
        statements.append((topics.Up.DEPLOY, last_deploy))
    last_evaluation = evaluations.last_report
    if last_evaluation is not None:
        statements.append((topics.Up.EVALUATE, last_evaluation))
    if trust.last_report is not None:
        statements.append((topics.Up.TRUST, trust.last_report))
    return statements


def done_versions(
    applied_version: int,
    store: LocalStore,
    *,
    deployments: Deployments,
    evaluations: Evaluations,
    trust: KeyTrust,
) -> dict[str, int]:
    """The version of each desired document the agent is done with (for gRPC polls)."""
    done = {
        topics.Down.CONFIG.value: max(applied_version, deployments.config_done_version),
        topics.Down.DEPLOY.value: deployments.done_version,
        topics.Down.LABELS.value: int(store.get("labels_version") or 0),
        topics.Down.EVALUATE.value: evaluations.done_version,
        topics.Down.TRUST.value: trust.done_version,
    }
    # Named only once one arrived: a manager older than the pace document (issue 33)
    # refuses a kind it does not know, and a newer one sends what is missing anyway.
    pace = current_pace(store).version
    if pace:
        done[topics.Down.PACE.value] = pace
    return done
