"""Budgets are enforced where the data is: a station out of budget refuses, the round goes on.

Real processes: the fleet's SuperLink (``fedge.aggregator.superlink.link``), two
``flower-supernode`` processes started by the agent's own supervisor
(:mod:`fedge.edge_agent.training.supervisor`) on stations' data directories, each running the
station's ClientApp, and fedge's fleet ServerApp submitted with ``flwr run``. The job
asks for DP-SGD (``[privacy] mode = "local"``). st-02's ledger (as its agent keeps it
from a signed config) is at its lifetime budget from an earlier job: its train reply is
an error naming the budget, nothing is added to its ledger, and the round completes with
st-01, which reports the epsilon its own ledger recorded. (Two stations, not more: every
message starts a ClientApp process that loads torch, and the test must stay short.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import keep_labelled_images, make_fleet_home, publish_trainable

from fedge.aggregator.jobs.run_store import RunStore
from fedge.aggregator.superlink.link import SuperLink
from fedge.edge_agent.config.privacy_budget import apply_budget
from fedge.edge_agent.training.supervisor import SupernodeSpec, SupernodeSupervisor
from fedge.federation import fleet_job
from fedge.federation.prepare import prepare
from fedge.party.budget import BudgetLedger
from fedge.party.privacy_status import LEDGER_FILE
from fedge.privacy import accounting
from fedge.privacy.settings import DpRelease, is_budget_exhausted
from fedge.protocols.app_signing import trusted_entities_yaml
from fedge.protocols.config import PrivacyBudget

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02")
EXHAUSTED = "st-02"
EARLIER = DpRelease(noise_multiplier=1.0, sample_rate=0.25, steps=8)
JOB = """
[job]
name = "dp-fleet"
rounds = 1

[task]
model = "inspect:1"
lr = 0.003
local_epochs = 1
batch_size = 8

[strategy]
kind = "fedavg"

[privacy]
mode = "local"
epsilon = 8.0
delta = 0.001

[federation]
backend = "fleet"
fleet = "plant-a"
edges = "all"
node_wait_s = 60.0
round_timeout_s = 120.0
eval_timeout_s = 120.0
"""


def history(data_dir: Path) -> list[DpRelease]:
    """Every release in a station's ledger, over all jobs."""
    ledger = BudgetLedger(data_dir / LEDGER_FILE)
    try:
        return ledger.history()
    finally:
        ledger.close()


def test_a_station_out_of_budget_refuses_and_the_round_completes_with_the_others(
    tmp_path: Path, supervisors: list[SupernodeSupervisor]
) -> None:
    fh = make_fleet_home(tmp_path, edges=EDGES)
    publish_trainable(fh, tmp_path, EDGES)
    for index, edge in enumerate(EDGES):
        keep_labelled_images(fh.data_dir(edge), seed=70 + index)
    # st-02 spent its lifetime budget in an earlier job; its operator's bound is exactly
    # that (written the way its agent writes a signed config's budget).
    spent_before = accounting.epsilon_spent([EARLIER], 1e-3)
    exhausted_dir = fh.data_dir(EXHAUSTED)
    apply_budget(exhausted_dir, PrivacyBudget(spent_before, 1e-3))
    ledger = BudgetLedger(exhausted_dir / LEDGER_FILE)
    try:
        ledger.record("an-earlier-job", 1, EARLIER)
    finally:
        ledger.close()

    superlink = SuperLink(tmp_path / "superlink", "127.0.0.1", fh.settings.superlink_port)
    superlink.start()
    try:
        for edge in EDGES:
            supervisor = SupernodeSupervisor(fh.data_dir(edge) / "supernode")
            supervisors.append(supervisor)
            supervisor.start()
            supervisor.apply(
                SupernodeSpec(
                    superlink.address,
                    edge,
                    fh.data_dir(edge),
                    20,
                    1,
                    60.0,
                    trusted_entities=trusted_entities_yaml(fh.home.signing_key().public),
                )
            )
        manifest = tmp_path / "job.toml"
        manifest.write_text(JOB, encoding="utf-8")
        job_dir = tmp_path / "job"
        prepare(manifest, job_dir, fh.home)
        fleet_job.submit(
            job_dir,
            superlink.local_address,
            signing=(fh.home.signing_key(), superlink.signed_apps),
        )
        result = fleet_job.wait(job_dir, timeout_s=150)
        assert result.state.value == "completed", result.error

        store = RunStore(job_dir / "runs.db")
        try:
            run_id = result.run_id
            (round_1,) = store.rounds(run_id)
            names = store.party_names(run_id)
            party_rounds = store.party_metrics(run_id)
            spent = store.privacy_spent(run_id)
        finally:
            store.close()
        party = {edge: p for p, edge in names.items()}
        # The exhausted station's reply is an error that names its budget...
        assert [names[p] for p in round_1["failed"]] == [EXHAUSTED], round_1
        reason = round_1["failures"][str(party[EXHAUSTED])]
        assert is_budget_exhausted(reason), reason
        assert "lifetime privacy budget exhausted" in reason
        # ...and the round completed with the others, which trained privately.
        assert [names[p] for p in round_1["on_time"]] == ["st-01"]
        assert {names[r["party"]] for r in party_rounds} == {"st-01"}
        assert {row["name"] for row in spent} == {"st-01"}
        for row in party_rounds:
            metrics = row["metrics"]
            own = history(fh.data_dir(names[row["party"]]))
            assert len(own) == 1  # this job's one round, in the station's own ledger
            assert metrics["dp-epsilon-job"] == pytest.approx(
                accounting.epsilon_spent(own, 1e-3), rel=1e-9
            )
            assert metrics["dp-steps"] == own[0].steps > 0
        # Nothing was added to the refusing station's ledger.
        assert history(exhausted_dir) == [EARLIER]
    except BaseException:
        for log in sorted(tmp_path.rglob("*.log")):
            print(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        superlink.stop()
        fh.close()
