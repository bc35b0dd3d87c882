"""``fedge quickstart``: the walkthrough's model and images (issue 15)."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from fedge.cli.main import app

BLOCK_TORCH = "import sys\nsys.modules['torch'] = None\n"


def test_images_only_writes_named_parts_and_their_truth(tmp_path: Path) -> None:
    out = tmp_path / "starter"
    result = CliRunner().invoke(app, ["quickstart", "--out", str(out), "--images-only"])
    assert result.exit_code == 0, result.output
    parts = sorted((out / "parts").glob("*.png"))
    assert [p.name for p in parts[:2]] == ["part_00000.png", "part_00001.png"]
    assert len(parts) == 20
    with Image.open(parts[0]) as image:
        assert (image.size, image.mode) == ((32, 32), "L")
    with (out / "parts" / "truth.csv").open() as handle:
        truth = list(csv.DictReader(handle))
    assert [row["file"] for row in truth] == [p.name for p in parts]
    assert {row["class"] for row in truth} == {"clean", "scratch"}
    assert not (out / "inspect.onnx").exists()
    assert " ".join(result.output.split()) == (
        f"images 20 in {out / 'parts'} (part_00000.png ...; true classes in truth.csv)"
    )


@pytest.mark.integration
def test_the_model_without_torch_is_one_red_line(tmp_path: Path) -> None:
    code = (
        BLOCK_TORCH + "from typer.testing import CliRunner\n"
        "from fedge.cli.main import app\n"
        f"invoked = CliRunner().invoke(app, ['quickstart', '--out', {str(tmp_path)!r}])\n"
        "print(invoked.exit_code)\n"
        "print(' '.join(invoked.output.split()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    exit_code, line = result.stdout.splitlines()
    assert exit_code == "1"
    assert line.startswith("error: this command needs torch")
    assert not (tmp_path / "inspect.onnx").exists()
