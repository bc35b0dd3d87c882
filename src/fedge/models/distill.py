"""Cloud -> edge knowledge transfer: distil a (large, or ensemble) teacher into a small student.

KnowledgeNet-style: the cloud holds a big model (or several, e.g. the clients of a FedDF
round), the edge can only afford a small one. The student learns to match the teacher's
softened output on the server's **unlabeled** proxy split; proxy labels are never read
(FedDF, Lin et al. 2020; ../shared/research/fl-algorithms.md section 5).

* :func:`distillation_loss` is Hinton et al. 2015's soft-target loss,
  ``T^2 * KL(softmax(z_t / T) || softmax(z_s / T))`` (the ``T^2`` keeps the gradient scale
  fixed as ``T`` changes; section 5.4 of the note).
* :func:`distill` averages the logits of an ensemble of teachers (FedDF's ``avg_logits``),
  computes them once on the proxy set (the teacher is frozen), then trains the student
  with Adam on minibatches of the proxy set. The loop does not care what a sample is: a
  digits feature vector (``input_shape=(64,)``) or an inspection image
  (``input_shape=(1, 32, 32)``, :mod:`fedge.students.inspection`) go the same way.
* :func:`export_student_onnx` writes the edge contract: ``input`` float32 ``[batch, 64]``
  -> ``probs`` float32 ``[batch, 10]`` (softmax in the graph), ONNX metadata ``classes`` =
  ``0,...,9``, and checks it against torch with ONNX Runtime, both the exported ``probs``
  and the logits path.
"""

from __future__ import annotations

import copy
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from fedge.models.digits import N_CLASSES, N_FEATURES
from fedge.models.errors import ModelsError

INPUT_NAME = "input"
OUTPUT_NAME = "probs"
OPSET_VERSION = 17
VERIFY_TOLERANCE = 1e-4
CLASS_NAMES: tuple[str, ...] = tuple(str(digit) for digit in range(N_CLASSES))

TeacherFn = Callable[[torch.Tensor], torch.Tensor]
"""Maps a float32 ``[batch, features]`` tensor to teacher logits ``[batch, classes]``."""
Teacher = TeacherFn | nn.Module | Sequence[nn.Module]


class ProxyError(ModelsError, ValueError):
    """The proxy (transfer) set cannot be used for distillation."""


class DistillExportError(ModelsError):
    """The student's ONNX export failed or disagrees with torch."""


InputShape = tuple[int, ...]
"""The shape of one sample, without the batch axis: ``(64,)`` for digits, ``(1, 32, 32)``
for an inspection image."""


def check_proxy(proxy_X: object, input_shape: int | InputShape = N_FEATURES) -> None:
    """Raise :class:`ProxyError` unless ``proxy_X`` is a non-empty float ``[n, *input_shape]``.

    ``input_shape`` is one sample's shape; a bare int ``d`` means ``(d,)`` (feature vectors).
    """
    shape = _as_shape(input_shape)
    expected = f"[samples, {', '.join(str(d) for d in shape)}]"
    if not isinstance(proxy_X, np.ndarray):
        raise ProxyError(
            f"the proxy set must be a numpy array {expected}, got {type(proxy_X).__name__}; "
            "pass the unlabeled proxy inputs (e.g. Partitions.proxy_X)"
        )
    if proxy_X.ndim != len(shape) + 1:
        raise ProxyError(
            f"the proxy set must be {len(shape) + 1}-D {expected}, got shape {proxy_X.shape}"
        )
    if tuple(proxy_X.shape[1:]) != shape:
        if len(shape) == 1:
            raise ProxyError(
                f"the proxy set has {proxy_X.shape[1]} features per sample, the models take "
                f"{shape[0]} (shape {proxy_X.shape})"
            )
        raise ProxyError(
            f"the proxy set's samples have shape {tuple(proxy_X.shape[1:])}, the models take "
            f"{shape} (shape {proxy_X.shape})"
        )
    if proxy_X.shape[0] == 0:
        raise ProxyError(
            "the proxy set is empty: nothing to distil on; give it at least one sample "
            "(for a scenario: data.proxy_fraction > 0)"
        )
    if not np.issubdtype(proxy_X.dtype, np.floating):
        hint = "; scale uint8 images by 1/255" if proxy_X.dtype == np.uint8 else ""
        raise ProxyError(
            f"the proxy set must hold floats in [0, 1] (float32), got dtype {proxy_X.dtype}{hint}"
        )
    if not np.all(np.isfinite(proxy_X)):
        raise ProxyError("the proxy set holds NaN or infinite values")


