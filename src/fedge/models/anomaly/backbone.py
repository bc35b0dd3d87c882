"""Feature backbones for the anomaly model: the classifier's own layers, or a user's file.

A backbone maps images ``[batch, 1, size, size]`` (pixels in [0, 1]) to a feature map
``[batch, channels, h, w]``; every one of the ``h * w`` locations gets its own Gaussian.

The default is the fleet's inspection CNN (:class:`~fedge.models.inspection.InspectionNet`)
with its head dropped: PaDiM takes the activations of the first three stages of a CNN
trained elsewhere and concatenates them per location (Defard et al., ICPR 2021, section
3.1); here the three conv stages, each average-pooled to the last stage's 8x8 grid, 80
channels at width 16. Serving then computes the features once for both models.

A user's backbone is a TorchScript file (``torch.jit.save(torch.jit.script(module))`` or
``torch.jit.trace``): it loads without the user's Python code, which a station does not
have. It is probed on one blank image of the model's size before anything is fitted.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as functional
from torch import nn

from fedge.models.anomaly import BackboneError
from fedge.models.inspection import InspectionNet


class InspectionBackbone(nn.Module):
    """The inspection CNN's feature layers: three stages concatenated on the last grid."""

    def __init__(self, net: InspectionNet) -> None:
        super().__init__()
        self.features = net.features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The same per-image centering InspectionNet.forward applies, so the layers see
        # the inputs they were trained on.
        x = x - x.mean(dim=(2, 3), keepdim=True)
        x = x / (x.std(dim=(2, 3), keepdim=True) + 1e-3)
        layers = self.features
        stage1 = layers[1](layers[0](x))
        stage2 = layers[4](layers[3](layers[2](stage1)))
        stage3 = layers[7](layers[6](layers[5](stage2)))
        # Stages 1 and 2 are 4x and 2x stage 3's grid (two 2x2 max-pools between them);
        # fixed kernels rather than adaptive pooling, which ONNX cannot export.
        return torch.cat(
            [functional.avg_pool2d(stage1, 4), functional.avg_pool2d(stage2, 2), stage3], dim=1
        )


def load_backbone(path: Path) -> nn.Module:
    """A user's TorchScript backbone from ``path`` (CPU, eval mode), or ``BackboneError``."""
    if not path.is_file():
        raise BackboneError(f"backbone file {path} does not exist; give a TorchScript file")
    try:
        module: nn.Module = torch.jit.load(  # type: ignore[no-untyped-call]
            str(path), map_location="cpu"
        )
    except Exception as exc:  # torch raises RuntimeError, ValueError, zipfile errors ...
        raise BackboneError(
            f"backbone file {path} does not load as TorchScript ({exc}); save it with "
            "torch.jit.save(torch.jit.script(module), path)"
        ) from exc
    module.eval()
    return module


def feature_grid(backbone: nn.Module, image_size: int) -> tuple[int, int, int]:
    """``(channels, h, w)`` the backbone gives for ``image_size`` images, or ``BackboneError``.

    Run on a blank image pair (batch 2, so a backbone that drops the batch axis shows).
    """
    probe = torch.full((2, 1, image_size, image_size), 0.5)
    try:
        with torch.no_grad():
            out = backbone(probe)
    except Exception as exc:
        raise BackboneError(
            f"the backbone fails on {image_size}x{image_size} grayscale images "
            f"[batch, 1, {image_size}, {image_size}] ({exc}); give one made for that size"
        ) from exc
    if not isinstance(out, torch.Tensor) or out.ndim != 4 or out.shape[0] != 2:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise BackboneError(
            f"the backbone must return a feature map [batch, channels, h, w] for "
            f"{image_size}x{image_size} images, got {shape}"
        )
    channels, height, width = (int(v) for v in out.shape[1:])
    if min(channels, height, width) < 1:
        raise BackboneError(f"the backbone returned an empty feature map {tuple(out.shape)}")
    return channels, height, width
