"""Shared test plumbing: ONNX models, manager homes, ``fedge`` subprocesses, polling.

Helpers are plain functions (import them with ``from conftest import ...``); fixtures wrap
them with teardown. Nothing here sleeps to wait for a state: :func:`wait_until` polls.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import paho.mqtt.client as paho
import pytest
from flwr.app import Message
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from PIL import Image

from fedge.edge_agent.settings import AgentSettings, load_settings
from fedge.edge_agent.training.supervisor import SupernodeSupervisor
from fedge.edge_manager.fleet.operations import Fleet, opened
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.edge_manager.registry.versions import PublishedModel, Registry
from fedge.edge_manager.security.enrollment import enroll, managed_broker
from fedge.edge_manager.store import Store
from fedge.models.tiny_onnx import build_broken_model, build_linear_classifier
from fedge.protocols.pki import TlsFiles
from fedge.protocols.signing import SigningKey
from fedge.sim.grid import InProcessGrid
from fedge.transport.broker import MosquittoBroker
from fedge.transport.ports import free_port as free_port  # tests import it from here

# Test modules import the helpers below with ``from conftest import ...``. Under
# ``--import-mode=importlib`` pytest loads this file under a package-style name and puts
# no test directory on sys.path, so register the plain name for this very module (one
# copy of every helper and class, whatever the import mode).
sys.modules.setdefault("conftest", sys.modules[__name__])

# pytest-xdist gives its workers COLUMNS=80, and rich fixes a console's width from COLUMNS
# when the console is made (fedge.cli.common's, at import): the tests that hand the CLI a
# wider terminal through CliRunner's env would get 80 columns under `make test` only.
os.environ.pop("COLUMNS", None)

T = TypeVar("T")

FEDGE = Path(sys.executable).parent / "fedge"
FLEET = "plant-a"
EDGES = ("st-01", "st-02")
POLL_S = 0.05


# ---------------------------------------------------------------- environment


@pytest.fixture(scope="session", autouse=True)
def _flower_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No Flower telemetry, and a throw-away FLWR_HOME, for this process and its children."""
    saved = {key: os.environ.get(key) for key in ("FLWR_TELEMETRY_ENABLED", "FLWR_HOME")}
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    os.environ["FLWR_HOME"] = str(tmp_path_factory.mktemp("flwr-home"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# ---------------------------------------------------------------- test tiers
# `make unit` runs what is marked neither `integration` (a process, a server on a socket,
# Chromium) nor `slow` (training or other work over about a second); `make test` runs all
# (issue 26). A test asking for one of these fixtures starts processes through it.
PROCESS_FIXTURES = frozenset({"processes", "supervisors"})
TIER_MARKS = ("integration", "slow")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        # Tests sharing a module-scoped fixture were written to run in order in one
        # process (a later one may read what an earlier one left: the alerts an operator
        # received). Under `make test`'s workers (--dist loadgroup) they stay together on
        # one worker, which also builds the fixture once instead of once per worker.
        if not any(item.iter_markers("xdist_group")) and _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(f"module:{item.nodeid.split('::')[0]}"))


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test outside both tiers that starts a process (in its fixtures too) fails, naming
    the command: the fast tier stays fast and says what it is. The process still runs, so
    the test's own outcome is unchanged; the failure comes at teardown."""
    if any(request.node.get_closest_marker(mark) for mark in TIER_MARKS):
        yield
        return
    started: list[str] = []
    original = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def recorded(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> Any:
        started.append(" ".join(map(str, args)) if isinstance(args, list | tuple) else str(args))
        return original(self, args, *rest, **kwargs)

    subprocess.Popen._execute_child = recorded  # type: ignore[attr-defined]
    try:
        yield
    finally:
        subprocess.Popen._execute_child = original  # type: ignore[attr-defined]
    if started:
        pytest.fail(
            f"this test started {len(started)} process(es) ({started[0][:120]}): mark it "
            "@pytest.mark.integration (or move the process into an integration test)"
        )


# ---------------------------------------------------------------- small helpers
# A 2x2 grey PNG as base64: what a thumbnail record carries (a real, checked PNG).
PNG_2X2 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAAAAABX3VL4"
    "AAAADklEQVR4nGNsYGBiYAAAApIAhPd8o1gAAAAASUVORK5CYII="
)


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    expect: Callable[[T], bool] | None = None,
) -> T:
    """Poll ``predicate`` every 50 ms until it holds; return its last value.

    Without ``expect`` the predicate holds when it returns something truthy; with it,
    the predicate returns an observation and ``expect(observation)`` decides. On timeout
    the test fails naming ``what`` and the last value observed (an exception raised by the
    predicate counts as an observation, so a locked database or a file that is not there
    yet is simply retried).
    """
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            value = predicate()
        except Exception as exc:
            last = exc
        else:
            holds = expect(value) if expect is not None else value
            if holds is NotImplemented:  # e.g. Counter.__eq__(dict): a broken expectation
                raise TypeError(f"expectation for {what} returned NotImplemented")
            if holds:
                return value
            last = value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}; last observed: {last!r}")
        time.sleep(POLL_S)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def http_json(url: str, timeout_s: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def agent_status(port: int) -> dict[str, Any]:
    """The agent's ``GET /v1/status`` on its local API."""
    status: dict[str, Any] = http_json(f"http://127.0.0.1:{port}/v1/status")
    return status


# ---------------------------------------------------------------- ONNX models and images


def build_onnx_model(
    path: Path, *, n_outputs: int = 2, seed: int = 0, broken: bool = False
) -> Path:
    """Flatten -> Gemm -> Softmax on ``image`` float32 [batch,1,32,32] -> ``probs``.

    ``n_outputs`` sets the width of ``probs`` (declare fewer classes to fail a smoke
    test); ``broken`` gives a model that loads but fails on every run.
    """
    if broken:
        return build_broken_model(path, n_classes=n_outputs)
    return build_linear_classifier(path, n_classes=n_outputs, seed=seed)


@pytest.fixture
def onnx_model(tmp_path: Path) -> Path:
    return build_onnx_model(tmp_path / "model.onnx")


def write_images(directory: Path, names: Iterable[str], seed: int = 0) -> list[Path]:
    """Small random grayscale PNGs, written where the agent is not looking."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for name in names:
        pixels = (rng.random((32, 32)) * 255).astype(np.uint8)
        path = directory / name
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def stage_images(inbox: Path, prefix: str, count: int, seed: int = 0) -> list[Path]:
    """``count`` PNGs named ``PREFIX-NNNN.png``, staged beside ``inbox`` (same file system)."""
    names = [f"{prefix}-{i:04d}.png" for i in range(count)]
    return write_images(inbox.parent / f".staging-{prefix}", names, seed)


def drop_images(inbox: Path, prefix: str, count: int, seed: int = 0) -> list[str]:
    """Write ``count`` PNGs and move each into ``inbox`` atomically; return their names."""
    staged = stage_images(inbox, prefix, count, seed)
    inbox.mkdir(parents=True, exist_ok=True)
    for path in staged:
        os.replace(path, inbox / path.name)
    return [path.name for path in staged]


class Feeder(threading.Thread):
    """Moves staged images into an inbox a few at a time, like a camera that keeps going."""

    def __init__(self, staged: list[Path], inbox: Path, *, chunk: int, every_s: float) -> None:
        super().__init__(name=f"feeder-{inbox.parent.parent.name}", daemon=True)
        self.staged = staged
        self.inbox = inbox
        self.chunk = chunk
        self.every_s = every_s
        self.fed = 0
        self.halt = threading.Event()

    def run(self) -> None:
        self.inbox.mkdir(parents=True, exist_ok=True)
        for start in range(0, len(self.staged), self.chunk):
            for path in self.staged[start : start + self.chunk]:
                os.replace(path, self.inbox / path.name)
                self.fed += 1
            if self.halt.wait(self.every_s):  # pacing the camera, not waiting for a state
                return


def done_count(inbox: Path, prefix: str) -> int:
    """Images of ``prefix`` the watcher has finished with (scored or skipped)."""
    return len(list((inbox / "done").glob(f"{prefix}-*.png")))


# ---------------------------------------------------------------- manager homes


@dataclass
class FleetHome:
    """A manager home plus the agent.toml of every enrolled edge."""

    root: Path
    home: ManagerHome
    agents: dict[str, Path] = field(default_factory=dict)
    _db: Store | None = None

    @property
    def settings(self) -> ManagerSettings:
        return self.home.settings()

    def agent_settings(self, edge: str) -> AgentSettings:
        return load_settings(self.agents[edge])

    def data_dir(self, edge: str) -> Path:
        return self.agent_settings(edge).data_dir

    def inbox(self, edge: str) -> Path:
        watch_dir = self.agent_settings(edge).watch_dir
        assert watch_dir is not None
        return watch_dir

    def enroll(self, edge: str, *, privacy_floor: bool = True) -> Path:
        """Enrol ``edge`` with the default privacy floor, or (False) opted out of one."""
        out = self.root / edge / "agent.toml"
        out.parent.mkdir(parents=True, exist_ok=True)
        with self.fleet() as fleet:
            text = enroll(
                self.home,
                fleet,
                edge,
                (out.parent / "data").resolve(),
                privacy_floor=privacy_floor,
            )
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        self.agents[edge] = out
        return out

    def tls_files(self, identity: str) -> TlsFiles:
        """The certificate ``identity`` connects with: an edge's (beside its agent.toml),
        the manager's, or an operator's (kept in the home)."""
        if identity in self.agents:
            files = self.agent_settings(identity).tls()
            assert files is not None
            return files
        if identity == self.settings.manager_user:
            return self.home.pki().manager_files()
        return self.home.pki().client_files(identity)

    def client(self, port: int, identity: str, client_id: str = "") -> RawClient:
        """A bare MQTT client connected as ``identity`` the way this home authenticates:
        its certificate (mutual TLS), or in an --insecure home its password."""
        if not self.settings.insecure:
            return RawClient(port, "", "", client_id or identity, tls=self.tls_files(identity))
        passwords = {
            self.settings.manager_user: self.home.manager_password(),
            **self.home.edge_passwords(),
            **{n: str(a["password"]) for n, a in self.home.operator_accounts().items()},
        }
        return RawClient(port, identity, passwords[identity], client_id)

    def set_agent_option(self, edge: str, key: str, value: int | float) -> None:
        """Change (or add) one scalar setting in the edge's agent.toml."""
        path = self.agents[edge]
        lines = [ln for ln in path.read_text().splitlines() if not ln.startswith(f"{key} =")]
        # Before the first table ([privacy_floor]), or the key would land inside it.
        tables = [i for i, ln in enumerate(lines) if ln.startswith("[")]
        at = tables[0] if tables else len(lines)
        path.write_text("\n".join([*lines[:at], f"{key} = {value}", *lines[at:], ""]))

    @contextmanager
    def fleet(self) -> Iterator[Fleet]:
        """The operator's library view (a fresh store connection, closed afterwards)."""
        with opened(self.home) as fleet:
            yield fleet

    @property
    def db(self) -> Store:
        """One long-lived read connection (autocommit: every query sees the latest commit)."""
        if self._db is None:
            self._db = Store(self.home.db_path)
        return self._db

    def row(self, sql: str, params: tuple[Any, ...] = ()) -> dict[str, Any]:
        """The first row of a query, or ``{}`` (falsy) when there is none."""
        return self.db.one(sql, params) or {}

    def edge_row(self, edge: str) -> dict[str, Any]:
        return self.row("SELECT * FROM edges WHERE edge=?", (edge,))

    def broker(self) -> MosquittoBroker:
        return managed_broker(self.home)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def make_fleet_home(
    root: Path,
    edges: Iterable[str] = EDGES,
    fleet: str = FLEET,
    *,
    insecure: bool = False,
    privacy_floor: bool = True,
) -> FleetHome:
    """An initialised manager home on free ports with ``edges`` enrolled: mutual TLS with
    the fleet CA, or (``insecure``) plain TCP with passwords. Stations get the default
    privacy floor unless ``privacy_floor`` is False (they then train without DP-SGD)."""
    home = ManagerHome(root / "home")
    home.init(
        ManagerSettings(
            fleet,
            broker_port=free_port(),
            grpc_port=free_port(),
            superlink_port=free_port(),
            enroll_port=free_port(),
            metrics_port=free_port(),  # each test's manager its own (the default is 9470)
            insecure=insecure,
        )
    )
    fleet_home = FleetHome(root, home)
    for edge in edges:
        fleet_home.enroll(edge, privacy_floor=privacy_floor)
    return fleet_home


def publish_model(
    fh: FleetHome,
    version: int,
    *,
    seed: int = 0,
    n_outputs: int = 2,
    broken: bool = False,
    key: SigningKey | None = None,
) -> PublishedModel:
    """Build and publish ``inspect:VERSION`` (classes clean,scratch; scratch is a defect).

    ``key`` signs the manifest instead of the manager's own key (a foreign registry).
    """
    source = build_onnx_model(
        fh.root / "models" / f"inspect-{version}.onnx",
        n_outputs=n_outputs,
        seed=seed,
        broken=broken,
    )
    with fh.fleet() as fleet:
        registry = fleet.registry if key is None else Registry(fleet.store, fh.home.artifacts, key)
        return registry.publish(
            source,
            name="inspect",
            version=version,
            classes=("clean", "scratch"),
            positive_classes=("scratch",),
        )


def deploy(fh: FleetHome, version: int, edges: Iterable[str]) -> str:
    with fh.fleet() as fleet:
        return fleet.deploy("inspect", version, list(edges))


def set_threshold(fh: FleetHome, edge: str, value: float) -> int:
    """Push a threshold through the library; returns the new desired config version."""
    with fh.fleet() as fleet:
        return fleet.set_threshold([edge], value)[0].version


def wait_deploy_done(
    fh: FleetHome, deployment_id: str, edge: str, timeout_s: float = 40.0
) -> dict[str, Any]:
    """Wait until ``edge`` reported ``deployment_id`` active or failed; return its row."""
    return wait_until(
        lambda: fh.edge_row(edge),
        timeout_s,
        f"{edge} to finish deployment {deployment_id}",
        expect=lambda r: (
            r.get("deploy_id") == deployment_id and r.get("deploy_stage") in ("active", "failed")
        ),
    )


def wait_config_applied(fh: FleetHome, edge: str, version: int, timeout_s: float = 20.0) -> None:
    wait_until(
        lambda: fh.edge_row(edge),
        timeout_s,
        f"{edge} to report config v{version} applied",
        expect=lambda r: (
            r.get("config_applied") == version and r.get("config_status") == f"applied:{version}"
        ),
    )


def prediction_for(
    fh: FleetHome, edge: str, source: str, timeout_s: float = 20.0
) -> dict[str, Any]:
    """Wait for the manager to hold the prediction of ``source``; return its row."""
    return wait_until(
        lambda: fh.row("SELECT * FROM predictions WHERE edge=? AND source=?", (edge, source)),
        timeout_s,
        f"the prediction of {source} from {edge} in the manager store",
    )


def count_predictions(fh: FleetHome, edge: str) -> dict[str, int]:
    row = fh.row(
        "SELECT count(*) AS n, count(DISTINCT prediction_id) AS ids, "
        "count(DISTINCT source) AS sources FROM predictions WHERE edge=?",
        (edge,),
    )
    return {key: int(value) for key, value in row.items()}


@pytest.fixture
def fleet_home(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path)
    yield fleet_home
    fleet_home.close()


class RawClient:
    """A bare paho MQTT v5 client that records every acknowledgement's reason code."""

    def __init__(
        self,
        port: int,
        username: str,
        password: str,
        client_id: str = "",
        *,
        tls: TlsFiles | None = None,
        ca_only: Path | None = None,
    ) -> None:
        """``tls``: connect with this certificate (``username``/``password`` unused);
        ``ca_only``: TLS trusting this CA but presenting no certificate."""
        self.messages: list[tuple[str, bytes]] = []
        self.pubacks: dict[int, int] = {}
        self.subacks: dict[int, list[int]] = {}
        self.disconnects = 0
        self.connect_code: int | None = None
        self._connected = threading.Event()
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id or username, protocol=paho.MQTTv5
        )
        if tls is None and ca_only is None:
            self.client.username_pw_set(username, password)
        else:
            self.client.tls_set(
                ca_certs=str(tls.ca if tls is not None else ca_only),
                certfile=None if tls is None else str(tls.cert),
                keyfile=None if tls is None else str(tls.key),
            )
        self.error = ""
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_publish = self._on_publish
        self.client.on_subscribe = self._on_subscribe
        self.client.reconnect_delay_set(30, 30)  # no reconnect storm once refused
        try:
            self.client.connect("127.0.0.1", port, clean_start=True)
        except OSError as exc:  # a TLS handshake the broker refused (ssl.SSLError is one)
            self.error = str(exc)
        self.client.loop_start()

    def _on_connect(
        self,
        client: paho.Client,
        userdata: object,
        flags: paho.ConnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        self.connect_code = int(reason_code.value)
        if not reason_code.is_failure:
            self._connected.set()

    def _on_disconnect(
        self,
        client: paho.Client,
        userdata: object,
        flags: paho.DisconnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        self.disconnects += 1

    def _on_message(self, client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        self.messages.append((msg.topic, bytes(msg.payload)))

    def _on_publish(
        self,
        client: paho.Client,
        userdata: object,
        mid: int,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        self.pubacks[mid] = int(reason_code.value)

    def _on_subscribe(
        self,
        client: paho.Client,
        userdata: object,
        mid: int,
        reason_codes: list[ReasonCode],
        properties: Properties | None,
    ) -> None:
        self.subacks[mid] = [int(rc.value) for rc in reason_codes]

    def wait_connected(self) -> None:
        wait_until(self._connected.is_set, 10, "the MQTT connection")

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> int:
        """Publish at QoS 1; return the PUBACK reason code."""
        mid = self.client.publish(topic, payload, qos=1, retain=retain).mid
        code = wait_until(
            lambda: self.pubacks.get(mid),
            10,
            f"the PUBACK for {topic}",
            expect=lambda rc: rc is not None,
        )
        assert code is not None
        return code

    def subscribe(self, topic: str) -> list[int]:
        _, mid = self.client.subscribe(topic, qos=1)
        assert mid is not None
        return wait_until(lambda: self.subacks.get(mid, []), 10, f"the SUBACK for {topic}")

    def received(self, prefix: str) -> list[tuple[str, bytes]]:
        return [m for m in list(self.messages) if m[0].startswith(prefix)]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def connect_code(port: int, username: str, password: str) -> int:
    """Open a connection, return the CONNACK reason code (0 = accepted), and close it."""
    client = RawClient(port, username, password)
    try:
        code = wait_until(
            lambda: client.connect_code,
            10,
            f"a CONNACK for {username}",
            expect=lambda c: c is not None,
        )
        assert code is not None
        return code
    finally:
        client.close()


def mqtt_outcome(port: int, **kwargs: Any) -> str:
    """Connect once (``RawClient`` arguments after the port): "accepted", or what the
    refusal looked like (a TLS error, a CONNACK code, a dropped connection)."""
    client = RawClient(port, "", "", client_id=kwargs.pop("client_id", "probe"), **kwargs)
    try:
        wait_until(
            lambda: client.error or client.disconnects or client.connect_code is not None,
            10,
            "the broker's answer",
        )
        if client.connect_code == 0:
            return "accepted"
        return client.error or f"refused (code {client.connect_code}, {client.disconnects} drops)"
    finally:
        client.close()


def refused(port: int, **kwargs: Any) -> str:
    """The broker refuses this client (retried for a few seconds: reloads are async)."""
    return wait_until(
        lambda: mqtt_outcome(port, **kwargs), 10, "a refusal", expect=lambda o: o != "accepted"
    )


# ---------------------------------------------------------------- fedge subprocesses


@dataclass
class Proc:
    name: str
    args: tuple[str, ...]
    popen: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        out = self.stdout_path.read_text(errors="replace")
        err = self.stderr_path.read_text(errors="replace")
        return f"--- {self.name} stdout\n{out}\n--- {self.name} stderr\n{err}"


class Processes:
    """Starts ``fedge`` commands with their output in files; stops every one at the end."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.procs: list[Proc] = []
        # mosquitto pid files of brokers that a `fedge manager broker` started: if that
        # wrapper dies before its mosquitto, the broker is stopped through its pid file.
        self.pidfiles: list[Path] = []
        self._counter = 0

    def _paths(self, name: str) -> tuple[Path, Path]:
        self._counter += 1
        stem = f"{self._counter:02d}-{name}"
        return self.log_dir / f"{stem}.out", self.log_dir / f"{stem}.err"

    def start(self, name: str, *args: str) -> Proc:
        out_path, err_path = self._paths(name)
        with out_path.open("wb") as out, err_path.open("wb") as err:
            popen = subprocess.Popen(
                [str(FEDGE), *args], stdout=out, stderr=err, env=self.env, start_new_session=True
            )
        proc = Proc(name, args, popen, out_path, err_path)
        self.procs.append(proc)
        return proc

    def cli(
        self, *args: str, expect: int = 0, timeout_s: float = 180.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``fedge ARGS`` to completion and assert its exit code."""
        result = subprocess.run(
            [str(FEDGE), *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout_s,
            check=False,
        )
        assert result.returncode == expect, (
            f"`fedge {' '.join(args)}` exited {result.returncode}, expected {expect}\n"
            f"stdout: {result.stdout}\nstderr: {result.stderr}"
        )
        return result

    def signal(self, proc: Proc, sig: signal.Signals) -> None:
        if proc.running():
            proc.popen.send_signal(sig)

    def stop(self, proc: Proc, timeout_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL if it is still running after ``timeout_s``.

        Returns the exit code after SIGTERM, or None if SIGKILL was needed.
        """
        self.signal(proc, signal.SIGTERM)
        try:
            return proc.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()
            return None

    def kill(self, proc: Proc) -> None:
        self.signal(proc, signal.SIGKILL)
        proc.popen.wait()

    def close(self) -> None:
        alive = [p for p in self.procs if p.running()]
        for proc in alive:
            proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for proc in alive:
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        for pidfile in self.pidfiles:
            stop_pidfile(pidfile)


def stop_pidfile(pidfile: Path, timeout_s: float = 5.0) -> None:
    """Stop the mosquitto whose pid ``pidfile`` holds, if it is still ours and running."""
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return
    if b"mosquitto" not in cmdline or str(pidfile.parent).encode() not in cmdline:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = Path(f"/proc/{pid}/stat")
            try:
                if status.read_text().split(") ")[1].startswith("Z"):
                    return  # dead; its parent (not us) reaps it
            except (OSError, IndexError):
                return
            time.sleep(POLL_S)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path / "logs")
    yield procs
    procs.close()


# ---------------------------------------------------------------- stations that train


def png_bytes(image: object) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")  # type: ignore[arg-type]
    return buffer.getvalue()


def keep_labelled_images(data_dir: Path, seed: int, n: int = 16) -> None:
    """``n`` generated parts kept and labelled in a station's data directory."""
    from fedge.datasets.defects import CLASSES, make_defect_images
    from fedge.party.station_store import Retention, StationData

    data = StationData(data_dir, Retention(holdout_percent=20))
    images, labels = make_defect_images(n, seed=seed)
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        pid = f"p-{seed}-{index:03d}"
        data.keep(pid, png_bytes(image), ".png", at=time.time() + index)
        data.label(pid, CLASSES[int(label)], at=float(index))
    data.close()


def publish_trainable(fh: FleetHome, tmp_path: Path, edges: tuple[str, ...]) -> None:
    """inspect:1, a small trainable CNN, published; training enabled on ``edges``.

    torch is imported here, not at the top: most tests never train."""
    from fedge.datasets.defects import CLASSES
    from fedge.edge_manager.registry.versions import TrainableSource
    from fedge.models.inspection import export_onnx, new_model
    from fedge.party.families import state_arrays, weights_bytes
    from fedge.protocols.config import TrainingPolicy
    from fedge.protocols.manifest import Preprocess

    model = new_model(0, width=4)
    export_onnx(model, tmp_path / "inspect-1.onnx")
    (tmp_path / "inspect-1.npz").write_bytes(weights_bytes(state_arrays(model)))
    with fh.fleet() as fleet:
        fleet.registry.publish(
            tmp_path / "inspect-1.onnx", name="inspect", version=1, classes=CLASSES,
            preprocess=Preprocess(image_size=32),
            trainable=TrainableSource(tmp_path / "inspect-1.npz", "inspection-cnn", {"width": 4}),
        )  # fmt: skip
        fleet.set_training(list(edges), TrainingPolicy(enabled=True))


@pytest.fixture
def supervisors() -> Iterator[list[SupernodeSupervisor]]:
    """SuperNode supervisors a test started (for its stations), stopped at its end."""
    started: list[SupernodeSupervisor] = []
    yield started
    for supervisor in started:
        supervisor.stop()


# ---------------------------------------------------------------- the console

CONSOLE_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def console_login(fh: FleetHome, role: str, name: str = "") -> tuple[Any, str]:
    """A Starlette TestClient of the console over ``fh`` logged in with a new token of
    ``role`` (viewer, operator or admin), and the session's CSRF token."""
    from starlette.testclient import TestClient

    from fedge.console import accounts
    from fedge.console.accounts import Role
    from fedge.console.app import create_app

    with fh.fleet() as fleet:
        token = accounts.add_token(fleet.store, name or f"{role}-1", Role(role))
    client = TestClient(create_app(fh.home), follow_redirects=False)
    page = client.get("/login")
    client.post("/login", data={"csrf": CONSOLE_CSRF.findall(page.text)[0], "token": token})
    return client, CONSOLE_CSRF.findall(client.get("/").text)[0]


# ---------------------------------------------------------------- a stranger's host
# A second host on the plant network, for attack tests (issue 24): a Linux network
# namespace joined to this host by a veth pair on a /30 of 10.213.0.0/16 used only inside
# it. Servers under test listen on this host's end; the attacker's commands run in the
# namespace (``ip netns exec``) with nothing but that link. Needs root (CI runs as root); a
# host where it cannot be made fails the test that asked for it, it does not skip.


@dataclass(frozen=True)
class StrangerHost:
    """The namespace ``name``; this host is ``host_ip`` on the link, the stranger ``ip``."""

    name: str
    host_ip: str
    ip: str

    def run(
        self, argv: Sequence[str], *, timeout_s: float = 60.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` run inside the namespace; its exit code and output, never raised."""
        return subprocess.run(
            ["ip", "netns", "exec", self.name, *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"`ip {' '.join(args)}` failed ({done.stderr.strip()}): attack tests need root "
            "and iproute2 to make a network namespace"
        )


def _host_addresses() -> str:
    done = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True)
    return done.stdout


@contextmanager
def _subnet_lock() -> Iterator[None]:
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / "fedge-netns.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def stranger_host() -> Iterator[StrangerHost]:
    """A namespace linked to this host; removed (with its link) afterwards."""
    tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
    name, outer, inner = f"fedge-x{tag}", f"vx{tag}h", f"vx{tag}g"
    _ip("netns", "add", name)
    try:
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", name)
        # Parallel test workers make namespaces at the same time: the subnet is chosen
        # among those no interface of this host has, under a machine-wide lock.
        with _subnet_lock():
            subnet = random.choice(
                [n for n in range(1, 250) if f"10.213.{n}." not in _host_addresses()]
            )
            host = StrangerHost(name, f"10.213.{subnet}.1", f"10.213.{subnet}.2")
            _ip("addr", "add", f"{host.host_ip}/30", "dev", outer)
        _ip("link", "set", outer, "up")
        _ip("-n", name, "addr", "add", f"{host.ip}/30", "dev", inner)
        _ip("-n", name, "link", "set", inner, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield host
    finally:
        subprocess.run(["ip", "link", "del", outer], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


# A plant whose stations train (tests/test_fleet_learns.py, test_fleet_distill.py,
# federation/test_queue_fleet.py): broker, serve, SuperLink and agents as processes, the
# stations' parts scored and labelled through their local API.


def post_json(url: str, data: bytes, content_type: str) -> dict[str, Any]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=10) as response:
        result: dict[str, Any] = json.loads(response.read())
    return result


def score_and_label(
    port: int, seed: int, *, images: int = 20, holdout_percent: int = 20, min_held_out: int = 2
) -> list[str]:
    """Score at least ``images`` generated parts through the station's API and label them
    truthfully, going on (up to 3 * ``images``) until the station holds out
    ``min_held_out`` (the agent's default share is 20 %).

    Which image is held out hangs on its random prediction id: with 20 % held out, 20
    images leave none out about once in 90 stations, and then that station rightly
    cannot evaluate (CI saw it once). The tests are about training, not that draw."""
    from fedge.datasets.defects import CLASSES, make_defect_images
    from fedge.party.station_store import is_holdout

    parts, labels = make_defect_images(3 * images, seed=seed)
    ids: list[str] = []
    for image, label in zip(parts, labels, strict=True):
        held_out = sum(is_holdout(pid, holdout_percent) for pid in ids)
        if len(ids) >= images and held_out >= min_held_out:
            break
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        record = post_json(f"http://127.0.0.1:{port}/v1/score", buffer.getvalue(), "image/png")
        body = {"prediction_id": record["prediction_id"], "label": CLASSES[int(label)]}
        post_json(
            f"http://127.0.0.1:{port}/v1/labels", json.dumps(body).encode(), "application/json"
        )
        ids.append(record["prediction_id"])
    return ids


def start_training_plant(
    fh: FleetHome,
    processes: Processes,
    tmp_path: Path,
    edges: Sequence[str],
    ready: Callable[[FleetHome, str, int], None] | None = None,
) -> dict[str, int]:
    """Broker, serve, SuperLink and the agents of ``edges``; each agent's HTTP port.
    Waits until each is ``ready`` (default: online at the manager)."""
    processes.pidfiles.append(fh.home.root / "broker" / "mosquitto.pid")
    processes.start("broker", "manager", "broker")
    wait_until(lambda: port_open(fh.settings.broker_port), 15, "the managed broker to listen")
    ready_file = tmp_path / "serve.ready"
    processes.start("serve", "manager", "serve", "--ready-file", str(ready_file))
    processes.start("superlink", "manager", "superlink")
    wait_until(lambda: port_open(fh.settings.superlink_port), 60, "the SuperLink to listen")
    ports = {}
    for edge in edges:
        ports[edge] = free_port()
        fh.set_agent_option(edge, "http_port", ports[edge])
        processes.start(edge, "agent", "run", "--config", str(fh.agents[edge]))
    wait_until(ready_file.exists, 30, "manager serve to be ready")
    for edge in edges:
        if ready is None:
            wait_edge_online(fh, edge)
        else:
            ready(fh, edge, ports[edge])
    return ports


def wait_edge_online(fh: FleetHome, edge: str) -> None:
    def state() -> object:
        return fh.edge_row(edge).get("state")

    wait_until(state, 30, f"{edge} online", expect=lambda s: s == "online")


def wait_serving(fh: FleetHome, edge: str, ref: str) -> None:
    def serving() -> object:
        return fh.edge_row(edge).get("serving")

    wait_until(serving, 40, f"{edge} serving {ref}", expect=lambda s: s == ref)


def dump_flower_logs(root: Path) -> None:
    for log in sorted(root.rglob("supernode.log")) + sorted(root.rglob("superlink.log")):
        print(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}")


# An anomaly model beside a classifier (issue 28): the pair the rollout and serving tests
# deploy, and the parts they score.


@contextmanager
def anomaly_pair_fleet(
    root: Path, edge: str, anomalies: Iterable[tuple[int, int, float]]
) -> Iterator[FleetHome]:
    """A one-station fleet with its broker and the manager's serve loop running, ``inspect:1``
    published -- a constant classifier calling every part clean (p 0.998), as one that never
    saw the new defect does -- and an ``inspect-anomaly`` brightness model for each
    ``(version, size, scale)`` (:func:`fedge.models.tiny_onnx.build_brightness_anomaly`)."""
    from fedge.edge_manager.serve import ManagerService
    from fedge.models.tiny_onnx import build_brightness_anomaly

    fh = make_fleet_home(root, edges=(edge,))
    broker: MosquittoBroker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    try:
        service.start()
        models = fh.root / "models"
        with fh.fleet() as manager:
            manager.registry.publish(
                build_linear_classifier(
                    models / "inspect-1.onnx", weights=np.zeros((2, 1024)), bias=np.array([3, -3])
                ),
                name="inspect",
                version=1,
                classes=("clean", "scratch"),
                positive_classes=("scratch",),
            )
            for version, size, scale in anomalies:
                manager.registry.publish(
                    build_brightness_anomaly(
                        models / f"anomaly-{version}.onnx", size=size, scale=scale
                    ),
                    name="inspect-anomaly",
                    version=version,
                    classes=("good", "anomalous"),
                    positive_classes=("anomalous",),
                )
        yield fh
    finally:
        service.stop()
        broker.stop()
        fh.close()


def part_png(bright: bool, seed: int) -> bytes:
    """A 32 x 32 part: a bright one scores about 18 under a brightness model of scale 20,
    a dark one about 5."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(200, 256, (32, 32)) if bright else rng.integers(0, 128, (32, 32))
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def score_part(port: int, bright: bool, seed: int) -> dict[str, Any]:
    """The agent's record for :func:`part_png` scored through its local API."""
    return post_json(f"http://127.0.0.1:{port}/v1/score", part_png(bright, seed), "image/png")


# ---------------------------------------------------------------- a tiny tiered fleet

TIERED_FLEET = """
[data]
dataset = "digits"
alpha = 0.5
test_fraction = 0.2
proxy_fraction = 0.1

[fleet]
parties = 6
per_round = 2
speed_distribution = "groups"

[[fleet.groups]]
count = 2
cpus = 4.0
data_share = 0.3

[[fleet.groups]]
count = 2
cpus = 1.0
data_share = 0.3

[[fleet.groups]]
count = 2
cpus = 0.1
data_share = 0.4

[device]
seconds_per_example = 0.05
bandwidth_mbps = 10.0
jitter_sigma = 0.0
availability = 1.0
dropout = 0.0

[training]
rounds = 10
lr = 0.2
local_epochs = 1
batch_size = 10
target_accuracy = 0.5
arch = "mlp"
"""
"""Six digits parties in three speed groups (fast, middle, slow: two each), 10 rounds: the
scenario of the per-tier architecture tests (FedDF's, HeteroFL's); a test module adds its
name, description and ``[strategies.*]`` tables."""


class RecordingGrid(InProcessGrid):
    """An InProcessGrid that keeps every message pushed to it."""

    pushed: list[Message]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        batch = list(messages)
        if not hasattr(self, "pushed"):
            self.pushed = []
        self.pushed.extend(batch)
        return super().push_messages(batch)