def _as_shape(input_shape: int | InputShape) -> InputShape:
    shape = (input_shape,) if isinstance(input_shape, int) else tuple(input_shape)
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"a sample shape needs positive sizes, got {input_shape!r}")
    return shape


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Hinton et al. 2015: ``T^2 * KL(softmax(t/T) || softmax(s/T))``, mean over the batch."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_student = torch.log_softmax(student_logits / temperature, dim=1)
    log_teacher = torch.log_softmax(teacher_logits / temperature, dim=1)
    kl = nn.functional.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True)
    return kl * temperature**2


def teacher_logits(teacher: Teacher, X: torch.Tensor) -> torch.Tensor:
    """The teacher's logits on ``X``; an ensemble gives the mean of its members' logits.

    ``X`` is fed in chunks of 1,024 samples: a CNN teacher's activations on thousands of
    proxy images at once would take gigabytes, and in eval mode the result per sample does
    not depend on the chunking.
    """
    if not isinstance(teacher, nn.Module) and isinstance(teacher, Sequence) and not teacher:
        raise ValueError("the teacher ensemble is empty")
    chunks = [
        _teacher_logits(teacher, X[start : start + _TEACHER_CHUNK])
        for start in range(0, X.shape[0], _TEACHER_CHUNK)
    ]
    return torch.cat(chunks) if chunks else _teacher_logits(teacher, X)


_TEACHER_CHUNK = 1024


