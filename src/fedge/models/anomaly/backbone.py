"""Feature backbones for the anomaly model: the classifier's own layers, or a user's file.

A backbone maps images ``[batch, 1, size, size]`` (pixels in [0, 1]) to a feature map
``[batch, channels, h, w]``; every one of the ``h * w`` locations gets its own Gaussian.

The default is the fleet's inspection CNN (:class:`~fedge.models.inspection.InspectionNet`)
with its head dropped: PaDiM takes the activations of the first stages of a CNN trained
elsewhere and concatenates them per location (Defard et al., ICPR 2021, section 3.1);
here its first conv stage by default (16 channels at width 16) and a blob band (2
channels), on an 8x8 grid (:class:`InspectionBackbone` says why).

A user's backbone is a TorchScript file (``torch.jit.save(torch.jit.script(module))`` or
``torch.jit.trace``): it loads without the user's Python code, which a station does not
have. It is probed on one blank image of the model's size before anything is fitted.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as functional
from torch import nn

from fedge.models.anomaly import BackboneError
from fedge.models.inspection import InspectionNet

DEFAULT_STAGES = 1
DEFAULT_INPUT_SCALE = 20.0
"""About 1 / the pixel standard deviation of a good surface (0.03-0.07), so the layers see
inputs of the size they were trained on."""
BLOB_BAND_SIGMAS = (2.0, 6.0)
"""The blob band's difference of Gaussians, in pixels (see :class:`InspectionBackbone`)."""
BAND_NOISE_FLOOR = 0.05
"""The floor of a surface's band noise level, in scaled input units (0.05 / 20 of full
scale, under one grey level of 255): a surface with hardly any texture is not amplified
into noise."""
BAND_UNIT = 0.3
"""The normalised band's unit: keeps it of the size of the CNN's channels (the fit's
ridge is absolute)."""
CELL = 4
"""Pixels per grid cell side: stage 1 runs at full resolution and the grid is 8x8 at 32."""


def _gaussian_taps(sigma: float) -> torch.Tensor:
    radius = math.ceil(3.0 * sigma)
    x = torch.arange(-radius, radius + 1, dtype=torch.float32)
    taps = torch.exp(-(x**2) / (2.0 * sigma**2))
    return taps / taps.sum()


def _noise_level(band: torch.Tensor) -> torch.Tensor:
    """Each image's mean ``|band|`` over its pixels, ``[batch, 1, 1, 1]``."""
    return band.abs().mean(dim=(2, 3), keepdim=True)


