"""A real Flower deployment: SuperLink, three SuperNodes, ``flwr run``, a slow and a dead party.

fedge's ServerApp (``fedge.sim.server_app``) runs FedAvg on the wall clock with a
2-of-3 quorum and a deadline derived from the parties' measured latency. Party 2 is slowed
far past any deadline (``delay-s``), party 1 is SIGKILLed -- SuperNode, its SuperExec and
any ClientApp process -- once round 1 is recorded. Every round must still end (by quorum
or deadline) and the run store must say who was late or failed, and why.

Flower 1.41 serves the SuperLink's Runtime, Control and Fleet APIs over HTTP on one
``--host``/``--port``; a SuperNode serves its own Runtime API on ``--port``. Both launch
their apps through ``flower-superexec`` (found on PATH), one process per task.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, port_open, wait_until
from flwr.app import Context, RecordDict

from fedge.aggregator.jobs.run_store import RunStore
from fedge.aggregator.strategies.factory import StrategyConfigError
from fedge.edge_agent.training.supervisor import kill_tree, process_tree
from fedge.sim.grid import InProcessGrid
from fedge.sim.party_app import app as client_app
from fedge.sim.server_app import ServerConfigError, ServerSettings, run_server

BIN = Path(sys.executable).parent
APP_DIR = Path(__file__).resolve().parents[1] / "deploy_app"
CONNECTION = "fedge-test"
RUN_ID = "deploy-test"
ROUNDS = 3
NORMAL, KILLED, SLOW = 1000, 1001, 1002  # node ids as the ServerApp shows them
SLOW_DELAY_S = 600  # far past any deadline: the party never answers in this test
# Every message starts a fresh ClientApp process (Python, torch, the scenario's data), and a
# SuperNode polls for messages every 3 s: a round takes ~10 s on an idle 2-core machine, and
# the whole test ~1.5 min. The waits allow for a machine several times busier.
ROUND_1_WAIT_S = 200
RUN_END_WAIT_S = 300

SCENARIO = """
name = "deploy-three"
description = "three parties on one machine, for the deployment test"

[data]
alpha = 0.5

[fleet]
parties = 3
per_round = 3

[[fleet.groups]]
count = 3
cpus = 1.0
data_share = 1.0

[device]
seconds_per_example = 0.01

