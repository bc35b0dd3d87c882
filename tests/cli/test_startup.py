"""``fedge`` starts on an inference-only station: no training module at start-up.

``pip install 'fedge[agent]'`` brings neither torch, Flower, ONNX, scikit-learn nor
matplotlib, so the CLI must not import them until a command that needs them runs. Each
check runs in a fresh interpreter where importing those modules fails, as it would there.
"""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

TRAINING = ("torch", "flwr", "onnx", "ray", "sklearn", "matplotlib")
BLOCK = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in TRAINING)
HELP = [
    ["--help"],
    ["--version"],
    ["agent", "--help"],
    ["agent", "run", "--help"],
    ["agent", "score", "--help"],
    ["agent", "label", "--help"],
    ["agent", "install-service", "--help"],
    ["manager", "--help"],
    ["edge", "--help"],
    ["model", "--help"],
    ["labels", "--help"],
    ["predictions", "--help"],
    ["predictions", "list", "--help"],
    ["quickstart", "--help"],
    ["bench", "--help"],
    ["aggregator", "--help"],
    ["deploy", "--help"],
    ["sim", "--help"],
    ["demo", "--help"],
    ["console", "--help"],
    ["console", "token", "--help"],
    ["jobs", "--help"],
    ["jobs", "submit", "--help"],
    ["jobs", "run", "--help"],
]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_importing_the_cli_imports_no_training_module() -> None:
    result = _python(
        "import json, sys\n"
        "import fedge.cli.main\n"
        f"print(json.dumps([m for m in {TRAINING!r} if m in sys.modules]))\n"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_every_help_works_without_the_training_stack() -> None:
    result = _python(
        BLOCK + "import json\n"
        "from typer.testing import CliRunner\n"
        "from fedge.cli.main import app\n"
        f"args = {HELP!r}\n"
        "codes = {' '.join(a): CliRunner().invoke(app, a).exit_code for a in args}\n"
        "print(json.dumps(codes))\n"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {" ".join(args): 0 for args in HELP}


def test_a_training_command_without_the_training_stack_is_one_red_line() -> None:
    result = _python(
        BLOCK + "from typer.testing import CliRunner\n"
        "from fedge.cli.main import app\n"
        "invoked = CliRunner().invoke(app, ['sim', '--scenario', 'tifl-digits'])\n"
        "print(invoked.exit_code)\n"
        "print(' '.join(invoked.output.split()))\n"
    )
    assert result.returncode == 0, result.stderr
    code, line = result.stdout.splitlines()
    assert code == "1"
    assert line.startswith("error: this command needs ")
    assert line.endswith("install the training side with: pip install 'fedge[train]'")


def test_queueing_a_fleet_job_imports_neither_torch_nor_opacus() -> None:
    """`fedge jobs submit --manifest` checks the manifest (Flower's strategies, the privacy
    accountant's plan) but runs no model: torch and Opacus are for the job's run."""
    result = _python(
        "import json, sys\n"
        "from fedge.federation.link_jobs import queue_fleet_job\n"
        "from fedge.privacy import accounting\n"
        "print(json.dumps([m for m in ('torch', 'opacus') if m in sys.modules]))\n"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
