"""Run a scenario on Flower's own simulation runtime (Ray), with the same strategy and
ClientApp as the in-process backend, and the same result for the same seed.

Two things differ between Flower's runtime and :class:`~fedge.sim.grid.InProcessGrid`, and
both are bridged here:

* **Node ids.** Flower gives its nodes random 64-bit ids (partition ids 0..n-1 follow
  registration order), while fedge's strategies sample from ``sorted(grid.get_node_ids())``.
  :class:`PartitionOrderedGrid` asks every node once which partition it is (a
  ``MessageType.QUERY`` message, answered by the ClientApp's ``@app.query()``) and shows
  the strategy ``1000 + partition-id`` -- the ids the in-process grid uses -- translating
  destinations on push and sources on pull. The deployment ServerApp uses it too, so run
  records name parties the same way everywhere.
* **Run config.** ``flwr.simulation.run_simulation`` starts every node with an EMPTY
  ``run_config`` (it has no parameter for one: nodes get the fused config of an app
  directory or an installed FAB, and it passes neither). The ClientApp needs ``scenario``
  and ``seed``, so :func:`run_on_flower` does what Flower's own ``flwr-simulation`` process
  does: it writes a minimal Flower app directory whose ``[tool.flwr.app.config]`` holds
  the run config, and starts the runtime through ``_run_simulation(app_dir=...,
  is_app=True, run=...)`` with ``Run.override_config`` set. Each node's ``Context`` is
  built from that in the driver and shipped to the Ray actors with every message, so the
  values reach every worker process.

Ray is started with 2 CPUs (one actor per CPU, ``client_resources.num_cpus = 1``), no
dashboard, a small object store, its servers on 127.0.0.1, ERROR-level logging, no worker
output on the driver, usage stats off, and a private temp dir that is removed afterwards.
With ``ray_address`` (``fedge sim --backend flower --ray-address HOST:PORT``, issue 29) it
joins an existing Ray cluster instead, whose nodes say what they offer: Flower makes one
actor per CPU of every node, so the parties run across the whole cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from logging import ERROR
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.run import Run

from fedge.aggregator.fleet.grids import wait_for_nodes
from fedge.aggregator.fleet.identity import PartitionOrderedGrid
from fedge.sim.data import make_partitions
from fedge.sim.runner import Curve, ProgressFn, drive, run_config
from fedge.sim.scenario import Scenario

RAY_CPUS = 2
RAY_OBJECT_STORE_BYTES = 200 * 1024 * 1024
NODE_WAIT_S = 120.0  # for every simulated party to be registered and placed


# ---------------------------------------------------------------- the simulation runtime


def backend_config(
    num_cpus: int = RAY_CPUS, temp_dir: str | None = None, ray_address: str | None = None
) -> dict[str, Any]:
    """Flower's backend config: ``num_cpus`` one-CPU actors on a quiet, bounded Ray of
    its own, or (``ray_address``) one actor per CPU of an existing cluster."""
    client_resources = {"num_cpus": 1, "num_gpus": 0.0}
    if ray_address:
        # A cluster's resources, addresses and temp dirs are its own: only connect.
        joined = {"address": ray_address, "logging_level": ERROR, "log_to_driver": False}
        return {"client_resources": client_resources, "init_args": joined}
    init_args: dict[str, Any] = {
        "num_cpus": num_cpus,
        "num_gpus": 0,
        "include_dashboard": False,
        "logging_level": ERROR,
        "log_to_driver": False,
        "object_store_memory": RAY_OBJECT_STORE_BYTES,
        "_node_ip_address": "127.0.0.1",  # Ray's servers on loopback only
    }
    if temp_dir is not None:
        init_args["_temp_dir"] = temp_dir
    return {"client_resources": client_resources, "init_args": init_args}


def write_app_dir(directory: Path, config: dict[str, bool | int | float | str]) -> Path:
    """A minimal Flower app (``pyproject.toml``) whose run config defaults are ``config``.

    Flower's runtimes build a node's ``run_config`` from an app directory's
    ``[tool.flwr.app.config]`` fused with ``Run.override_config``; only the ClientApp
    and ServerApp objects passed in code are run, the components named here are not loaded.
    """
    lines = [
        "[project]",
        'name = "fedge-sim"',
        'version = "0.1.0"',
        'description = "fedge scenario on the Flower simulation runtime"',
        'license = "Apache-2.0"',
        "",
        "[tool.flwr.app]",
        'publisher = "fedge"',
        "",
        "[tool.flwr.app.components]",
        'serverapp = "fedge.sim.flower_backend:unused"',
        'clientapp = "fedge.sim.party_app:app"',
        "",
        "[tool.flwr.app.config]",
        *(f"{json.dumps(key)} = {_toml_value(value)}" for key, value in config.items()),
        "",
    ]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "pyproject.toml"
    path.write_text("\n".join(lines), encoding="utf-8")
    return directory


def _toml_value(value: bool | int | float | str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)  # a TOML basic string is a JSON string


def launch_simulation(
    server_app: ServerApp,
    client_app: ClientApp,
    num_supernodes: int,
    config: dict[str, bool | int | float | str],
    *,
    num_cpus: int = RAY_CPUS,
    ray_address: str | None = None,
) -> None:
    """Run ``server_app`` against ``client_app`` on Flower's simulation runtime (Ray).

    The public ``run_simulation`` cannot pass a run config to the nodes, so this does what
    Flower's own ``flwr-simulation`` does: a small app directory holding the config, a
    ``Run`` with ``override_config``, and the private ``_run_simulation``.
    """
    from flwr.common.constant import RUN_ID_NUM_BYTES, SUPERLINK_NODE_ID, TASK_ID_NUM_BYTES
    from flwr.server.superlink.linkstate.utils import generate_rand_int_from_bytes
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supercore.telemetry import EventType

    workdir = Path(tempfile.mkdtemp(prefix="fedge-flwr-"))
    try:
        app_dir = write_app_dir(workdir / "app", config)
        ray_dir = workdir / "ray"
        ray_dir.mkdir()
        run_id = generate_rand_int_from_bytes(RUN_ID_NUM_BYTES)
        run = Run.create_empty(run_id=run_id)
        run.primary_task_id = generate_rand_int_from_bytes(TASK_ID_NUM_BYTES)
        run.federation_id = NOOP_FEDERATION_ID
        run.override_config = dict(config)
        # What Flower's ServerApp runtime sets for its process: new Messages read it.
        TaskIdentity.task_id = 1
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        context = Context(
            run_id=run_id,
            node_id=0,
            node_config={},
            state=RecordDict(),
            run_config=dict(config),
        )
        _run_simulation(
            num_supernodes=num_supernodes,
            exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
            client_app=client_app,
            server_app=server_app,
            backend_name="ray",
            backend_config=backend_config(num_cpus, str(ray_dir), ray_address),
            server_app_context=context,
            app_dir=str(app_dir),
            run=run,
            is_app=True,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_on_flower(
    scenario: Scenario,
    strategy_name: str,
    seed: int,
    *,
    progress: ProgressFn | None = None,
    num_cpus: int = RAY_CPUS,
    ray_address: str | None = None,
) -> Curve:
    """One strategy on ``scenario`` with Flower's simulation runtime (Ray actors)."""
    return run_strategies_on_flower(
        scenario,
        (strategy_name,),
        seed,
        progress=progress,
        num_cpus=num_cpus,
        ray_address=ray_address,
    )[0]


