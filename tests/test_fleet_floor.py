"""A station's own privacy floor holds against the server, with real processes (issue 24).

The fleet's SuperLink, two ``flower-supernode`` processes started by the agent's own
supervisor on stations' data directories (each running the station's ClientApp), and
fedge's fleet ServerApp submitted signed with ``flwr run``. st-01's operator opted out of a
floor; st-02 has the default floor (as its agent writes it from agent.toml at start).

1. A job without DP-SGD (``mode = none``) across both: st-02's train reply is an error
   naming its floor, its ledger records no training, and the round completes with st-01.
2. The same job on st-02 alone: no station trained, so the job ends FAILED saying why,
   and nothing is published.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import keep_labelled_images, make_fleet_home, publish_trainable

from fedge.aggregator.jobs.directory import JobError
from fedge.aggregator.jobs.run_store import RunStore
from fedge.aggregator.superlink.link import SuperLink
from fedge.edge_agent.config.privacy_budget import write_floor
from fedge.edge_agent.training.supervisor import SupernodeSpec, SupernodeSupervisor
from fedge.federation import fleet_job
from fedge.federation.prepare import prepare
from fedge.federation.publish import publish
from fedge.party.budget import BudgetLedger
from fedge.party.privacy_status import LEDGER_FILE
from fedge.privacy.floor import default_floor
from fedge.protocols.app_signing import trusted_entities_yaml

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02")
FLOORED = "st-02"
JOB = """
[job]
name = "no-dp"
rounds = 1

[task]
model = "inspect:1"
lr = 0.003
local_epochs = 1
batch_size = 8

[strategy]
kind = "fedavg"

[federation]
backend = "fleet"
fleet = "plant-a"
edges = {edges}
node_wait_s = 60.0
round_timeout_s = 120.0
eval_timeout_s = 120.0
"""


def trained_releases(data_dir: Path) -> int:
    ledger = BudgetLedger(data_dir / LEDGER_FILE)
    try:
        return len(ledger.history())
    finally:
        ledger.close()


@pytest.mark.timeout(720)
def test_a_job_below_a_stations_floor_is_refused_there_and_fails_where_nobody_trained(
    tmp_path: Path, supervisors: list[SupernodeSupervisor]
) -> None:
    fh = make_fleet_home(tmp_path, edges=EDGES)
    publish_trainable(fh, tmp_path, EDGES)
    for index, edge in enumerate(EDGES):
        keep_labelled_images(fh.data_dir(edge), seed=90 + index)
    write_floor(fh.data_dir("st-01"), None)  # its operator opted out
    write_floor(fh.data_dir(FLOORED), default_floor(5000))  # the default floor
    with fh.fleet() as fleet:
        versions_before = [m.ref for m in fleet.registry.list()]

    superlink = SuperLink(tmp_path / "superlink", "127.0.0.1", fh.settings.superlink_port)
    superlink.start()
    try:
        for edge in EDGES:
            supervisor = SupernodeSupervisor(fh.data_dir(edge) / "supernode")
            supervisors.append(supervisor)
            supervisor.start()
            supervisor.apply(
                SupernodeSpec(
                    superlink.address, edge, fh.data_dir(edge), 20, 1, 60.0,
                    trusted_entities=trusted_entities_yaml(fh.home.signing_key().public),
                )
            )  # fmt: skip

        def run(name: str, edges: str) -> tuple[Path, fleet_job.FleetJobResult]:
            manifest = tmp_path / f"{name}.toml"
            manifest.write_text(JOB.format(edges=edges), encoding="utf-8")
            job_dir = tmp_path / name
            prepare(manifest, job_dir, fh.home)
            fleet_job.submit(
                job_dir,
                superlink.local_address,
                signing=(fh.home.signing_key(), superlink.signed_apps),
            )
            # Sized for a loaded host: `make test` runs this beside other workers' tests.
            return job_dir, fleet_job.wait(job_dir, timeout_s=280)

        # 1. Both stations: the floored one refuses, the round completes with the other.
        job_dir, result = run("both", '"all"')
        assert result.state.value == "completed", result.error
        store = RunStore(job_dir / "runs.db")
        try:
            (round_1,) = store.rounds(result.run_id)
            names = store.party_names(result.run_id)
            trained = {names[r["party"]] for r in store.party_metrics(result.run_id)}
        finally:
            store.close()
        party = {edge: p for p, edge in names.items()}
        assert [names[p] for p in round_1["failed"]] == [FLOORED], round_1
        reason = round_1["failures"][str(party[FLOORED])]
        assert "PrivacyFloorError" in reason and "the station's privacy floor" in reason
        assert "dp-mode 'none'" in reason
        assert trained == {"st-01"}
        assert trained_releases(fh.data_dir(FLOORED)) == 0  # nothing trained there

        # 2. The floored station alone: nobody trained; the job fails, nothing published.
        job_dir, result = run("alone", f'["{FLOORED}"]')
        assert result.state.value == "failed", result
        assert "no station trained" in result.error and FLOORED in result.error
        assert "privacy floor" in result.error
        with pytest.raises(JobError, match="has not completed"):
            publish(job_dir, fh.home)
        assert trained_releases(fh.data_dir(FLOORED)) == 0
        with fh.fleet() as fleet:
            assert [m.ref for m in fleet.registry.list()] == versions_before
    except BaseException:
        for log in sorted(tmp_path.rglob("*.log")):
            print(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        superlink.stop()
        fh.close()
