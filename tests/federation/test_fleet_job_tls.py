"""The fleet's SuperLink over TLS with SuperNode authentication, with real processes.

One ``flower-superlink`` with the manager home's ``superlink`` certificate and
``--enable-supernode-auth``; stations' ``flower-supernode`` processes started by the
agent's own supervisor (:mod:`fedge.edge_agent.training.supervisor`) with the fleet CA and their
own P-256 key; fedge's fleet ServerApp submitted with ``flwr run`` trusting the fleet CA
(:func:`fedge.federation.fleet_job.submit`). Shown (issue 13):

- a station whose key the manager registered takes part in a one-round job over TLS;
- a SuperNode trusting another CA, or no CA (system roots), fails its TLS handshake; a
  plain one never gets an answer; one with an unregistered key, or none, is refused at
  activation -- and none of them becomes a node of the SuperLink;
- revoking a station unregisters its key: its running SuperNode is answered 401 and
  exits within seconds, a restarted one is refused, and the key cannot come back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from conftest import (
    FleetHome,
    free_port,
    keep_labelled_images,
    make_fleet_home,
    publish_trainable,
    wait_until,
)

from fedge.aggregator.jobs.run_store import RunStore
from fedge.aggregator.superlink.link import SuperLink, SuperLinkError, node_public_key
from fedge.edge_agent.training.supervisor import (
    SupernodeSpec,
    SupernodeSupervisor,
    openssh_private_key,
    supernode_command,
)
from fedge.federation import fleet_job
from fedge.federation.prepare import prepare
from fedge.protocols.app_signing import trusted_entities_yaml
from fedge.protocols.fleet_ca import FleetCA
from fedge.protocols.pki import write_private

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02", "st-03")  # st-01 trains; st-02 is never registered; st-03 is revoked
BIN = Path(sys.executable).parent
JOB = """
[job]
name = "tls-fleet"
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
edges = ["st-01"]
node_wait_s = 60.0
round_timeout_s = 120.0
eval_timeout_s = 120.0
"""


@dataclass
class Fleet:
    fh: FleetHome
    link: SuperLink
    root: Path
    supervisors: list[SupernodeSupervisor]

    def spec(self, edge: str) -> SupernodeSpec:
        files = self.fh.tls_files(edge)
        return SupernodeSpec(
            self.link.address, edge, self.fh.data_dir(edge), 20, 1, 60.0,
            root_certificates=files.ca, auth_key=files.key,
            trusted_entities=trusted_entities_yaml(self.fh.home.signing_key().public),
        )  # fmt: skip

    def supervise(self, edge: str) -> SupernodeSupervisor:
        supervisor = SupernodeSupervisor(self.fh.data_dir(edge) / "supernode")
        self.supervisors.append(supervisor)
        supervisor.start()
        supervisor.apply(self.spec(edge))
        return supervisor

    def dump_logs(self) -> None:
        for log in sorted(self.root.rglob("*.log")):
            print(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("tls-fleet")
    fh = make_fleet_home(root, edges=EDGES)  # mutual TLS: the fleet CA in the home
    assert not fh.settings.insecure
    tls = fh.home.pki().server_files("superlink")
    link = SuperLink(root / "superlink", "127.0.0.1", fh.settings.superlink_port, tls=tls)
    state = Fleet(fh, link, root, [])
    link.start()
    try:
        yield state
    finally:
        for supervisor in state.supervisors:
            supervisor.stop()
        link.stop()
        fh.close()


def online(link: SuperLink, node_id: int) -> bool:
    return any(int(n["node-id"]) == node_id and n["status"] == "online" for n in link.nodes())


def test_a_registered_station_trains_a_round_over_tls(fleet: Fleet, tmp_path: Path) -> None:
    fh, link = fleet.fh, fleet.link
    publish_trainable(fh, tmp_path, ("st-01",))
    keep_labelled_images(fh.data_dir("st-01"), seed=80)
    node = link.authorize("st-01", node_public_key(fh.tls_files("st-01").cert.read_bytes()))
    assert link.authorize("st-01", node.public_key) == node  # idempotent
    fleet.supervise("st-01")
    try:
        manifest = tmp_path / "job.toml"
        manifest.write_text(JOB, encoding="utf-8")
        job_dir = tmp_path / "job"
        prepare(manifest, job_dir, fh.home)
        ca = fleet_job.superlink_root_certificates(fh.home)
        assert ca == fh.home.pki().ca_path
        fleet_job.submit(
            job_dir,
            link.local_address,
            root_certificates=ca,
            signing=(fh.home.signing_key(), link.signed_apps),
        )
        assert "root-certificates" in (job_dir / "flwr-cli" / "config.toml").read_text()
        result = fleet_job.wait(job_dir, timeout_s=150)
        assert result.state.value == "completed", result.error
        store = RunStore(job_dir / "runs.db")
        try:
            (round_1,) = store.rounds(result.run_id)
            names = store.party_names(result.run_id)
        finally:
            store.close()
        assert [names[p] for p in round_1["on_time"]] == ["st-01"], round_1
        assert online(link, node.node_id)
    except BaseException:
        fleet.dump_logs()
        raise


def run_refused(
    fleet: Fleet, name: str, spec: SupernodeSpec, key: Path | None, *extra: str
) -> subprocess.Popen[bytes]:
    """A ``flower-supernode`` built by the agent's own command builder (plus ``extra``)."""
    workdir = fleet.root / "refused" / name
    workdir.mkdir(parents=True)
    (workdir / "node.toml").write_text('"edge" = "x"\n', encoding="utf-8")
    entities = _entities_file(workdir, spec)
    command = [
        *supernode_command(spec, BIN, free_port(), workdir / "node.toml", key, entities),
        *extra,
    ]
    return start_logged(workdir, command)


