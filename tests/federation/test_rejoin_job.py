"""A fleet job started while a station's SuperNode is re-activating waits for it (issue 27
item 5), with real processes: a real SuperLink behind the fleet's front (TLS, node
authentication), real ``flower-supernode`` processes run by the agent's supervisor, and a
real signed fleet job of one round.

One station's SuperNode is SIGKILLed (no DeactivateNode: Flower keeps its old node listed)
and the job is submitted before the supervisor's restart has re-activated it. The job's
grid asks the listed nodes who they are; the dead node cannot answer, is asked again when
listed anew, and the job waits up to its ``node_wait_s`` (aggregator/fleet/identity.py,
fleet/server.py): its only round trains on both stations.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import FleetHome, keep_labelled_images, make_fleet_home, publish_trainable, wait_until

from fedge.aggregator.jobs.run_store import RunStore
from fedge.aggregator.superlink.link import SuperLink, node_public_key
from fedge.edge_agent.training.causes import current_section
from fedge.edge_agent.training.supervisor import SupernodeSpec, SupernodeSupervisor, kill_tree
from fedge.federation import fleet_job
from fedge.federation.prepare import prepare
from fedge.protocols.app_signing import trusted_entities_yaml

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02")
JOB = """
[job]
name = "rejoin"
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
edges = ["st-01", "st-02"]
node_wait_s = 90.0
round_timeout_s = 90.0
eval_timeout_s = 90.0
"""


@dataclass
class Plant:
    fh: FleetHome
    link: SuperLink
    root: Path
    supervisors: dict[str, SupernodeSupervisor]
    specs: dict[str, SupernodeSpec]


@pytest.fixture(scope="module")
def plant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plant]:
    root = tmp_path_factory.mktemp("rejoin")
    fh = make_fleet_home(root, edges=EDGES)
    home = fh.home
    link = SuperLink(
        root / "superlink",
        "127.0.0.1",
        home.settings().superlink_port,
        tls=home.pki().server_files("superlink"),
    )
    link.start()
    supervisors = {edge: SupernodeSupervisor(fh.data_dir(edge) / "supernode") for edge in EDGES}
    specs: dict[str, SupernodeSpec] = {}
    try:
        publish_trainable(fh, root, EDGES)
        for seed, edge in enumerate(EDGES, start=91):
            files = fh.tls_files(edge)
            link.authorize(edge, node_public_key(files.cert.read_bytes()))
            keep_labelled_images(fh.data_dir(edge), seed=seed)
            specs[edge] = SupernodeSpec(
                link.address,
                edge,
                fh.data_dir(edge),
                20,
                1,
                60.0,
                root_certificates=files.ca,
                auth_key=files.key,
                trusted_entities=trusted_entities_yaml(home.signing_key().public),
            )
            supervisors[edge].start()
            supervisors[edge].apply(specs[edge])
        yield Plant(fh, link, root, supervisors, specs)
    finally:
        for supervisor in supervisors.values():
            supervisor.stop()
        link.stop()
        fh.close()


def section(supervisor: SupernodeSupervisor) -> str:
    return current_section(supervisor.log_file.read_text(errors="replace"))


def connected(supervisor: SupernodeSupervisor) -> bool:
    return "SuperNode ID:" in section(supervisor)


def dump_logs(plant: Plant) -> None:
    for log in sorted(plant.root.rglob("*.log")):
        print(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}")


def test_a_job_started_while_a_station_re_activates_trains_it_in_its_first_round(
    plant: Plant,
) -> None:
    st01, st02 = plant.supervisors["st-01"], plant.supervisors["st-02"]
    wait_until(lambda: connected(st01) and connected(st02), 60, "the first activations")
    pid = st02.status()["pid"]
    assert isinstance(pid, int)
    starts = st02.starts
    # SIGKILL: no DeactivateNode, so Flower still lists st-02's node. Its restart is held
    # back (no spec) until the job's ServerApp has begun asking its nodes who they are.
    kill_tree(pid)
    st02.apply(None)
    wait_until(lambda: not st02.status()["running"], 10, "st-02's SuperNode gone")
    job_dir = plant.root / "rejoin"
    manifest = plant.root / "rejoin.toml"
    manifest.write_text(JOB, encoding="utf-8")
    prepare(manifest, job_dir, plant.fh.home)
    try:
        fleet_job.submit(
            job_dir,
            plant.link.local_address,
            root_certificates=plant.fh.home.pki().ca_path,
            signing=(plant.fh.home.signing_key(), plant.link.signed_apps),
        )
        # The job runs and has asked st-01 who it is: st-02 is down meanwhile.
        wait_until(lambda: "Receiving: query message" in section(st01), 90, "the job's query")
        assert st02.starts == starts and not st02.status()["running"]
        st02.apply(plant.specs["st-02"])  # the restart, while the job waits for it
        result = fleet_job.wait(job_dir, timeout_s=240)
        assert result.state.value == "completed", result.error
        store = RunStore(job_dir / "runs.db")
        try:
            rounds = store.rounds(result.run_id)
        finally:
            store.close()
        assert len(rounds) == 1, rounds
        # Both stations (shown as 1000 + their index in the job) trained in round 1.
        assert sorted(rounds[0]["on_time"]) == [1000, 1001], rounds[0]
        assert st02.starts > starts  # st-02 did restart, and took part after it
    except BaseException:
        dump_logs(plant)
        raise
