"""The loop runner's gate and rollout, wired to the manager's own (no second copy).

The gate is :func:`fedge.edge_manager.gate.run.run` -- the stations score their held-out
labelled images with the candidate and with what they serve, and the manager decides --
and the rollout is a :class:`~fedge.edge_manager.rollout.service.Rollouts` start that the
serve process's driver carries out; the runner only follows it.
"""

from __future__ import annotations

import time

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.operations import opened
from fedge.edge_manager.gate import run as gating
from fedge.edge_manager.gate.verdict import GatePolicy
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.registry.versions import parse_ref
from fedge.edge_manager.rollout import store as rollout_store
from fedge.edge_manager.rollout import views as rollout_views
from fedge.edge_manager.rollout.plan import make_plan
from fedge.edge_manager.rollout.service import Rollouts
from fedge.edge_manager.store import Store
from fedge.loop.policy import LoopPolicy
from fedge.loop.runner import Wiring


class ManagerGate:
    def __init__(self, home: ManagerHome, policy: GatePolicy, timeout_s: float) -> None:
        self.home = home
        self.policy = policy
        self.timeout_s = timeout_s

    def __call__(self, candidate: str) -> tuple[bool, str]:
        with opened(self.home) as fleet:
            _, verdict = gating.run(fleet, candidate, self.policy, timeout_s=self.timeout_s)
        return verdict.blessed, verdict.reason


class ManagerRollout:
    def __init__(self, home: ManagerHome) -> None:
        self.home = home

    def start(self, candidate: str, policy: LoopPolicy) -> str:
        """Roll ``candidate`` out to every edge that serves a version of its model."""
        name, _ = parse_ref(candidate)
        with opened(self.home) as fleet:
            edges = [
                edge
                for edge in fleet.edges()
                if (deployed := fleet.deployed_model(edge)) is not None and deployed[0] == name
            ]
            if not edges:
                raise ManagerError(f"no edge serves a version of {name}: nothing to roll out to")
            strays = sorted(set(policy.canary) - set(edges))
            if strays:  # a rollout without its canary would move a whole wave first
                raise ManagerError(
                    f"canary edge(s) {', '.join(strays)} of the loop policy serve no version "
                    f"of {name}; change the policy (`fedge loop enable ... --canary`)"
                )
            plan = make_plan(
                edges,
                canary=list(policy.canary),
                waves=policy.waves,
                health_window=policy.health_window,
                abort_if=policy.abort_if,
            )
            return Rollouts(fleet).start(candidate, plan, now=time.time())

    def find(self, candidate: str) -> str | None:
        name, version = parse_ref(candidate)
        store = Store(self.home.db_path)
        try:
            return rollout_store.newest_of_model(store.conn, name, version)
        finally:
            store.close()

    def outcome(self, rollout_id: str) -> tuple[bool | None, str]:
        store = Store(self.home.db_path)
        try:
            return rollout_views.outcome(store, rollout_id)
        finally:
            store.close()


def manager_wiring(
    home: ManagerHome,
    *,
    gate_policy: GatePolicy | None = None,
    gate_timeout_s: float = 600.0,
    job_timeout_s: float = 3600.0,
) -> Wiring:
    return Wiring(
        gate=ManagerGate(home, gate_policy or GatePolicy(), gate_timeout_s),
        rollout=ManagerRollout(home),
        job_timeout_s=job_timeout_s,
    )