def _entities_file(workdir: Path, spec: SupernodeSpec) -> Path | None:
    """The spec's trusted entities written where its command names them (as the agent's
    supervisor does), or None for a spec without them."""
    if spec.trusted_entities is None:
        return None
    path = workdir / "trusted-entities.yaml"
    path.write_text(spec.trusted_entities, encoding="utf-8")
    return path


def start_logged(workdir: Path, command: list[str]) -> subprocess.Popen[bytes]:
    # PATH: the SuperNode starts Flower's SuperExec by name, as the supervisor lets it.
    env = {
        **os.environ,
        "FLWR_HOME": str(workdir),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
    }
    with open(workdir / "supernode.log", "wb") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def test_supernodes_without_the_fleet_ca_or_a_registered_key_are_refused(fleet: Fleet) -> None:
    fh, link, root = fleet.fh, fleet.link, fleet.root
    st01 = fleet.spec("st-01")  # a registered key (the first test registered it, or now)
    link.authorize("st-01", node_public_key(fh.tls_files("st-01").cert.read_bytes()))
    st01_key = root / "st-01.ssh"
    write_private(st01_key, openssh_private_key(fh.tls_files("st-01").key.read_bytes()))
    other_ca = root / "other-ca.crt"
    other_ca.write_bytes(FleetCA.create("plant-b").cert_pem)
    st02 = fleet.spec("st-02")  # enrolled, certificate from the fleet CA, never registered
    st02_key = root / "st-02.ssh"
    write_private(st02_key, openssh_private_key(fh.tls_files("st-02").key.read_bytes()))
    before = {int(n["node-id"]) for n in link.nodes()}

    def system_roots(command: list[str]) -> list[str]:
        at = command.index("--root-certificates")
        return command[:at] + command[at + 2 :]

    procs = {
        "other-ca": run_refused(
            fleet, "other-ca", replace(st01, root_certificates=other_ca),
            st01_key,
        ),
        "unregistered": run_refused(fleet, "unregistered", st02, st02_key),
        "no-key": run_refused(
            fleet, "no-key", replace(st01, auth_key=None), None
        ),
        "plain": run_refused(
            fleet, "plain",
            replace(st01, root_certificates=None, auth_key=None), None,
            "--max-wait-time", "6",
        ),
    }  # fmt: skip
    # No CA at all: the same command with the fleet CA taken out (the system's roots).
    no_ca_dir = root / "refused" / "no-ca"
    no_ca_dir.mkdir(parents=True)
    (no_ca_dir / "node.toml").write_text('"edge" = "x"\n', encoding="utf-8")
    procs["no-ca"] = start_logged(
        no_ca_dir,
        system_roots(
            supernode_command(
                st01,
                BIN,
                free_port(),
                no_ca_dir / "node.toml",
                st01_key,
                _entities_file(no_ca_dir, st01),
            )
        ),
    )
    try:
        codes = {name: proc.wait(timeout=60) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    logs = {
        name: (root / "refused" / name / "supernode.log").read_text(errors="replace")
        for name in procs
    }
    try:
        # Each exits 1 with Flower's code 305: "could not establish a connection to the
        # SuperLink".
        assert codes == dict.fromkeys(procs, 1), codes
        assert all("Exit Code: 305" in text for text in logs.values()), logs
        for name in ("other-ca", "no-ca"):
            assert "CERTIFICATE_VERIFY_FAILED" in logs[name], logs[name]
        assert "[code: 2004] Failed to activate SuperNode" in logs["unregistered"]
        assert "All SuperNodes must be registered" in logs["no-key"]
        assert "Giving up reconnection" in logs["plain"]
        assert not any("SuperNode ID:" in text for text in logs.values())
        # The SuperLink saw the unregistered key and refused it; no node was added.
        assert "No SuperNode found with the given public key" in link.log_path.read_text()
        assert {int(n["node-id"]) for n in link.nodes()} == before
        assert set(link.authorized()) >= {"st-01"} and "st-02" not in link.authorized()
    except BaseException:
        print(codes)
        fleet.dump_logs()
        raise


def test_a_revoked_station_is_dropped_and_refused_afterwards(fleet: Fleet) -> None:
    fh, link = fleet.fh, fleet.link
    node = link.authorize("st-03", node_public_key(fh.tls_files("st-03").cert.read_bytes()))
    supervisor = fleet.supervise("st-03")
    try:
        wait_until(lambda: online(link, node.node_id), 60, "st-03's SuperNode online")
        running = supervisor.status()["pid"]
        # The station's key, re-encoded for Flower, sits beside the supervisor's state 0600.
        copy = fh.data_dir("st-03") / "supernode" / "node-auth.key"
        assert copy.stat().st_mode & 0o777 == 0o600
        assert link.revoke("st-03") == node
        assert "st-03" not in link.authorized()
        # Its next request is answered 401: the running SuperNode exits...
        wait_until(
            lambda: supervisor.status()["pid"] != running, 30, "the revoked SuperNode to exit"
        )
        # ...and the supervisor's restart is refused at activation, naming why (issue 27).
        wait_until(
            lambda: "does not know this station's key" in str(supervisor.status()["last_error"]),
            60,
            "the restarted SuperNode to be refused",
        )
        assert not online(link, node.node_id)
        log = (fh.data_dir("st-03") / "supernode" / "supernode.log").read_text(errors="replace")
        assert "[code: 2004] Failed to activate SuperNode" in log
        # A revoked key never comes back on this SuperLink.
        with pytest.raises(SuperLinkError, match="Public key already in use"):
            link.authorize("st-03", node.public_key)
        assert link.revoke("st-03") is None
    except BaseException:
        fleet.dump_logs()
        raise
    finally:
        supervisor.apply(None)
