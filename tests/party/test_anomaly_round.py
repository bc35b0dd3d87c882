"""A station's part of an anomaly job on real kept images (SQLite store, PNG files)."""

import io
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from PIL import Image

from fedge.datasets.defects import CLASSES, make_defect_images
from fedge.models.anomaly.statistics import add_statistics, fit, station_statistics
from fedge.models.inspection import new_model
from fedge.party import anomaly_round
from fedge.party.anomaly_round import (
    record_statistics,
    statistics_round,
    threshold_round,
)
from fedge.party.errors import PartyError
from fedge.party.station_app import Station
from fedge.party.station_store import Retention, StationData
from fedge.protocols.manifest import Preprocess
from fedge.protocols.model_spec import ModelSpec

SPEC = ModelSpec("inspection-cnn", {"width": 4}, CLASSES, Preprocess(image_size=32))


def _png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def _station(tmp_path: Path, name: str, n: int, seed: int) -> Station:
    """``n`` kept images, half labelled clean and half scratch by the operator."""
    data = StationData(tmp_path, Retention(holdout_percent=25))
    images, labels = make_defect_images(n, seed=seed, scratch_fraction=0.5)
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        pid = f"{name}-{index:04d}"
        data.keep(pid, _png(image), ".png", at=time.time() + index)
        data.label(pid, CLASSES[int(label)], at=float(index))
    data.close()
    return Station(name, tmp_path, 25, 1, 60.0)


def _arrays() -> ArrayRecord:
    return ArrayRecord(new_model(0, width=4).state_dict())


def test_station_statistics_add_up_to_the_pooled_fit_and_count_only_good_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stations = [_station(tmp_path / f"st-{i}", f"st-{i}", n, i) for i, n in enumerate((40, 16))]
    replies = [statistics_round(s, SPEC, _arrays(), ConfigRecord()) for s in stations]
    shares = [record_statistics(record) for record, _ in replies]
    for station, (_, metrics), share in zip(stations, replies, shares, strict=True):
        data = station.data()
        good = [i for i in data.labelled() if i.label == "clean" and not i.holdout]
        data.close()
        assert metrics["num-examples"] == share.count == len(good) > 0
    # The pooled fit: every station's good training parts' features at once.
    from fedge.models.anomaly.backbone import InspectionBackbone
    from fedge.models.anomaly.model import extract_features
    from fedge.party import trainer

    backbone = InspectionBackbone(new_model(0, width=4)).eval()
    pooled_x = []
    for station in stations:
        data = station.data()
        chosen = [i for i in data.labelled() if i.label == "clean" and not i.holdout]
        data.close()
        pooled_x.append(trainer.load_examples(chosen, ("clean",), SPEC.preprocess).x)
    features, grid = extract_features(backbone, np.concatenate(pooled_x))
    pooled = fit(station_statistics(features, grid))
    federated = fit(add_statistics(shares))
    np.testing.assert_allclose(federated.mean, pooled.mean, rtol=0, atol=1e-9)
    np.testing.assert_allclose(federated.covariance, pooled.covariance, rtol=0, atol=1e-9)

    # A few held-out good parts: a conformal threshold at 25 % needs 3 of them.
    rate = ConfigRecord({"anomaly-false-alarm-rate": 0.25})
    metrics = threshold_round(stations[0], SPEC, _arrays(), federated, rate)
    assert metrics["holdout-examples"] >= 3
    assert metrics["anomaly-threshold"] > 0
    assert metrics["holdout-false-alarms"] <= 0.25 * metrics["holdout-examples"]
    # At the default 1 % the same parts are too few: no threshold, and the reply says
    # how many it needs (an error reply; the operator sets one by hand or labels more).
    with pytest.raises(PartyError, match=r"st-0: \d+ good part.*out of sample.*at least 99"):
        threshold_round(stations[0], SPEC, _arrays(), federated, ConfigRecord())

    # Given the fleet's sums, its good training parts count too, each scored under the fit
    # without it: enough for 5 % (19) where the held-out parts alone are not.
    five = ConfigRecord({"anomaly-false-alarm-rate": 0.05})
    with pytest.raises(PartyError, match="at least 19"):
        threshold_round(stations[0], SPEC, _arrays(), federated, five)
    pooled_stats = add_statistics(shares)
    metrics = threshold_round(stations[0], SPEC, _arrays(), federated, five, fleet=pooled_stats)
    trained = shares[0].count
    assert metrics["left-out-examples"] == trained
    assert metrics["calibration-examples"] == metrics["holdout-examples"] + trained >= 19
    assert metrics["calibration-false-alarms"] <= 0.05 * metrics["calibration-examples"]
    assert 0 <= metrics["holdout-false-alarms"] <= metrics["holdout-examples"]
    # A large station scores a subset of its training parts left out (one fit each).
    monkeypatch.setattr(anomaly_round, "LEAVE_ONE_OUT_MAX", 3)
    capped = threshold_round(stations[0], SPEC, _arrays(), federated, rate, fleet=pooled_stats)
    assert capped["left-out-examples"] == 3
    assert capped["calibration-examples"] == metrics["holdout-examples"] + 3
    # Sums that cannot hold this station's parts (fewer parts in all): held-out parts only.
    assert shares[1].count <= trained
    other = threshold_round(stations[0], SPEC, _arrays(), federated, rate, fleet=shares[1])
    assert other["left-out-examples"] == 0
    assert other["calibration-examples"] == other["holdout-examples"]


def test_clipping_bounds_each_parts_features(tmp_path: Path) -> None:
    station = _station(tmp_path, "st-1", 20, 3)
    record, _ = statistics_round(station, SPEC, _arrays(), ConfigRecord({"anomaly-clip": 0.5}))
    stats = record_statistics(record)
    # trace(outer_l) = sum over parts of ||x_l||^2 <= count * clip^2 at every location.
    traces = np.trace(stats.outer, axis1=1, axis2=2)
    assert np.all(traces <= stats.count * 0.25 + 1e-9)


def test_a_station_with_no_good_parts_answers_with_an_error(tmp_path: Path) -> None:
    data = StationData(tmp_path, Retention(holdout_percent=25))
    images, _ = make_defect_images(6, seed=1, scratch_fraction=1.0)
    for index, image in enumerate(images):
        data.keep(f"p-{index}", _png(image), ".png", at=time.time() + index)
        data.label(f"p-{index}", "scratch", at=float(index))
    data.close()
    station = Station("st-7", tmp_path, 25, 1, 60.0)
    with pytest.raises(PartyError, match="no good parts"):
        statistics_round(station, SPEC, _arrays(), ConfigRecord())


def test_a_reply_without_statistics_is_refused() -> None:
    with pytest.raises(PartyError, match="lack"):
        record_statistics(_arrays())