def _teacher_logits(teacher: Teacher, X: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(teacher, nn.Module):
            teacher.eval()
            logits: torch.Tensor = teacher(X)
            return logits.detach()
        if isinstance(teacher, Sequence):
            outputs = []
            for member in teacher:
                member.eval()
                outputs.append(member(X).detach())
            return torch.stack(outputs).mean(dim=0)
        return teacher(X).detach()


@dataclass(frozen=True)
class DistillStats:
    """Mean distillation loss of the first and the last epoch."""

    first_epoch_loss: float
    last_epoch_loss: float


def distill(
    teacher: Teacher,
    student: nn.Module,
    proxy_X: npt.NDArray[np.floating],
    *,
    epochs: int = 200,
    lr: float = 3e-3,
    batch_size: int = 32,
    temperature: float = 4.0,
    seed: int = 0,
    stats: list[DistillStats] | None = None,
    input_shape: int | InputShape | None = None,
) -> nn.Module:
    """Train ``student`` in place (on the CPU) to match ``teacher`` on ``proxy_X``; return it.

    ``teacher`` is a logits function, one model, or a sequence of models whose logits are
    averaged. Only ``proxy_X`` is used: there are no labels. The proxy set is checked
    against ``input_shape`` (one sample's shape; default: the ``in_features`` of the
    student's first linear layer, right for the digits MLPs) before anything is trained
    (:class:`ProxyError`). Adam, minibatches shuffled with ``seed``; the student is left
    in eval mode. If ``stats`` is given, a :class:`DistillStats` is appended to it.
    """
    check_proxy(proxy_X, _input_dim(student) if input_shape is None else input_shape)
    if epochs < 1 or batch_size < 1 or lr <= 0 or temperature <= 0:
        raise ValueError(
            "distill needs epochs >= 1, batch_size >= 1, lr > 0, temperature > 0; got "
            f"epochs={epochs}, batch_size={batch_size}, lr={lr}, temperature={temperature}"
        )
    features = torch.tensor(np.asarray(proxy_X, dtype=np.float32))
    targets = teacher_logits(teacher, features)
    if targets.ndim != 2 or targets.shape[0] != features.shape[0]:
        raise ValueError(
            f"teacher logits have shape {tuple(targets.shape)}, expected [{features.shape[0]}, k]"
        )
    student.to(torch.device("cpu"))
    student.train()
    optimizer = torch.optim.Adam(student.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    n = features.shape[0]
    epoch_losses: list[float] = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        total = 0.0
        for start in range(0, n, batch_size):
            batch = order[start : start + batch_size]
            optimizer.zero_grad()
            loss = distillation_loss(student(features[batch]), targets[batch], temperature)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            total += float(loss.detach()) * len(batch)
        epoch_losses.append(total / n)
    student.eval()
    if stats is not None:
        stats.append(DistillStats(epoch_losses[0], epoch_losses[-1]))
    return student


def _input_dim(model: nn.Module) -> int:
    """Features the model takes: the ``in_features`` of its first linear layer (else 64)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            return int(module.in_features)
    return N_FEATURES


class _Probabilities(nn.Module):
    """Wraps a logits model so the exported graph outputs softmax probabilities."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.net(x), dim=1)


@dataclass(frozen=True)
class ExportCheck:
    """Max |ORT - torch| over the verification set, for the probs and the logits graph."""

    probs_max_abs_diff: float
    logits_max_abs_diff: float
    samples: int


def export_student_onnx(
    model: nn.Module,
    path: Path,
    input_dim: int = N_FEATURES,
    *,
    verify_X: npt.NDArray[np.floating] | None = None,
) -> ExportCheck:
    """Export ``model`` as ``input`` float32 ``[batch, input_dim]`` -> ``probs`` and verify it.

    The graph holds the softmax, has a dynamic batch axis and the ONNX metadata
    ``classes = 0,...,9`` (so the registry knows the class names). Verification runs the
    file with ONNX Runtime on ``verify_X`` (the proxy set; default: 64 seeded random
    inputs plus a constant one) and compares with torch: the exported ``probs`` and, via
    a second, temporary export without the softmax, the logits. Either difference above
    1e-4 raises :class:`DistillExportError` (the file is left in place for inspection).
    """
    net = copy.deepcopy(model).cpu().eval()
    probs_model = _Probabilities(net).eval()
    if verify_X is None:
        rng = np.random.default_rng(0)
        verify_X = np.concatenate(
            [
                rng.random((64, input_dim), dtype=np.float32),
                np.full((1, input_dim), 0.5, dtype=np.float32),
            ]
        )
    check_proxy(verify_X, input_dim)
    probe = np.ascontiguousarray(verify_X, dtype=np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    _export(probs_model, path, input_dim, OUTPUT_NAME, metadata={"classes": ",".join(CLASS_NAMES)})
    probs_diff = _max_diff(probs_model, path, probe, OUTPUT_NAME)
    with tempfile.TemporaryDirectory() as tmp:
        logits_path = Path(tmp) / "logits.onnx"
        _export(net, logits_path, input_dim, "logits", metadata={})
        logits_diff = _max_diff(net, logits_path, probe, "logits")
    for what, diff in (("probs", probs_diff), ("logits", logits_diff)):
        if diff > VERIFY_TOLERANCE:
            raise DistillExportError(
                f"exported model {path} disagrees with torch: max |diff| of the {what} = "
                f"{diff:.3g} > {VERIFY_TOLERANCE:g} on {len(probe)} samples"
            )
    return ExportCheck(probs_diff, logits_diff, len(probe))


def _export(
    module: nn.Module, path: Path, input_dim: int, output: str, metadata: dict[str, str]
) -> None:
    import onnx  # local: only needed for export

    dummy = torch.zeros(1, input_dim, dtype=torch.float32)
    try:
        # The TorchScript exporter (dynamo=False), as in fedge.models.inspection: a plain
        # opset-17 graph without onnxscript. Its deprecation notice is noise.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(
                module,
                (dummy,),
                str(path),
                dynamo=False,
                opset_version=OPSET_VERSION,
                input_names=[INPUT_NAME],
                output_names=[output],
                dynamic_axes={INPUT_NAME: {0: "batch"}, output: {0: "batch"}},
            )
        if metadata:
            proto = onnx.load(str(path))
            for key, value in metadata.items():
                entry = proto.metadata_props.add()
                entry.key, entry.value = key, value
            onnx.save(proto, str(path))
    except Exception as exc:  # the exporter raises many unrelated types
        raise DistillExportError(f"ONNX export to {path} failed: {exc}") from exc


def _max_diff(module: nn.Module, path: Path, probe: npt.NDArray[np.float32], output: str) -> float:
    import onnxruntime as ort  # local: only needed for this check

    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        (actual,) = session.run([output], {INPUT_NAME: probe})
    except Exception as exc:
        raise DistillExportError(f"onnxruntime cannot run exported model {path}: {exc}") from exc
    with torch.no_grad():
        expected = module(torch.tensor(probe)).numpy()
    if actual.shape != expected.shape:
        raise DistillExportError(
            f"exported model {path} returned shape {actual.shape}, torch {expected.shape}"
        )
    return float(np.max(np.abs(actual - expected)))
