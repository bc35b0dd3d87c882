"""What the demo's fleet flow measures as it goes, and the names it runs under."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from fedge.demo.learning import Learning

if TYPE_CHECKING:  # torch is imported only once training starts
    from torch import nn

    from fedge.demo.anomaly import AnomalyChapter
    from fedge.demo.closed_loop import ClosedLoop
    from fedge.demo.privacy import PrivacyChapter
    from fedge.demo.security import SecurityChapter
    from fedge.students.inspection import StudentReport

EDGES = ("st-01", "st-02", "st-03")
IMAGES_PER_EDGE = 40
MODEL = "inspect"


@dataclass(frozen=True)
class TrainedTeacher:
    model: nn.Module
    onnx_path: Path
    weights_path: Path
    accuracy: float
    held_out: tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]


@dataclass
class FleetRun:
    """What the fleet flow measured, for the report."""

    teacher: TrainedTeacher
    deploy_s: dict[str, float] = dataclasses.field(default_factory=dict)
    push_s: float = 0.0
    distill_s: float = 0.0
    student: StudentReport | None = None
    truth: dict[str, str] = dataclasses.field(default_factory=dict)
    # Thumbnails at the manager by station: only st-01's config shares them.
    thumbnails: dict[str, int] = dataclasses.field(default_factory=dict)
    anomaly: AnomalyChapter | None = None
    learning: Learning | None = None
    closed_loop: ClosedLoop | None = None
    privacy: PrivacyChapter | None = None
    security: SecurityChapter | None = None
