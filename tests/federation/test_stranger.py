"""A stranger on the plant network against the fleet's SuperLink (issue 24), real processes.

The manager host serves the SuperLink's front on a link to a second network namespace,
the "stranger's host", which holds only that link and the fleet CA certificate (public:
the enrollment endpoint serves it to anyone). Before this issue such a host could submit a
run whose ClientApp then ran on every station with the station's data readable. Shown:

- from the stranger's host, ``flwr run`` of an app whose code would write a canary file
  is refused by the front (404), no run exists afterwards and the canary never appears;
- ``flwr supernode register`` / ``unregister`` from there are refused and change no key;
- the SuperLink's own port (Control API) is not reachable from there at all;
- a station's SuperNode (started by the agent's supervisor, trusting the manager key)
  refuses an app submitted unsigned, or signed by a key other than the fleet's, before
  any of its code runs: the canary never appears, the refusal reaches the run store, and
  the same station then trains the next, signed job.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import (
    FleetHome,
    StrangerHost,
    free_port,
    keep_labelled_images,
    publish_trainable,
    stranger_host,
    wait_until,
)

from fedge.aggregator.jobs.run_store import RunStore
from fedge.aggregator.superlink.address import connection_toml
from fedge.aggregator.superlink.link import SuperLink, node_public_key
from fedge.edge_agent.training.supervisor import SupernodeSpec, SupernodeSupervisor
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.federation import fleet_job
from fedge.federation.prepare import APP_DIR, prepare
from fedge.protocols.app_signing import sign_fab, trusted_entities_yaml
from fedge.protocols.signing import SigningKey

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
JOB = """
[job]
name = "{name}"
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
node_wait_s = 30.0
round_timeout_s = 60.0
eval_timeout_s = 60.0
"""
CANARY_APP = """
from pathlib import Path

Path({canary!r}).write_text("the stranger's code ran here")  # at import: on the station

from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg, context):
    Path({canary!r}).write_text(str(context.node_config))
    raise RuntimeError("canary")


@app.query()
def query(msg, context):
    Path({canary!r}).write_text(str(context.node_config))
    raise RuntimeError("canary")
