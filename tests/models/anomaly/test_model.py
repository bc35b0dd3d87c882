"""The anomaly network: backbones, scores against the float64 reference, ONNX export."""

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from fedge.datasets.defects import make_defect_images
from fedge.models.anomaly import BackboneError
from fedge.models.anomaly.backbone import InspectionBackbone, feature_grid, load_backbone
from fedge.models.anomaly.model import (
    AnomalyNet,
    ClassifierWithAnomaly,
    export_onnx,
    export_with_classifier,
    extract_features,
    score_images,
)
from fedge.models.anomaly.statistics import fit, mahalanobis, station_statistics
from fedge.models.inspection import new_model, predict_proba


class _SmallBackbone(nn.Module):
    """A user's backbone: two conv layers, 8 channels on a 16x16 grid for 32x32 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(x)
        return out


class _FixedSizeBackbone(nn.Module):
    """Works only for 16x16 images (a Linear over the flattened pixels)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 4 * 4 * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x.flatten(1)).reshape(-1, 2, 4, 4)
        return out


def _good(n: int, seed: int) -> np.ndarray:
    return make_defect_images(n, seed=seed, scratch_fraction=0.0)[0]


def test_the_inspection_backbone_concatenates_its_stages_on_an_8x8_grid() -> None:
    net = new_model(0)
    assert feature_grid(InspectionBackbone(net), 32) == (18, 8, 8)  # stage 1 + the blob band
    assert feature_grid(InspectionBackbone(net, blob_band=False), 32) == (16, 8, 8)
    assert feature_grid(InspectionBackbone(net, stages=3, input_scale=None), 32) == (82, 8, 8)
    with pytest.raises(BackboneError, match="stages 1 to 3"):
        InspectionBackbone(net, stages=4)


def test_the_blob_band_is_in_units_of_each_surfaces_own_noise() -> None:
    # Brushing streaks differ from part to part; in the surface's own noise units the
    # band of a twice as streaky surface stays put (the floor keeps the last 15 %), so
    # the per-location Gaussian is not a scale mixture. The CNN channels do double.
    backbone = InspectionBackbone(new_model(0)).eval()
    surface = _good(4, 3).astype(np.float32) / 255.0
    mean = surface.mean(axis=(1, 2), keepdims=True)
    louder = mean + 2.0 * (surface - mean)
    with torch.no_grad():
        quiet, loud = (backbone(torch.from_numpy(x[:, None])) for x in (surface, louder))
        blank = backbone(torch.full((2, 1, 32, 32), 0.5))
    band_change = (loud[:, 16:] - quiet[:, 16:]).abs().max() / quiet[:, 16:].abs().max()
    cnn_change = (loud[:, :16] - quiet[:, :16]).abs().max() / quiet[:, :16].abs().max()
    assert band_change < 0.2 < 0.9 < cnn_change
    assert torch.equal(blank[:, 16:], torch.zeros_like(blank[:, 16:]))  # no texture: finite


def test_padims_three_stages_export_too(tmp_path: Path) -> None:
    backbone = InspectionBackbone(new_model(0), stages=3, input_scale=None).eval()
    features, grid = extract_features(backbone, _good(100, 1))
    net = AnomalyNet(backbone, fit(station_statistics(features, grid))).eval()
    assert export_onnx(net, tmp_path / "three.onnx", image_size=32) <= 1e-4


def test_torch_scores_match_the_float64_reference_and_the_map_max() -> None:
    backbone = InspectionBackbone(new_model(0)).eval()
    features, grid = extract_features(backbone, _good(60, 1))
    model = fit(station_statistics(features, grid))
    net = AnomalyNet(backbone, model).eval()
    probe = make_defect_images(8, seed=2, scratch_fraction=0.5, dent_fraction=0.5)[0]
    scores, maps = score_images(net, probe)
    reference = mahalanobis(model, extract_features(backbone, probe)[0])
    np.testing.assert_allclose(maps.reshape(8, -1), reference, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(scores, maps.reshape(8, -1).max(axis=1))


def test_onnx_export_has_score_and_map_and_matches_torch(tmp_path: Path) -> None:
    backbone = InspectionBackbone(new_model(0)).eval()
    features, grid = extract_features(backbone, _good(30, 1))
    net = AnomalyNet(backbone, fit(station_statistics(features, grid))).eval()
    path = tmp_path / "anomaly.onnx"
    assert export_onnx(net, path, image_size=32) <= 1e-4
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["score", "anomaly_map"]
    probe = _good(5, 7)
    score, amap = session.run(None, {"image": probe[:, None].astype(np.float32) / 255.0})
    want_score, want_map = score_images(net, probe)
    np.testing.assert_allclose(amap, want_map, rtol=1e-4, atol=1e-4)
    assert amap.shape == (5, 8, 8)
    np.testing.assert_allclose(score, want_score, rtol=1e-4)


def test_the_shared_graph_gives_the_classifiers_probabilities(tmp_path: Path) -> None:
    classifier = new_model(3).eval()
    backbone = InspectionBackbone(classifier).eval()
    features, grid = extract_features(backbone, _good(20, 1))
    anomaly = AnomalyNet(backbone, fit(station_statistics(features, grid))).eval()
    path = tmp_path / "both.onnx"
    export_with_classifier(ClassifierWithAnomaly(classifier, anomaly), path, image_size=32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    probe = _good(4, 9)
    probs, score, _ = session.run(None, {"image": probe[:, None].astype(np.float32) / 255.0})
    np.testing.assert_allclose(probs, predict_proba(classifier, probe), atol=1e-5)
    np.testing.assert_allclose(score, score_images(anomaly, probe)[0], rtol=1e-4)


def test_a_users_torchscript_backbone_loads_fits_and_exports(tmp_path: Path) -> None:
    path = tmp_path / "backbone.pt"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.jit.save(torch.jit.script(_SmallBackbone()), str(path))
    backbone = load_backbone(path)
    assert feature_grid(backbone, 32) == (8, 16, 16)
    features, grid = extract_features(backbone, _good(10, 1))
    net = AnomalyNet(backbone, fit(station_statistics(features, grid))).eval()
    assert export_onnx(net, tmp_path / "user.onnx", image_size=32) <= 1e-4


def test_a_backbone_file_that_does_not_load_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"not a torchscript archive")
    with pytest.raises(BackboneError, match="does not load as TorchScript"):
        load_backbone(broken)
    with pytest.raises(BackboneError, match="does not exist"):
        load_backbone(tmp_path / "missing.pt")


def test_a_backbone_for_another_image_size_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "fixed.pt"
    torch.jit.save(torch.jit.script(_FixedSizeBackbone()), str(path))
    backbone = load_backbone(path)
    assert feature_grid(backbone, 16) == (2, 4, 4)
    with pytest.raises(BackboneError, match="fails on 32x32"):
        feature_grid(backbone, 32)
