"""Cloud -> edge distillation: the Hinton loss, proxy checks, ONNX export into the agent path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.datasets.tables import load_dataset
from fedge.edge_agent.inference import runtime
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.edge_manager.registry.versions import Registry
from fedge.edge_manager.store import Store
from fedge.models import digits
from fedge.models.distill import (
    CLASS_NAMES,
    INPUT_NAME,
    OUTPUT_NAME,
    DistillStats,
    ProxyError,
    check_proxy,
    distill,
    distillation_loss,
    export_student_onnx,
    teacher_logits,
)
from fedge.models.inspection import cpu_threads
from fedge.party import trainer
from fedge.sim.data import source as data_source
from fedge.sim.scenario import load_scenario
from fedge.students.edge import (
    Teacher,
    load_teacher,
    resolve_teacher,
    save_teacher,
    shifted_proxy,
)

FloatArray = npt.NDArray[np.float32]
LabelArray = npt.NDArray[np.int64]


@pytest.fixture(scope="module")
def problem() -> tuple[nn.Module, FloatArray, FloatArray, LabelArray]:
    """A trained ``mlp`` teacher, an unlabeled proxy set and a labeled test set (seeded)."""
    X, y = load_dataset()
    order = np.random.default_rng(0).permutation(len(y))
    train, proxy, test = order[:800], order[800:1100], order[1100:]
    teacher = digits.make_model("mlp", seed=0)
    settings = trainer.TrainSettings(
        lr=0.1, epochs=20, batch_size=32, max_seconds=None, threads=None, optimizer="sgd"
    )
    trainer.train(teacher, trainer.Examples(X[train], y[train]), settings, on=torch.device("cpu"))
    return teacher, np.array(X[proxy]), np.array(X[test]), np.array(y[test])


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------- the loss


def test_distillation_loss_is_hinton_kl_times_t_squared() -> None:
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(5, 10, generator=gen), torch.randn(5, 10, generator=gen)
    for temperature in (1.0, 4.0):
        p_t = torch.softmax(teacher / temperature, dim=1)
        p_s = torch.softmax(student / temperature, dim=1)
        expected = (p_t * (p_t.log() - p_s.log())).sum(dim=1).mean() * temperature**2
        actual = distillation_loss(student, teacher, temperature)
        assert float(actual) == pytest.approx(float(expected), rel=1e-5)
    assert float(distillation_loss(teacher, teacher, 2.0)) == pytest.approx(0.0, abs=1e-6)


def test_an_ensemble_teacher_averages_logits() -> None:
    a, b = digits.make_model("mlp", seed=1), digits.make_model("mlp-small", seed=2)
    X = torch.rand(4, 64)
    with torch.no_grad():
        expected = (a(X) + b(X)) / 2
    assert torch.allclose(teacher_logits([a, b], X), expected, atol=1e-6)
    assert torch.allclose(teacher_logits(lambda x: a(x), X), teacher_logits(a, X))


# ---------------------------------------------------------------- distillation works


@pytest.mark.slow
def test_distillation_improves_the_student_without_labels(
    problem: tuple[nn.Module, FloatArray, FloatArray, LabelArray],
) -> None:
    teacher, proxy_X, test_X, test_y = problem
    teacher_acc = digits.accuracy(teacher, test_X, test_y, device="cpu")
    student = digits.make_model("mlp-small", seed=0)
    before = digits.accuracy(student, test_X, test_y, device="cpu")
    stats: list[DistillStats] = []
    returned = distill(
        teacher, student, proxy_X, epochs=150, lr=1e-2, batch_size=32, temperature=4.0,
        seed=0, stats=stats,
    )  # fmt: skip
    after = digits.accuracy(student, test_X, test_y, device="cpu")
    assert returned is student
    assert teacher_acc > 0.9
    assert after > before + 0.5, (before, after)
    assert after > teacher_acc - 0.05, (teacher_acc, after)
    assert stats[0].last_epoch_loss < 0.1 * stats[0].first_epoch_loss


@pytest.mark.slow
def test_distill_is_deterministic_for_a_seed(
    problem: tuple[nn.Module, FloatArray, FloatArray, LabelArray],
) -> None:
    teacher, proxy_X, _, _ = problem
    runs = []
    for _ in range(2):
        student = digits.make_model("mlp-small", seed=3)
        distill(teacher, student, proxy_X[:64], epochs=3, lr=1e-2, batch_size=16,
                temperature=2.0, seed=7)  # fmt: skip
        runs.append(_weights(student))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


# ---------------------------------------------------------------- bad proxy sets


@pytest.mark.parametrize(
    ("proxy", "message"),
    [
        (np.zeros((0, 64), dtype=np.float32), "empty"),
        (np.zeros(64, dtype=np.float32), "2-D"),
        (np.zeros((8, 8, 8), dtype=np.float32), "2-D"),
        (np.zeros((10, 32), dtype=np.float32), "32 features"),
        (np.zeros((10, 64), dtype=np.int64), "dtype int64"),
        (np.full((10, 64), np.nan, dtype=np.float32), "NaN"),
        ([[0.0] * 64], "numpy array"),
    ],
)
def test_a_bad_proxy_set_fails_before_any_training(proxy: object, message: str) -> None:
    calls: list[int] = []
    teacher = digits.make_model("mlp", seed=0)

    def counting_teacher(x: torch.Tensor) -> torch.Tensor:
        calls.append(len(x))
        logits: torch.Tensor = teacher(x)
        return logits

    student = digits.make_model("mlp-small", seed=0)
    before = _weights(student)
    with pytest.raises(ProxyError, match=message):
        distill(counting_teacher, student, proxy, epochs=5, lr=1e-2, batch_size=4,  # type: ignore[arg-type]
                temperature=4.0, seed=0)  # fmt: skip
    assert calls == []  # the teacher was never asked
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(student), strict=True))
    with pytest.raises(ProxyError, match=message):
        check_proxy(proxy, 64)


def test_the_loop_takes_any_sample_shape_given_input_shape() -> None:
    """Images go through the same loop as feature vectors (the inspection student's path)."""
    teacher = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3))
    student = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 36, 3))
    images = np.random.default_rng(0).random((48, 1, 8, 8), dtype=np.float32)
    stats: list[DistillStats] = []
    with cpu_threads(1):  # tiny ops: two contended threads cost more than they give
        distill(teacher, student, images, epochs=20, lr=1e-2, batch_size=8, temperature=2.0,
                seed=0, stats=stats, input_shape=(1, 8, 8))  # fmt: skip
    assert stats[0].last_epoch_loss < 0.5 * stats[0].first_epoch_loss, stats
    # Without input_shape the sample shape comes from the first linear layer (72
    # features), which images do not fit: refused before training, naming both shapes.
    with pytest.raises(ProxyError, match=r"must be 2-D \[samples, 72\], got shape \(48, 1, 8, 8\)"):
        distill(teacher, student, images, epochs=1)
    with pytest.raises(
        ProxyError, match=r"samples have shape \(1, 8, 8\), the models take \(1, 4, 4\)"
    ):
        check_proxy(images, (1, 4, 4))
    check_proxy(images, (1, 8, 8))
    check_proxy(images[:, 0, 0], 8)  # an int and a 1-tuple mean the same
    check_proxy(images[:, 0, 0], (8,))
    with pytest.raises(ValueError, match="positive sizes"):
        check_proxy(images, (1, 0, 8))


