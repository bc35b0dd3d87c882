"""An inference-only station, installed as one would be: ``pip install 'fedge[agent]'``.

A fresh virtualenv (no system site-packages) gets this checkout with only the ``agent``
extra. Its ``fedge`` must start without torch, Flower, ONNX, scikit-learn or matplotlib
-- none of which may be importable there -- and its agent must take a deployment from a
real manager (Mosquitto + :class:`ManagerService` from the test environment) and serve a
prediction over its local API, with neither torch nor flwr loaded.

The checkout is copied first (sources, pyproject.toml, README.md): pip builds a local
directory in place, which would leave ``build/`` and ``*.egg-info`` in the work tree.
"""

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    Proc,
    Processes,
    agent_status,
    deploy,
    free_port,
    make_fleet_home,
    prediction_for,
    publish_model,
    wait_deploy_done,
    wait_until,
    write_images,
)

from fedge.edge_manager.serve import ManagerService

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
EDGE = "st-01"
TRAINING_STACK = ("torch", "flwr", "onnx", "ray", "sklearn", "matplotlib")


def station_env() -> dict[str, str]:
    """This process's environment without what points Python at other packages.

    Flower's Ray backend, run in-process by the simulation tests, sets PYTHONPATH in
    ``os.environ``; inherited, it would show the station's Python the test venv's torch.
    """
    hidden = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    return {key: value for key, value in os.environ.items() if key not in hidden}


def _run(*args: str | Path, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(arg) for arg in args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env=station_env(),
    )
    assert result.returncode == 0, (
        f"`{' '.join(map(str, args))}` exited {result.returncode}\n"
        f"stdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-2000:]}"
    )
    return result


@pytest.fixture(scope="module")
def station_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with ``fedge[agent]`` installed from a copy of this checkout."""
    root = tmp_path_factory.mktemp("station")
    source = root / "fedge-src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(
        REPO / "src",
        source / "src",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
    )
    venv = root / "venv"
    _run(sys.executable, "-m", "venv", venv)
    _run(
        venv / "bin" / "pip",
        "install",
        "--no-input",
        "--disable-pip-version-check",
        f"{source}[agent]",
        timeout_s=240,
    )
    return venv


def test_the_agent_extra_installs_no_training_stack(station_venv: Path) -> None:
    python = station_venv / "bin" / "python"
    found = _run(
        python,
        "-c",
        "import importlib.util, json\n"
        f"names = {TRAINING_STACK!r}\n"
        "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in names}))",
    )
    assert json.loads(found.stdout) == dict.fromkeys(TRAINING_STACK, False)
    where = _run(python, "-c", "import fedge; print(fedge.__file__)")
    assert Path(where.stdout.strip()).is_relative_to(station_venv), "fedge is the venv's copy"
    for args in (["--help"], ["agent", "run", "--help"], ["agent", "install-service", "--help"]):
        _run(station_venv / "bin" / "fedge", *args)


@pytest.fixture
def plant(tmp_path: Path) -> Iterator[tuple[Any, int]]:
    """A manager home with st-01 enrolled (local API on), its broker and service running."""
    fh = make_fleet_home(tmp_path, edges=(EDGE,))
    http_port = free_port()
    fh.set_agent_option(EDGE, "http_port", http_port)
    broker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    try:
        service.start()
        yield fh, http_port
    finally:
        service.stop()
        broker.stop()
        fh.close()


def test_an_agent_from_the_station_venv_serves_a_prediction(
    station_venv: Path, plant: tuple[Any, int], tmp_path: Path
) -> None:
    fh, http_port = plant
    config = fh.agents[EDGE]
    fedge = station_venv / "bin" / "fedge"
    processes = Processes(tmp_path / "logs")
    out, err = tmp_path / "logs" / "agent.out", tmp_path / "logs" / "agent.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        popen = subprocess.Popen(
            [str(fedge), "agent", "run", "--config", str(config)],
            stdout=stdout,
            stderr=stderr,
            env={**station_env(), "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    agent = Proc(EDGE, ("agent", "run"), popen, out, err)
    processes.procs.append(agent)
    try:
        publish_model(fh, 1)
        wait_until(
            lambda: agent_status(http_port)["connected"], 30, "the station's agent to connect"
        )
        row = wait_deploy_done(fh, deploy(fh, 1, [EDGE]), EDGE)
        assert (row["deploy_stage"], row["serving"]) == ("active", "inspect:1"), agent.output()

        (image,) = write_images(tmp_path / "camera", ["part-0001.png"])
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/score",
            data=image.read_bytes(),
            headers={"Content-Type": "image/png", "X-Source": "camera:part-0001"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            record = json.loads(response.read())
        assert record["model"] == "inspect:1"
        assert record["decision"] in ("accept", "reject")
        stored = prediction_for(fh, EDGE, "camera:part-0001")
        assert stored["prediction_id"] == record["prediction_id"]

        status = agent_status(http_port)
        assert status["imported"] == {"torch": False, "flwr": False}
        assert agent.running(), agent.output()

        unit = _run(fedge, "agent", "install-service", "--config", config, "--out", "-").stdout
        assert f"ExecStart={fedge} agent run --config {config}\n" in unit
    finally:
        processes.close()