"""


@dataclass
class Plant:
    fh: FleetHome
    link: SuperLink
    stranger: StrangerHost
    root: Path
    supervisor: SupernodeSupervisor


@pytest.fixture(scope="module")
def plant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plant]:
    root = tmp_path_factory.mktemp("stranger")
    with stranger_host() as stranger:
        home = ManagerHome(root / "home")
        home.init(
            ManagerSettings(
                "plant-a",
                broker_port=free_port(),
                grpc_port=free_port(),
                superlink_host=stranger.host_ip,  # the front listens on the plant network
                superlink_port=free_port(),
                enroll_port=free_port(),
            )
        )
        fh = FleetHome(root, home)
        fh.enroll("st-01")
        tls = home.pki().server_files("superlink")
        link = SuperLink(
            root / "superlink", stranger.host_ip, home.settings().superlink_port, tls=tls
        )
        link.start()
        files = fh.tls_files("st-01")
        link.authorize("st-01", node_public_key(files.cert.read_bytes()))
        supervisor = SupernodeSupervisor(fh.data_dir("st-01") / "supernode")
        plant = Plant(fh, link, stranger, root, supervisor)
        try:
            publish_trainable(fh, root, ("st-01",))
            keep_labelled_images(fh.data_dir("st-01"), seed=81)
            supervisor.start()
            supervisor.apply(
                SupernodeSpec(
                    link.address,
                    "st-01",
                    fh.data_dir("st-01"),
                    20,
                    1,
                    60.0,
                    root_certificates=files.ca,
                    auth_key=files.key,
                    trusted_entities=trusted_entities_yaml(home.signing_key().public),
                )
            )
            yield plant
        finally:
            supervisor.stop()
            link.stop()
            fh.close()


def dump_logs(plant: Plant) -> None:
    for log in sorted(plant.root.rglob("*.log")):
        print(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}")


def canary_app(plant: Plant, name: str) -> tuple[Path, Path]:
    """An app whose ClientApp writes a canary file when any of its code runs."""
    canary = plant.root / f"{name}.canary"
    app = plant.root / name
    app.mkdir()
    (app / "canary_app.py").write_text(CANARY_APP.format(canary=str(canary)))
    (app / "pyproject.toml").write_text(
        "\n".join(
            [
                "[build-system]",
                'requires = ["hatchling"]',
                'build-backend = "hatchling.build"',
                "[project]",
                f'name = "{name}"',
                'version = "1.0.0"',
                'license = "Apache-2.0"',
                "dependencies = []",
                "[tool.flwr.app]",
                'publisher = "stranger"',
                "[tool.flwr.app.components]",
                'serverapp = "canary_app:app"',
                'clientapp = "canary_app:app"',
                "",
            ]
        )
    )
    return app, canary


def stranger_flwr(plant: Plant, *args: str, address: str = "") -> subprocess.CompletedProcess[str]:
    """``flwr ARGS stranger`` run on the stranger's host, against the front (or
    ``address``), trusting the fleet CA it fetched."""
    flwr_home = plant.root / f"stranger-flwr-{len(list(plant.root.glob('stranger-flwr-*')))}"
    flwr_home.mkdir()
    (flwr_home / "config.toml").write_text(
        connection_toml("stranger", address or plant.link.address, plant.fh.home.pki().ca_path)
    )
    env = {**os.environ, "FLWR_HOME": str(flwr_home), "FLWR_TELEMETRY_ENABLED": "0"}
    return plant.stranger.run([str(BIN / "flwr"), *args], env=env, timeout_s=90)


def local_runs(plant: Plant) -> list[object]:
    """The SuperLink's runs, as the manager host's ``flwr ls`` lists them."""
    flwr_home = plant.root / "manager-flwr"
    flwr_home.mkdir(exist_ok=True)
    (flwr_home / "config.toml").write_text(
        connection_toml("local", plant.link.local_address, plant.fh.home.pki().ca_path)
    )
    env = {**os.environ, "FLWR_HOME": str(flwr_home), "FLWR_TELEMETRY_ENABLED": "0"}
    done = subprocess.run(
        [str(BIN / "flwr"), "ls", "local", "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    answer = json.loads(done.stdout[done.stdout.index("{") :])
    assert answer.get("success"), done.stdout + done.stderr
    runs: list[object] = answer.get("runs", [])
    return runs


def test_a_stranger_cannot_submit_a_run(plant: Plant) -> None:
    app, canary = canary_app(plant, "stranger-run")
    before = plant.link.front.counters["refused.not_fleet_api"] if plant.link.front else 0
    done = stranger_flwr(plant, "run", str(app), "stranger", "--format", "json")
    try:
        assert done.returncode != 0 or '"success": false' in done.stdout, done.stdout
        assert plant.link.front is not None
        assert plant.link.front.counters["refused.not_fleet_api"] > before
        assert local_runs(plant) == []
        assert not canary.exists()
    except BaseException:
        print(done.stdout, done.stderr)
        dump_logs(plant)
        raise


def test_a_stranger_cannot_register_or_unregister_supernode_keys(plant: Plant) -> None:
    wanted = dict(plant.link.authorized())
    nodes = plant.link.nodes()
    key = plant.root / "stranger.pub"
    key.write_text(node_public_key(plant.fh.tls_files("st-01").cert.read_bytes()) + "\n")
    # A fresh P-256 key of the stranger's own, as `flwr supernode register` takes it.
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    own = ec.generate_private_key(ec.SECP256R1()).public_key()
    key.write_bytes(
        own.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    registered = stranger_flwr(plant, "supernode", "register", str(key), "stranger")
    node_id = str(plant.link.authorized()["st-01"].node_id)
    unregistered = stranger_flwr(plant, "supernode", "unregister", node_id, "stranger")
    listed = stranger_flwr(plant, "supernode", "ls", "stranger", "--format", "json")
    try:
        for done in (registered, unregistered, listed):
            assert done.returncode != 0 or '"success": false' in done.stdout, done.stdout
        assert plant.link.authorized() == wanted
        assert [n["node-id"] for n in plant.link.nodes()] == [n["node-id"] for n in nodes]
    except BaseException:
        for done in (registered, unregistered, listed):
            print(done.stdout, done.stderr)
        raise


def test_the_superlink_itself_is_not_reachable_from_the_plant_network(plant: Plant) -> None:
    port = plant.link.control_port
    probe = (
        "import socket,sys\n"
        "s=socket.socket(); s.settimeout(3)\n"
        f"sys.exit(s.connect_ex(({plant.stranger.host_ip!r}, {port})))\n"
    )
    done = plant.stranger.run([sys.executable, "-c", probe])
    assert done.returncode != 0, "the Control API's port answered the stranger's host"
    # ...while this host reaches it on loopback, and the front from the plant network.
    with socket.create_connection(("127.0.0.1", port), timeout=3):
        pass
    front = (
        "import socket,sys\n"
        "s=socket.socket(); s.settimeout(3)\n"
        f"sys.exit(s.connect_ex(({plant.stranger.host_ip!r}, {plant.link.port})))\n"
    )
    assert plant.stranger.run([sys.executable, "-c", front]).returncode == 0


def submit_refused_app(plant: Plant, name: str, signer: SigningKey | None) -> None:
    """A fleet job whose app's ClientApp is the canary, submitted on the manager host
    unsigned (``signer`` None) or signed by ``signer``; the station must refuse it."""
    manifest = plant.root / f"{name}.toml"
    manifest.write_text(JOB.format(name=name), encoding="utf-8")
    job_dir = plant.root / name
    prepare(manifest, job_dir, plant.fh.home)
    _, canary = canary_app(plant, f"{name}-code")
    shutil.copy(plant.root / f"{name}-code" / "canary_app.py", job_dir / APP_DIR)
    pyproject = job_dir / APP_DIR / "pyproject.toml"
    text = pyproject.read_text()
    pyproject.write_text(text.replace("fedge.party.station_app:app", "canary_app:app"))
    if signer is not None:
        from flwr.cli.build import build_fab_from_disk

        plant.link.signed_apps.put(sign_fab(build_fab_from_disk(job_dir / APP_DIR), signer))
    fleet_job.submit(
        job_dir, plant.link.local_address, root_certificates=plant.fh.home.pki().ca_path
    )
    result = fleet_job.wait(job_dir, timeout_s=150)
    try:
        assert result.state.value != "completed", result
        store = RunStore(job_dir / "runs.db")
        try:
            rounds = store.rounds(result.run_id)
            run = store.run(result.run_id)
        finally:
            store.close()
        recorded = json.dumps([run, rounds], default=str)
        assert "verif" in recorded.lower() or "invalid_fab" in recorded.lower(), recorded
        assert not canary.exists(), canary.read_text()
        log = (plant.fh.data_dir("st-01") / "supernode" / "supernode.log").read_text()
        assert "FAB" in log and "verif" in log
    except BaseException:
        dump_logs(plant)
        raise


def test_a_station_refuses_an_unsigned_app_before_any_of_it_runs(plant: Plant) -> None:
    submit_refused_app(plant, "unsigned", None)


def test_a_station_refuses_an_app_signed_by_another_key(plant: Plant) -> None:
    submit_refused_app(plant, "foreign", SigningKey.generate())


IDLE_SOCKETS = """
import socket, sys, time
held = []
for _ in range(100):
    s = socket.socket()
    s.connect((sys.argv[1], int(sys.argv[2])))
    held.append(s)  # connected, silent: no TLS handshake, no request
