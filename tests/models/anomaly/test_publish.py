"""The classifier + anomaly graph is published, signed and loaded like any model."""

from pathlib import Path

import numpy as np

from fedge.datasets.defects import CLASSES, make_defect_images
from fedge.edge_agent.inference import runtime
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.edge_manager.registry.versions import Registry
from fedge.edge_manager.store import Store
from fedge.models.anomaly.backbone import InspectionBackbone
from fedge.models.anomaly.model import (
    AnomalyNet,
    ClassifierWithAnomaly,
    export_with_classifier,
    extract_features,
)
from fedge.models.anomaly.statistics import fit, station_statistics
from fedge.models.inspection import new_model, predict_proba


def test_the_shared_graph_publishes_verifies_and_serves_the_classifiers_probs(
    tmp_path: Path,
) -> None:
    classifier = new_model(1).eval()
    backbone = InspectionBackbone(classifier).eval()
    good, _ = make_defect_images(30, seed=2, scratch_fraction=0.0)
    features, grid = extract_features(backbone, good)
    anomaly = AnomalyNet(backbone, fit(station_statistics(features, grid))).eval()
    path = tmp_path / "both.onnx"
    export_with_classifier(ClassifierWithAnomaly(classifier, anomaly), path, image_size=32)

    home = ManagerHome(tmp_path / "home")
    home.init(ManagerSettings("anomaly"))
    registry = Registry(Store(home.db_path), home.artifacts, home.signing_key())
    published = registry.publish(path, name="inspect", version=1, classes=CLASSES)
    published.verify()
    manifest = published.manifest
    assert [t.name for t in manifest.outputs] == ["probs", "score", "anomaly_map"]

    # Today's agent serves the first output: the classifier's probabilities, unchanged.
    loaded = runtime.load(published.path, manifest)
    runtime.smoke_test(loaded)
    probe = good[:4, None].astype(np.float32) / np.float32(255.0)
    np.testing.assert_allclose(loaded.run(probe), predict_proba(classifier, good[:4]), atol=1e-5)