class InspectionBackbone(nn.Module):
    """The inspection CNN's first ``stages`` conv stages, concatenated on an 8x8 grid.

    Two choices differ from the classifier's own forward pass, both measured with
    ``fedge bench anomaly --seeds 1 [--stages N] [--input-scale S]`` (seed 0; image AUROC
    of good parts against dents / pits no station saw):

    - **Stage 1 only by default.** PaDiM concatenates stages 1-3 of an ImageNet CNN; ours
      was trained on scratches, and its deeper stages answer to thin lines and pass over
      broad blobs: dents 0.849 with stages 1-3, 0.888 with 1-2, 0.916 with stage 1 alone
      (pits 0.9996, 0.9986, 0.983). ``stages`` up to 3 gives PaDiM's concatenation.
    - **A fixed input scale instead of the per-image standard deviation.** A defect
      raises its image's standard deviation, so dividing by it shrinks the very features
      that should stand out: stages 1-3 with the classifier's normalisation gave dents
      0.754 (0.849 at the fixed scale). ``input_scale=None`` divides by it.
    - **A blob band beside stage 1** (``blob_band``, on by default): two more channels, a
      difference of Gaussians at sigmas 2 and 6 px (5 before the noise units below) and its
      local energy (its square), on the grid. PaDiM's point is that the concatenated stages
      give every location features at several receptive fields; a CNN trained on scratches
      has none at the scale of a broad blob (its deeper stages answer to thin lines), and
      the image's own low band is dominated by lighting (ramps, hotspots 10-25 px wide) that
      no per-location Gaussian can whiten. The difference of Gaussians is scale space's
      band-pass blob detector (Lindeberg, IJCV 1998), here between the CNN's 3x3 view and
      the lighting's scale; its square is the band's local energy, so a blob of either sign
      stands out. Dents 0.911 -> 0.961, pits 0.976 -> 0.979 (``fedge bench anomaly``,
      medians of 5 seeds, BENCHMARKS §22, at sigmas 2 and 5 px). The sigmas were chosen on
      seeds 0-1 of the benchmark, which are among its five.
    - **The band in units of the surface's own band noise.** Good parts' band is a scale
      mixture: brushing streaks (standard deviation 0.01-0.04 from part to part) are long
      lines a 2-D blur barely damps, so a per-location Gaussian fitted over all parts is
      too wide for a quiet surface and too narrow for a streaky one -- quiet parts hide
      faint dents, streaky parts make the long tail of good scores that sets a 1 %
      threshold. The band is
      divided by the part's mean ``|band|``, so PaDiM's per-location Gaussian models the
      band given the surface's noise level, the conditional a scale mixture asks for. A
      dent covers a few percent of the image, so it raises that mean little: a faint
      dent (the ones that matter) hardly at all, a strong one by up to about half, which
      it can spare. The median ``|band|`` (robust to the dent) found as many dents and
      cost more than the whole backbone in ONNX Runtime (TopK over 1,024 pixels); the
      median of the 64 cell centres was cheap and found fewer. With it, the band sampled
      at each cell's centre instead of averaged over the cell (a blob's band is smooth;
      the average mixes in the next cell's sign) and sigmas 2 and 6 px (nearer a dent's
      2.5-4 px): dents 0.961 -> 0.983, pits 0.979 -> 0.985, dents over the fleet's 1 %
      false-alarm threshold 0.704 -> 0.856 (``fedge bench anomaly``, medians of 5 seeds,
      BENCHMARKS §22; the choices made on seeds 0-1). A Gaussian blur of the anomaly map
      before its maximum (PaDiM, PatchCore) lost dents on this coarse 8x8 grid (a dent
      fills about one cell), as did PatchCore's overlapping neighbourhood average of the
      band; PaDiM's random choice of 4 or 8 of the CNN's 16 channels lost pits.
    """

    fine_taps: torch.Tensor
    coarse_taps: torch.Tensor

    def __init__(
        self,
        net: InspectionNet,
        *,
        stages: int = DEFAULT_STAGES,
        input_scale: float | None = DEFAULT_INPUT_SCALE,
        blob_band: bool = True,
    ) -> None:
        super().__init__()
        if stages not in (1, 2, 3):
            raise BackboneError(f"the inspection backbone has stages 1 to 3, not {stages}")
        if input_scale is not None and not input_scale > 0:
            raise BackboneError(f"input_scale must be > 0 or None, got {input_scale}")
        self.features = net.features
        self.stages = stages
        self.input_scale = input_scale
        self.blob_band = blob_band
        fine, coarse = (_gaussian_taps(sigma) for sigma in BLOB_BAND_SIGMAS)
        self.register_buffer("fine_taps", fine, persistent=False)
        self.register_buffer("coarse_taps", coarse, persistent=False)

    @staticmethod
    def _blur(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        """Separable Gaussian blur; edges replicated (any image size, unlike reflection)."""
        radius = (taps.shape[0] - 1) // 2
        x = functional.pad(x, (radius, radius, radius, radius), mode="replicate")
        x = functional.conv2d(x, taps.reshape(1, 1, 1, -1))
        return functional.conv2d(x, taps.reshape(1, 1, -1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x - x.mean(dim=(2, 3), keepdim=True)
        if self.input_scale is None:
            x = x / (x.std(dim=(2, 3), keepdim=True) + 1e-3)
        else:
            x = x * self.input_scale
        layers = self.features
        stage1 = layers[1](layers[0](x))
        # Stages 1 and 2 are 4x and 2x stage 3's grid (two 2x2 max-pools between them);
        # fixed kernels rather than adaptive pooling, which ONNX cannot export.
        parts = [functional.avg_pool2d(stage1, 4)]
        if self.stages >= 2:
            stage2 = layers[4](layers[3](layers[2](stage1)))
            parts.append(functional.avg_pool2d(stage2, 2))
            if self.stages == 3:
                parts.append(layers[7](layers[6](layers[5](stage2))))
        if self.blob_band:
            band = self._blur(x, self.fine_taps) - self._blur(x, self.coarse_taps)
            band = band * (BAND_UNIT / (_noise_level(band) + BAND_NOISE_FLOOR))
            centres = band[:, :, CELL // 2 :: CELL, CELL // 2 :: CELL]
            parts += [centres, functional.avg_pool2d(band * band, CELL)]
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


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