print("holding", len(held), flush=True)
time.sleep(float(sys.argv[3]))
"""


def test_the_station_then_trains_the_fleets_signed_job_while_a_stranger_holds_sockets(
    plant: Plant,
) -> None:
    # A stranger holds 100 silent connections to the front for the whole job: the front
    # cuts them (handshake deadline) and serves the station all along.
    holder = subprocess.Popen(
        [
            "ip", "netns", "exec", plant.stranger.name, sys.executable, "-c", IDLE_SOCKETS,
            plant.link.host, str(plant.link.port), "120",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().startswith("holding 100")
        manifest = plant.root / "signed.toml"
        manifest.write_text(JOB.format(name="signed"), encoding="utf-8")
        job_dir = plant.root / "signed"
        prepare(manifest, job_dir, plant.fh.home)
        fleet_job.submit(
            job_dir,
            plant.link.local_address,
            root_certificates=plant.fh.home.pki().ca_path,
            signing=(plant.fh.home.signing_key(), plant.link.signed_apps),
        )
        result = fleet_job.wait(job_dir, timeout_s=150)
        assert result.state.value == "completed", result.error
        assert plant.link.front is not None and plant.link.front.counters["fab.signed"] >= 1
    except BaseException:
        dump_logs(plant)
        raise
    finally:
        holder.kill()
        holder.wait()
    wait_until(lambda: plant.supervisor.status()["running"], 10, "the SuperNode still running")
