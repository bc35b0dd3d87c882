"""`fedge bench gpu` (issue 25): a clear refusal without a GPU, the figures with one.

CI machines have no GPU, so there the refusal is what is checked; on a GPU machine the
same test checks the JSON's shape and that a CUDA provider or device was actually used."""

from __future__ import annotations

import onnxruntime as ort
import pytest
import torch
from typer.testing import CliRunner

from fedge.bench.errors import BenchError
from fedge.bench.gpu import CUDA_PROVIDER, run_gpu_check
from fedge.cli.main import app

HAS_GPU = torch.cuda.is_available() or CUDA_PROVIDER in ort.get_available_providers()


def test_the_check_says_plainly_when_there_is_no_gpu() -> None:
    if HAS_GPU:
        result = run_gpu_check(images=64, train_images=64, epochs=1, repeats=1)
        assert result["inference"]["batched"]["cpu_ms_per_image"] > 0
        if torch.cuda.is_available():
            assert result["training"]["gpu_seconds_per_round"] > 0
        return
    with pytest.raises(BenchError, match="no GPU here"):
        run_gpu_check(images=64, train_images=64, epochs=1, repeats=1)
    outcome = CliRunner().invoke(app, ["bench", "gpu"])
    assert outcome.exit_code == 1
    assert "no GPU here" in outcome.output
