"""An anomaly fleet job's model on the manager's side: its backbone checked, its export.

Before the job (:func:`anomaly_backbone_shape`, called by :mod:`.prepare`): the task
model's feature layers are built with the job's ``[anomaly]`` settings and run once on a
blank image of the model's size, so a backbone that does not fit its images is refused
before anything is written. After it (:func:`export_anomaly`, called by :mod:`.publish`):
the fleet's fit (:func:`fedge.aggregator.anomaly.rounds.fleet_fit`) behind that backbone,
exported to ONNX with ``score`` and ``anomaly_map`` and checked against torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from fedge.aggregator.anomaly.rounds import fleet_fit
from fedge.aggregator.anomaly.spec import AnomalySpec
from fedge.aggregator.fleet.manifest import FleetJobManifest
from fedge.aggregator.jobs.checkpoint import load_arrays
from fedge.aggregator.jobs.directory import JobError
from fedge.aggregator.jobs.spec import ManifestError
from fedge.models.anomaly import AnomalyError
from fedge.party import families
from fedge.party.errors import FamilyError
from fedge.protocols.model_spec import ModelSpec

if TYPE_CHECKING:
    from fedge.models.anomaly.backbone import InspectionBackbone

ANOMALY_CLASSES = ("good", "anomalous")
"""What the published model's registry entry names (it scores one number per part)."""


def anomaly_backbone_shape(
    manifest: FleetJobManifest, spec: ModelSpec, weights: bytes
) -> tuple[tuple[int, int], int]:
    """The feature grid ``(h, w)`` and depth the job's backbone gives, or ManifestError."""
    assert manifest.anomaly is not None
    try:
        backbone = _backbone(spec, families.weights_from_bytes(weights), manifest.anomaly)
        from fedge.models.anomaly.backbone import feature_grid

        dims, height, width = feature_grid(backbone, spec.preprocess.image_size)
    except (AnomalyError, FamilyError) as exc:
        raise ManifestError(f"task.model cannot be the anomaly backbone: {exc}") from None
    return (height, width), dims


def export_anomaly(
    job_dir: Path, spec: ModelSpec, anomaly: AnomalySpec, initial: Path, final: Path
) -> tuple[Path, int]:
    """Write ``<job_dir>/final.onnx`` (checked against torch); returns it and the count of
    good parts the fit is made of."""
    from fedge.models.anomaly.model import AnomalyNet, export_onnx

    model = fleet_fit(load_arrays(final))
    try:
        backbone = _backbone(spec, load_arrays(initial), anomaly)
        onnx_path = job_dir / "final.onnx"
        export_onnx(AnomalyNet(backbone, model), onnx_path, image_size=spec.preprocess.image_size)
    except (AnomalyError, FamilyError) as exc:
        raise JobError(
            f"cannot export the fleet's anomaly model: {exc}; nothing published"
        ) from exc
    return onnx_path, model.count


def _backbone(
    spec: ModelSpec, weights: Mapping[str, npt.NDArray[np.generic]], anomaly: AnomalySpec
) -> InspectionBackbone:
    from fedge.models.anomaly.backbone import InspectionBackbone
    from fedge.models.inspection import InspectionNet

    net = families.build(spec.family, spec.params, len(spec.classes))
    if not isinstance(net, InspectionNet):
        raise FamilyError(
            f"family {spec.family!r} has no inspection CNN feature layers to use as a backbone"
        )
    families.load_state_arrays(net, weights)
    scale = anomaly.input_scale if anomaly.input_scale > 0 else None
    return InspectionBackbone(net, stages=anomaly.stages, input_scale=scale).eval()