def run_strategies_on_flower(
    scenario: Scenario,
    strategy_names: Sequence[str],
    seed: int,
    *,
    progress: ProgressFn | None = None,
    num_cpus: int = RAY_CPUS,
    ray_address: str | None = None,
) -> list[Curve]:
    """Several strategies, one after the other, in ONE Flower simulation (one Ray start).

    Each strategy is built afresh and starts from the same initial model; the parties
    keep nothing between messages, so each curve is what :func:`run_on_flower` gives.
    """
    if not strategy_names:
        return []
    # Imported here: the simulation runtime pulls in Ray, which the deployment path
    # (PartitionOrderedGrid in the ServerApp) does not need.

    from fedge.sim.party_app import app as client_app

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    data = make_partitions(scenario, seed)
    curves: list[Curve] = []

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        ordered = PartitionOrderedGrid(grid)
        # The runtime registers its virtual nodes while this already runs.
        placed = wait_for_nodes(ordered, scenario.fleet.parties, NODE_WAIT_S)
        if placed < scenario.fleet.parties:
            raise RuntimeError(
                f"only {placed} of {scenario.fleet.parties} simulated parties joined the "
                f"Flower simulation within {NODE_WAIT_S:.0f}s"
            )
        for name in strategy_names:
            curves.append(drive(scenario, name, seed, ordered, data, progress))

    # The parties' DP ledgers (one job per strategy run, so runs never share a budget).
    with tempfile.TemporaryDirectory(prefix="fedge-ledgers-") as ledgers:
        config = run_config(scenario, seed, ledgers)
        launch_simulation(
            server_app,
            client_app,
            scenario.fleet.parties,
            config,
            num_cpus=num_cpus,
            ray_address=ray_address,
        )
    if len(curves) != len(strategy_names):
        raise RuntimeError(
            f"the Flower simulation of {', '.join(strategy_names)} (seed {seed}) returned "
            f"{len(curves)} curves"
        )
    return curves
