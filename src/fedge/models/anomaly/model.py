"""The anomaly scoring network (backbone + per-location Gaussians) and its ONNX export.

Exported contract: input ``image`` float32 ``[batch, 1, size, size]`` in [0, 1] (as the
classifier's); outputs ``score`` float32 ``[batch]`` (the largest Mahalanobis distance
over locations) and ``anomaly_map`` float32 ``[batch, h, w]`` (the distance per location
of the backbone's grid; a viewer upsamples it onto the image). With a classifier whose
feature layers are the backbone, :func:`export_with_classifier` writes one graph with
``probs`` as well, so serving makes one call for both.
"""

from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from fedge.models.anomaly import AnomalyError
from fedge.models.anomaly.backbone import feature_grid
from fedge.models.anomaly.statistics import Float64Array, GaussianFit, whitening
from fedge.models.inspection import INPUT_NAME, InspectionNet, images_to_tensor, write_onnx

SCORE_NAME = "score"
MAP_NAME = "anomaly_map"
PROBS_NAME = "probs"
_RELATIVE_TOLERANCE = 1e-4


class AnomalyExportError(AnomalyError):
    """The ONNX export failed or its outputs disagree with the torch model."""


def extract_features(
    backbone: nn.Module, images: npt.NDArray[np.generic], *, batch_size: int = 256
) -> tuple[Float64Array, tuple[int, int]]:
    """Features ``(n, L, d)`` in float64 and the grid ``(h, w)`` for uint8 or [0, 1] images."""
    x_all = images_to_tensor(images)
    backbone.eval()
    chunks: list[Float64Array] = []
    grid = (0, 0)
    with torch.no_grad():
        for start in range(0, x_all.shape[0], batch_size):
            fmap = backbone(x_all[start : start + batch_size])
            n, dims, height, width = fmap.shape
            grid = (int(height), int(width))
            chunks.append(fmap.reshape(n, dims, height * width).permute(0, 2, 1).double().numpy())
    if not chunks:
        _, height, width = feature_grid(backbone, int(x_all.shape[-1]))
        return np.zeros((0, height * width, 0)), (height, width)
    return np.concatenate(chunks, axis=0), grid


class AnomalyNet(nn.Module):
    """``image -> (score, anomaly_map)``: the backbone, then Mahalanobis per location."""

    mean: torch.Tensor
    white_t: torch.Tensor

    def __init__(self, backbone: nn.Module, model: GaussianFit) -> None:
        super().__init__()
        self.backbone = backbone
        self.grid: tuple[int, int] = model.grid
        self.register_buffer("mean", torch.from_numpy(model.mean.astype(np.float32)))
        white = whitening(model).astype(np.float32)
        # Transposed once here so forward is one batched matmul per location.
        self.register_buffer(
            "white_t", torch.from_numpy(np.ascontiguousarray(white.transpose(0, 2, 1)))
        )

    def distances(self, fmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, dims = fmap.shape[0], fmap.shape[1]
        locations = self.grid[0] * self.grid[1]
        per_location = fmap.reshape(batch, dims, locations).permute(2, 0, 1)  # (L, B, d)
        z = torch.matmul(per_location - self.mean.unsqueeze(1), self.white_t)
        dist = torch.sqrt(torch.sum(z * z, dim=2)).transpose(0, 1)  # (B, L)
        score = torch.amax(dist, dim=1)
        return score, dist.reshape(batch, self.grid[0], self.grid[1])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.distances(self.backbone(x))


class ClassifierWithAnomaly(nn.Module):
    """The inspection CNN and an anomaly model in one graph: one call serves both.

    The default backbone reads the image at another scale than the classifier (see
    :class:`~fedge.models.anomaly.backbone.InspectionBackbone`), so the two paths share
    weights but not activations; what one graph saves is the second call and its copies.
    """

    def __init__(self, net: InspectionNet, anomaly: AnomalyNet) -> None:
        super().__init__()
        self.net = net
        self.anomaly = anomaly

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.net(x), dim=1)
        score, amap = self.anomaly(x)
        return probs, score, amap


def score_images(
    net: AnomalyNet, images: npt.NDArray[np.generic]
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Scores ``(n,)`` and maps ``(n, h, w)`` from the torch model (float32, as served)."""
    x_all = images_to_tensor(images)
    scores, maps = [], []
    with torch.no_grad():
        for start in range(0, x_all.shape[0], 256):
            score, amap = net(x_all[start : start + 256])
            scores.append(score.numpy())
            maps.append(amap.numpy())
    return np.concatenate(scores), np.concatenate(maps)


def export_onnx(net: AnomalyNet, path: Path, *, image_size: int) -> float:
    """Write ``net`` as ONNX (``score``, ``anomaly_map``), check it against torch, return
    the largest relative difference seen (above 1e-4: :class:`AnomalyExportError`)."""
    return _export(net, path, image_size, (SCORE_NAME, MAP_NAME))


def export_with_classifier(net: ClassifierWithAnomaly, path: Path, *, image_size: int) -> float:
    """Write the shared-feature graph (``probs``, ``score``, ``anomaly_map``) and check it."""
    return _export(net, path, image_size, (PROBS_NAME, SCORE_NAME, MAP_NAME))


def _export(module: nn.Module, path: Path, image_size: int, outputs: tuple[str, ...]) -> float:
    # No deep copy (the classifier's export makes one): a copied TorchScript submodule is
    # no longer "part of the active trace". The export reads the weights, never writes.
    wrapped = module.cpu().eval()
    if any(isinstance(sub, torch.jit.ScriptModule) for sub in wrapped.modules()):
        # A user's loaded TorchScript backbone cannot be traced into: script the whole.
        try:
            wrapped = torch.jit.script(wrapped)
        except Exception as exc:
            raise AnomalyExportError(f"cannot script the model around the backbone: {exc}") from exc
    write_onnx(wrapped, path, image_size, outputs, AnomalyExportError)
    return _verify(wrapped, path, image_size, outputs)


def _verify(module: nn.Module, path: Path, image_size: int, outputs: tuple[str, ...]) -> float:
    import onnxruntime as ort  # local: only needed for this check

    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise AnomalyExportError(f"onnxruntime cannot load exported model {path}: {exc}") from exc
    rng = np.random.default_rng(0)
    probes = [
        rng.random((1, 1, image_size, image_size), dtype=np.float32),
        rng.random((3, 1, image_size, image_size), dtype=np.float32),
        np.full((2, 1, image_size, image_size), 0.5, dtype=np.float32),
    ]
    worst = 0.0
    for probe in probes:
        with torch.no_grad():
            expected = module(torch.from_numpy(probe))
        try:
            actual = session.run(list(outputs), {INPUT_NAME: probe})
        except Exception as exc:
            raise AnomalyExportError(f"onnxruntime failed to run {path}: {exc}") from exc
        for name, want, got in zip(outputs, expected, actual, strict=True):
            want_np = want.numpy()
            if got.shape != want_np.shape:
                raise AnomalyExportError(
                    f"{path}: output {name} has shape {got.shape}, torch {want_np.shape}"
                )
            # Distances grow with how unusual a part is: compare relative to their size.
            diff = float(np.max(np.abs(got - want_np) / np.maximum(1.0, np.abs(want_np))))
            if diff > _RELATIVE_TOLERANCE:
                raise AnomalyExportError(
                    f"exported model {path} disagrees with torch on {name}: relative "
                    f"|diff| = {diff:.3g} > {_RELATIVE_TOLERANCE:g}"
                )
            worst = max(worst, diff)
    return worst