def test_teacher_logits_in_chunks_match_one_pass() -> None:
    teacher = digits.make_model("mlp", seed=5)
    X = torch.rand(2500, 64)  # more than one 1,024-sample chunk, and a partial last one
    with torch.no_grad():
        expected = teacher(X)
    actual = teacher_logits(teacher, X)
    assert actual.shape == (2500, 10)
    assert torch.allclose(actual, expected, atol=1e-5)
    assert teacher_logits(teacher, X[:0]).shape == (0, 10)


def test_check_proxy_accepts_the_scenario_proxy_split() -> None:
    from fedge.sim.data import make_partitions

    check_proxy(make_partitions(load_scenario("tifl-digits"), 0).proxy_X, 64)


# ---------------------------------------------------------------- ONNX on the edge path


@pytest.mark.slow
def test_exported_student_runs_in_the_agent_runtime_with_torch_decisions(
    problem: tuple[nn.Module, FloatArray, FloatArray, LabelArray], tmp_path: Path
) -> None:
    teacher, proxy_X, _, _ = problem
    student = digits.make_model("mlp-small", seed=0)
    distill(teacher, student, proxy_X, epochs=30, lr=1e-2, batch_size=32, temperature=4.0,
            seed=0)  # fmt: skip
    onnx_path = tmp_path / "student.onnx"
    check = export_student_onnx(student, onnx_path, verify_X=proxy_X)
    assert check.probs_max_abs_diff <= 1e-4 and check.logits_max_abs_diff <= 1e-4
    assert check.samples == len(proxy_X)

    home = ManagerHome(tmp_path / "home")
    home.init(ManagerSettings("distill"))
    registry = Registry(Store(home.db_path), home.artifacts, home.signing_key())
    published = registry.publish(onnx_path, name="digits-student", version=1)
    manifest = published.manifest
    assert manifest.classes == CLASS_NAMES  # from the ONNX metadata
    assert manifest.inputs[0].name == INPUT_NAME and manifest.outputs[0].name == OUTPUT_NAME

    loaded = runtime.load(published.path, manifest)
    runtime.smoke_test(loaded)
    for batch in (proxy_X[:1], proxy_X):  # the batch axis is dynamic
        probs = loaded.run(np.ascontiguousarray(batch, dtype=np.float32))
        assert probs.shape == (len(batch), 10)
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
        with torch.no_grad():
            expected = student(torch.tensor(batch)).argmax(dim=1).numpy()
        np.testing.assert_array_equal(probs.argmax(axis=1), expected)


# ---------------------------------------------------------------- teachers and the CLI