[training]
rounds = 3
lr = 0.2
local_epochs = 1
batch_size = 10
target_accuracy = 0.9
"""


# ---------------------------------------------------------------- processes


@dataclass
class Flower:
    """The processes of one deployment, each with its own FLWR_HOME and log file."""

    root: Path
    env: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        home = self.root / "homes" / name
        home.mkdir(parents=True, exist_ok=True)
        log = (self.root / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [str(BIN / args[0]), *args[1:]],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**self.env, "FLWR_HOME": str(home)},
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        kill_tree(proc.pid)
        proc.wait(timeout=10)

    def logs(self) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")):
            text = path.read_text(errors="replace")
            parts.append(f"--- {path.name}\n{text[-4000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None or process_tree(proc.pid)[1:]:
                kill_tree(proc.pid)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - reported, not hidden
                pytest.fail(f"{name} (pid {proc.pid}) did not die on SIGKILL")


@pytest.fixture
def flower(tmp_path: Path) -> Iterator[Flower]:
    env = {
        **os.environ,
        # SuperLink and SuperNode start flower-superexec, flwr-serverapp and
        # flwr-clientapp by name.
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.5",
        "PYTHONUNBUFFERED": "1",
    }
    deployment = Flower(tmp_path / "flower", env)
    deployment.root.mkdir()
    yield deployment
    deployment.close()


def store_view(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    store = RunStore(path)
    try:
        return store.run(RUN_ID), store.rounds(RUN_ID)
    finally:
        store.close()


# ---------------------------------------------------------------- the ServerApp, in process


def test_run_config_selects_the_strategy_keys() -> None:
    config: dict[str, bool | int | float | str] = {
        "strategy": "fedavg",
        "scenario": "s.toml",
        "seed": 3,
        "run-store": "runs.db",
        "quorum-fraction": 0.6,
        "deadline-factor": 0.0,  # 0 = no deadline
        "tiers": 4,  # a tiered key: ignored by fedavg
        "proximal-mu": 0.1,  # a fedprox key: ignored too
    }
    settings = ServerSettings.from_run_config(config)
    assert settings.strategy_params == {"quorum_fraction": 0.6}
    assert (settings.rounds, settings.per_round, settings.run_id) == (0, 0, "")
    assert settings.manifest == config

    tiered = ServerSettings.from_run_config(
        {**config, "strategy": "tiered", "profiling-deadline-s": 5.0, "retier-interval": 0}
    )
    assert tiered.strategy_params == {
        "quorum_fraction": 0.6,
        "tiers": 4,
        "profiling_deadline_s": 5.0,
    }
    distill = ServerSettings.from_run_config(
        {**config, "strategy": "distill", "tier-archs": "mlp-large, mlp-small", "tiers": 2}
    )
    assert distill.strategy_params == {
        "quorum_fraction": 0.6,
        "tiers": 2,
        "tier_archs": ["mlp-large", "mlp-small"],
    }
    with pytest.raises(ServerConfigError, match="seed"):
        ServerSettings.from_run_config({**config, "seed": "three"})
    with pytest.raises(ServerConfigError, match="run-store"):
        ServerSettings.from_run_config({k: v for k, v in config.items() if k != "run-store"})


def serve_in_process(config: dict[str, bool | int | float | str], run_id: int) -> None:
    """The ServerApp's main on fedge's in-process grid of three parties."""
    grid = InProcessGrid(client_app, 3, run_config=config)
    context = Context(
        run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config=config
    )
    try:
        run_server(grid, context)
    finally:
        grid.close()


def stored(
    run_store: Path, run_id: str
) -> tuple[dict[str, Any] | None, list[dict[str, Any]], list[dict[str, Any]]]:
    """The run, its rounds and its profiles as the run store holds them."""
    store = RunStore(run_store)
    try:
        return store.run(run_id), store.rounds(run_id), store.profiles(run_id)
    finally:
        store.close()


def test_a_deployed_distill_run_trains_one_architecture_per_tier(tmp_path: Path) -> None:
    """The ServerApp with kind distill, wall clock: run-config keys reach the strategy."""
    scenario = tmp_path / "deploy-three.toml"
    scenario.write_text(SCENARIO, encoding="utf-8")
    run_store = tmp_path / "runs.db"
    config: dict[str, bool | int | float | str] = {
        "strategy": "distill",
        "scenario": str(scenario),
        "seed": 1,
        "rounds": 3,
        "run-store": str(run_store),
        "run-id": "distill",
        "tiers": 2,
        "tier-archs": "mlp-large,mlp-small",
        "distill-epochs": 1,
        "min-nodes": 3,
    }
    serve_in_process(config, run_id=8)
    run, rounds, _ = stored(run_store, "distill")
    assert run is not None and run["state"] == "completed" and run["last_round"] == 3
    assert all(r["eval_metrics"]["accuracy"] > 0 for r in rounds)
    # Every round after profiling distils into both tier architectures.
    for row in rounds[1:]:
        assert {"distill-kl-after/mlp-large", "distill-kl-after/mlp-small"} <= set(
            row["train_metrics"]
        )


def test_a_strategy_that_cannot_be_built_is_a_failed_run(tmp_path: Path) -> None:
    scenario = tmp_path / "deploy-three.toml"
    scenario.write_text(SCENARIO, encoding="utf-8")
    run_store = tmp_path / "runs.db"
    config: dict[str, bool | int | float | str] = {
        "strategy": "distill",
        "scenario": str(scenario),
        "seed": 1,
        "run-store": str(run_store),
        "run-id": "bad",
        "tiers": 2,
        "tier-archs": "mlp-large,mlp-huge",
    }
    with pytest.raises(StrategyConfigError, match="mlp-huge"):
        serve_in_process(config, run_id=9)
    run, _, _ = stored(run_store, "bad")
    assert run is not None and run["state"] == "failed" and "mlp-huge" in run["error"]


def test_server_app_records_every_round_on_an_in_process_grid(tmp_path: Path) -> None:
    """The ServerApp's main on fedge's in-process grid: no Flower processes, wall clock."""
    scenario = tmp_path / "deploy-three.toml"
    scenario.write_text(SCENARIO, encoding="utf-8")
    run_store = tmp_path / "runs.db"
    config: dict[str, bool | int | float | str] = {
        "strategy": "tiered",
        "scenario": str(scenario),
        "seed": 1,
        "rounds": 2,
        "run-store": str(run_store),
        "run-id": "in-process",
        "tiers": 2,
        "quorum-fraction": 0.6,
        "min-nodes": 3,
    }
    serve_in_process(config, run_id=7)
    run, rounds, profiles = stored(run_store, "in-process")
    assert run is not None and run["state"] == "completed" and run["last_round"] == 2
    assert json.loads(run["manifest"]) == config
    assert [r["round"] for r in rounds] == [1, 2]
    assert rounds[0]["selected"] == [NORMAL, KILLED, SLOW]  # profiling: everyone
    assert all(r["eval_metrics"]["accuracy"] > 0 for r in rounds)
    assert rounds[1]["tier"] in (0, 1)
    assert {p["party"] for p in profiles} == {NORMAL, KILLED, SLOW}
    assert {p["tier"] for p in profiles} == {0, 1}


# ---------------------------------------------------------------- the deployment


@pytest.mark.integration
@pytest.mark.timeout(540)
def test_rounds_end_by_quorum_and_deadline_with_a_slow_and_a_dead_party(
    flower: Flower, tmp_path: Path
) -> None:
    started = time.monotonic()
    scenario = tmp_path / "deploy-three.toml"
    scenario.write_text(SCENARIO, encoding="utf-8")
    run_store = tmp_path / "runs.db"

    link_port = free_port()
    flower.start(
        "superlink",
        "flower-superlink",
        "--insecure",
        "--disable-runtime-dependency-installation",
        "--database",
        str(tmp_path / "superlink.db"),
        "--host",
        "127.0.0.1",
        "--port",
        str(link_port),
    )
    wait_until(lambda: port_open(link_port), 60, "the SuperLink's HTTP port")
    delays = {0: 0, 1: 0, 2: SLOW_DELAY_S}
    for partition, delay in delays.items():
        flower.start(
            f"supernode-{partition}",
            "flower-supernode",
            "--insecure",
            "--superlink",
            f"127.0.0.1:{link_port}",
            "--port",
            str(free_port()),
            "--node-config",
            f"partition-id={partition} num-partitions=3 delay-s={delay}",
        )

    # `flwr run` reads its SuperLink connection from FLWR_HOME/config.toml.
    cli_home = flower.root / "homes" / "cli"
    cli_home.mkdir(parents=True)
    (cli_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n',
        encoding="utf-8",
    )
    overrides = tmp_path / "run-config.toml"
    overrides.write_text(
        "\n".join(
            [
                f"scenario = {json.dumps(str(scenario))}",
                "seed = 1",
                'strategy = "fedavg"',
                f"rounds = {ROUNDS}",
                "per-round = 3",
                "quorum-fraction = 0.6",  # 2 of 3
                "deadline-factor = 1.25",  # x the p90 of measured latencies
                'late-policy = "drop"',
                f"run-store = {json.dumps(str(run_store))}",
                f'run-id = "{RUN_ID}"',
                "min-nodes = 3",
                "node-wait-s = 120.0",
                "round-timeout-s = 120.0",
                "",
            ]
        ),
        encoding="utf-8",
    )
    result = subprocess.run(
        [
            str(BIN / "flwr"),
            "run",
            str(APP_DIR),
            CONNECTION,
            "--run-config",
            str(overrides),
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        env={**flower.env, "FLWR_HOME": str(cli_home)},
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"flwr run failed:\n{result.stdout}\n{result.stderr}"
    submitted = json.loads(result.stdout[result.stdout.index("{") :])
    assert submitted["success"], submitted

    def view() -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        return store_view(run_store)

    try:
        _, rounds = wait_until(
            view, ROUND_1_WAIT_S, "round 1 in the run store", expect=lambda v: len(v[1]) >= 1
        )
        flower.kill("supernode-1")  # the whole machine goes: SuperNode, SuperExec, ClientApp
        killed_after = len(rounds)
        run, rounds = wait_until(
            view,
            RUN_END_WAIT_S,
            "the run to end",
            expect=lambda v: v[0] is not None and v[0]["state"] in ("completed", "failed"),
        )
    except BaseException:
        print(flower.logs())
        raise
    assert run is not None
    assert run["state"] == "completed", f"{run}\n{flower.logs()}"
    assert killed_after == 1, "the kill came after round 2 had already ended"

    # Every round ended, each by its quorum or its deadline.
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    for r in rounds:
        assert r["selected"] and sorted(r["selected"]) == sorted(
            set(r["on_time"]) | set(r["late"]) | set(r["failed"])
        ), r
        assert r["quorum"] == 2, r
        if not r["quorum_met"]:
            assert r["deadline_s"] is not None, f"round {r['round']} waited without a deadline"
            assert r["round_time_s"] >= r["deadline_s"] - 0.05, r
        else:
            assert len(r["on_time"]) >= 2, r

    first, *after_kill = rounds
    # Round 1: no latency known yet, so no deadline -- the two healthy parties make the
    # quorum and the slow one is late.
    assert first["deadline_s"] is None and first["quorum_met"], first
    assert sorted(first["on_time"]) == [NORMAL, KILLED], first
    assert first["late"] == [SLOW], first
    # Later rounds: a deadline from the measured latencies; the slow party is still late,
    # the killed one never answers again (late, or failed once the SuperLink gives up).
    for r in after_kill:
        assert r["deadline_s"] is not None, r
        assert SLOW in r["late"] or SLOW in r["failed"], r
        assert KILLED not in r["on_time"], r
        assert NORMAL not in r["failed"], r
        if KILLED in r["selected"]:
            assert KILLED in r["late"] or KILLED in r["failed"], r
    assert KILLED in after_kill[0]["selected"], "round 2 should still see the killed node"
    assert not after_kill[0]["quorum_met"], after_kill[0]

    store = RunStore(run_store)
    try:
        profiles = {p["party"]: p for p in store.profiles(RUN_ID)}
    finally:
        store.close()
    assert set(profiles) == {NORMAL, KILLED, SLOW}
    assert profiles[SLOW]["timeouts"] == ROUNDS
    assert profiles[KILLED]["timeouts"] >= 1
    print(f"deployment test: {time.monotonic() - started:.1f}s")


QUICKSTART_DIR = Path(__file__).resolve().parents[1] / "quickstart_app"


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_a_quickstart_client_app_runs_unchanged_under_fedge_tiered(
    flower: Flower, tmp_path: Path
) -> None:
    """A ClientApp with only a train handler (no query): tiers come from measured latency.

    fedge's ServerApp asks every node who it is; such an app answers with an error, and
    the node is shown under its own node id instead of being left out.
    """
    run_store = tmp_path / "runs.db"
    link_port = free_port()
    flower.start(
        "superlink", "flower-superlink", "--insecure",
        "--disable-runtime-dependency-installation", "--database", str(tmp_path / "sl.db"),
        "--host", "127.0.0.1", "--port", str(link_port),
    )  # fmt: skip
    wait_until(lambda: port_open(link_port), 60, "the SuperLink's HTTP port")
    for partition in (0, 1):
        flower.start(
            f"supernode-{partition}", "flower-supernode", "--insecure",
            "--superlink", f"127.0.0.1:{link_port}", "--port", str(free_port()),
            "--node-config", f"partition-id={partition} num-partitions=2",
        )  # fmt: skip
    cli_home = flower.root / "homes" / "cli"
    cli_home.mkdir(parents=True)
    (cli_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n',
        encoding="utf-8",
    )
    overrides = tmp_path / "run-config.toml"
    overrides.write_text(
        f'run-store = {json.dumps(str(run_store))}\nrun-id = "{RUN_ID}"\nmin-nodes = 2\n',
        encoding="utf-8",
    )
    result = subprocess.run(
        [str(BIN / "flwr"), "run", str(QUICKSTART_DIR), CONNECTION,
         "--run-config", str(overrides), "--format", "json"],
        capture_output=True, text=True, env={**flower.env, "FLWR_HOME": str(cli_home)},
        timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, f"flwr run failed:\n{result.stdout}\n{result.stderr}"
    try:
        run, rounds = wait_until(
            lambda: store_view(run_store), 300, "the run to end",
            expect=lambda v: v[0] is not None and v[0]["state"] in ("completed", "failed"),
        )  # fmt: skip
    except BaseException:
        print(flower.logs())
        raise
    assert run is not None and run["state"] == "completed", f"{run}\n{flower.logs()}"
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert len(r["on_time"]) >= 1 and not r["failed"], r
        assert r["eval_metrics"]["accuracy"] > 0.1, r
    store = RunStore(run_store)
    try:
        profiles = store.profiles(RUN_ID)
    finally:
        store.close()
    # Both nodes, under Flower's own node ids, profiled from their measured latency and tiered.
    assert len(profiles) == 2 and all(p["count"] >= 1 and p["mean_s"] > 0 for p in profiles)
    assert {p["tier"] for p in profiles} <= {0, 1} and None not in {p["tier"] for p in profiles}
    assert rounds[1]["tier"] in (0, 1)


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_a_fedadam_run_on_real_supernodes_completes(flower: Flower, tmp_path: Path) -> None:
    """Issue 29: a server optimizer (FedAdam) over fedge's ServerApp, three SuperNodes,
    ``flwr run``; its keys come from the run config like every strategy key."""
    scenario = tmp_path / "deploy-three.toml"
    scenario.write_text(SCENARIO, encoding="utf-8")
    run_store = tmp_path / "runs.db"
    link_port = free_port()
    flower.start(
        "superlink", "flower-superlink", "--insecure",
        "--disable-runtime-dependency-installation", "--database", str(tmp_path / "sl.db"),
        "--host", "127.0.0.1", "--port", str(link_port),
    )  # fmt: skip
    wait_until(lambda: port_open(link_port), 60, "the SuperLink's HTTP port")
    for partition in range(3):
        flower.start(
            f"supernode-{partition}", "flower-supernode", "--insecure",
            "--superlink", f"127.0.0.1:{link_port}", "--port", str(free_port()),
            "--node-config", f"partition-id={partition} num-partitions=3",
        )  # fmt: skip
    cli_home = flower.root / "homes" / "cli"
    cli_home.mkdir(parents=True)
    (cli_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n',
        encoding="utf-8",
    )
    overrides = tmp_path / "run-config.toml"
    overrides.write_text(
        "\n".join(
            [
                f"scenario = {json.dumps(str(scenario))}",
                "seed = 1",
                'strategy = "fedavg"',
                'server-opt = "fedadam"',
                "server-lr = 0.03",
                "rounds = 2",
                "per-round = 3",
                f"run-store = {json.dumps(str(run_store))}",
                f'run-id = "{RUN_ID}"',
                "min-nodes = 3",
                "node-wait-s = 120.0",
                "round-timeout-s = 120.0",
                "",
            ]
        ),
        encoding="utf-8",
    )
    result = subprocess.run(
        [str(BIN / "flwr"), "run", str(APP_DIR), CONNECTION,
         "--run-config", str(overrides), "--format", "json"],
        capture_output=True, text=True, env={**flower.env, "FLWR_HOME": str(cli_home)},
        timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, f"flwr run failed:\n{result.stdout}\n{result.stderr}"
    try:
        run, rounds = wait_until(
            lambda: store_view(run_store), 300, "the run to end",
            expect=lambda v: v[0] is not None and v[0]["state"] in ("completed", "failed"),
        )  # fmt: skip
    except BaseException:
        print(flower.logs())
        raise
    assert run is not None and run["state"] == "completed", f"{run}\n{flower.logs()}"
    assert json.loads(run["manifest"])["server-opt"] == "fedadam"
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert sorted(r["on_time"]) == [NORMAL, KILLED, SLOW] and not r["failed"], r
        assert r["eval_metrics"]["accuracy"] > 0, r
