"""The closed-loop chapter's parts that run without a fleet: station conditions, the
timeline read back from a store, the report section."""

from pathlib import Path

import numpy as np
import pytest

from fedge.datasets.conditions import defocus, lighting_drift
from fedge.datasets.defects import make_defect_images
from fedge.demo.closed_loop import ClosedLoop, report_lines
from fedge.demo.timeline import marks, plot
from fedge.edge_manager.store import Store


def _sharpness(images: np.ndarray) -> float:
    return float(np.abs(np.diff(images.astype(float), axis=2)).mean())


def test_lighting_drift_brightens_and_defocus_blurs_keeping_shape() -> None:
    images, _ = make_defect_images(8, seed=1)
    lit = lighting_drift(images, gain=0.5, offset=0.45, gradient=0.2)
    assert lit.shape == images.shape and lit.dtype == np.uint8
    assert lit.mean() > images.mean() + 40 and lit.std() < images.std()
    blurred = defocus(images, sigma=1.5)
    assert blurred.shape == images.shape and _sharpness(blurred) < _sharpness(images)
    with pytest.raises(ValueError, match=r"\(n, h, w\)"):
        lighting_drift(images[0])
    with pytest.raises(ValueError, match="sigma"):
        defocus(images, sigma=0)


def test_the_timeline_is_the_stores_record(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.db")
    store.conn.execute(
        "INSERT INTO alerts VALUES ('a1','st-02','inspect:3','input_drift',0.4,0.25,'{}',105.0,"
        "NULL)"
    )
    store.conn.execute("INSERT INTO gate_results VALUES ('inspect', 4, 0, '{}', 'e1', 110.0)")
    store.conn.execute("INSERT INTO loop_events VALUES ('loop-1', 120.0, 'gated', 'blessed')")
    store.conn.execute(
        "INSERT INTO deploy_events VALUES ('st-03','d-1','rolled_back','latency','inspect:3',130.0)"
    )
    store.conn.execute("INSERT INTO alerts VALUES ('old','st-01','inspect:1','input_drift',"
                       "0.4,0.25,'{}',50.0,NULL)")  # fmt: skip
    found = marks(store, since=100.0)
    assert [(m.lane, m.kind) for m in found] == [
        ("st-02", "alert"),
        ("gate", "gate_no"),
        ("loop", "loop"),
        ("st-03", "back"),
    ]
    assert found[1].what == "inspect:4 not blessed"
    plot(found, 100.0, ("st-01", "st-02", "st-03"), tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_says_how_each_step_ended() -> None:
    result = ClosedLoop(started=0.0, loop_state="completed", central="inspect:6")
    result.verdicts = {"inspect:4": {"blessed": False, "reason": "worse on st-01"}}
    result.central_outcome = "rolled back: st-03: agreement_drop=0.17 > 0.05"
    text = "\n".join(report_lines(result))
    assert "| inspect:4 | no | worse on st-01 |" in text
    assert "**completed**" in text and "**rolled back: st-03" in text