def test_teacher_files_round_trip_and_bad_specs_are_clear(tmp_path: Path) -> None:
    model = digits.make_model("mlp", seed=4)
    save_teacher(Teacher(model, "mlp", "a test teacher"), tmp_path / "t.pt")
    loaded = load_teacher(tmp_path / "t.pt")
    assert loaded.arch == "mlp" and loaded.description.startswith("a test teacher")
    for a, b in zip(model.state_dict().values(), loaded.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    scenario = data_source(load_scenario("tifl-digits"), 0)
    from fedge.students.edge import TeacherError

    with pytest.raises(TeacherError, match="does not exist"):
        resolve_teacher(str(tmp_path / "missing.pt"), scenario)
    with pytest.raises(TeacherError, match="neither a job directory, a teacher file"):
        resolve_teacher("mlp-huge", scenario)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(TeacherError, match="cannot read"):
        load_teacher(tmp_path / "junk.pt")


@pytest.mark.slow
def test_cli_train_teacher_then_distill_and_publish(tmp_path: Path) -> None:
    runner = CliRunner()
    teacher_path = tmp_path / "teacher.pt"
    result = runner.invoke(
        app, ["model", "train-teacher", "--arch", "mlp", "--out", str(teacher_path)]
    )
    assert result.exit_code == 0, result.output
    assert teacher_path.exists()

    home = tmp_path / "home"
    ManagerHome(home).init(ManagerSettings("distill"))
    student_path = tmp_path / "student.onnx"
    args = ["model", "distill", "--teacher", str(teacher_path), "--out", str(student_path)]
    args += ["--publish", "--name", "digits-student", "--version", "1", "--home", str(home)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "fewer" in result.output and "published" in result.output
    assert "digits-student:1" in result.output

    from fedge.cli.common import open_fleet

    _, fleet = open_fleet(home)
    lineage = fleet.registry.get("digits-student", 1).manifest.lineage
    assert lineage.parent_version is None
    assert lineage.run_id is not None and lineage.run_id.startswith("mlp trained on pooled")
    assert lineage.data == "proxy split of tifl-digits seed 0 with one-pixel shifts"
    assert lineage.note.startswith("distilled from mlp trained") and "(T=4)" in lineage.note

    # --publish without --version takes the next free version (issue 15: the README's
    # digits line used to fail with "--publish needs --version N")
    result = runner.invoke(
        app, [*args[:6], "--publish", "--name", "digits-student", "--home", str(home)]
    )
    assert result.exit_code == 0, result.output
    assert "digits-student:2" in result.output


def test_the_transfer_set_adds_one_pixel_shifts_of_each_digit() -> None:
    digits_X = (np.arange(2 * 64).reshape(2, 64) / 128 + 0.01).astype(np.float32)
    transfer = shifted_proxy(digits_X)
    assert transfer.shape == (10, 64) and transfer.dtype == np.float32
    np.testing.assert_array_equal(transfer[:2], digits_X)  # the originals come first
    images = digits_X.reshape(2, 8, 8)
    right = transfer[2:4].reshape(2, 8, 8)  # SHIFTS[0]: one column to the right
    np.testing.assert_array_equal(right[:, :, 1:], images[:, :, :-1])
    assert not right[:, :, 0].any()  # the column that opens is blank, nothing wraps
    down = transfer[6:8].reshape(2, 8, 8)  # SHIFTS[2]: one row down
    np.testing.assert_array_equal(down[:, 1:, :], images[:, :-1, :])
    assert not down[:, 0, :].any()


def test_a_finished_federated_job_is_a_teacher(tmp_path: Path) -> None:
    from fedge.aggregator.jobs.checkpoint import load_arrays
    from fedge.aggregator.jobs.directory import FINAL_MODEL
    from fedge.sim.jobs import run_job
    from fedge.students.edge import TeacherError, distill_student

    manifest = tmp_path / "job.toml"
    manifest.write_text(
        '[job]\nname = "teacher"\nrounds = 2\nseed = 0\n'
        '[task]\nscenario = "tifl-digits"\narch = "mlp-large"\n'
        '[strategy]\nkind = "fedavg"\n'
    )
    scenario = data_source(load_scenario("tifl-digits"), 0)
    with pytest.raises(TeacherError, match="holds no finished job"):
        resolve_teacher(str(tmp_path), scenario)  # a directory, but no job in it
    job_dir = tmp_path / "job"
    run_job(manifest, job_dir)
    teacher = resolve_teacher(str(job_dir), scenario)
    assert teacher.arch == "mlp-large" and "federated job" in teacher.description
    final = load_arrays(job_dir / FINAL_MODEL)
    for key, value in teacher.model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), final[key])
    _, report = distill_student(teacher, scenario, epochs=2)
    assert report.teacher_arch == "mlp-large" and report.student_params < report.teacher_params


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--task", "inspection", "--teacher", "inspect:1", "--arch", "mlp"], "--task digits"),
        (["--task", "inspection", "--teacher", "inspect:1", "--scenario", "x"], "--task digits"),
        (["--teacher", "mlp-large", "--proxy-images", "10"], "--task inspection"),
    ],
)
def test_distill_refuses_options_of_the_other_task(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = CliRunner().invoke(
        app, ["model", "distill", *args, "--home", str(tmp_path / "home")], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "home").exists()  # refused before anything was opened
