"""The station's trainer on real kept images: counts, skips, failures, and no skew."""

import io
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from PIL import Image

from fedge.datasets.defects import CLASSES, make_defect_images
from fedge.models.inspection import new_model
from fedge.party import families, trainer
from fedge.party.errors import FamilyError, PartyError
from fedge.party.station_app import Station, evaluate_round, model_spec, train_round
from fedge.party.station_store import Retention, StationData
from fedge.protocols.manifest import Preprocess
from fedge.protocols.model_spec import ModelSpec

SPEC = ModelSpec("inspection-cnn", {"width": 4}, CLASSES, Preprocess(image_size=32))


def png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def station_with(tmp_path: Path, n: int, *, corrupt: int = 0, odd_labels: int = 0) -> Station:
    data = StationData(tmp_path, Retention(holdout_percent=25))
    images, labels = make_defect_images(n, seed=5)
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        pid = f"p-{index:04d}"
        data.keep(pid, png(image), ".png", at=time.time() + index)
        name = "dent" if index < odd_labels else CLASSES[int(label)]
        data.label(pid, name, at=float(index))
    for item in data.labelled()[odd_labels : odd_labels + corrupt]:
        item.path.write_bytes(b"not an image any more")
    data.close()
    return Station("st-01", tmp_path, 25, 1, 60.0)


def arrays() -> ArrayRecord:
    return ArrayRecord(new_model(0, width=4).state_dict())


def test_a_round_trains_on_exactly_the_labelled_training_images(tmp_path: Path) -> None:
    station = station_with(tmp_path, 40)
    items = station.data().labelled()
    train_items = [i for i in items if not i.holdout]
    config = ConfigRecord({"lr": 0.01, "local-epochs": 2, "batch-size": 8, "server-round": 1})
    new, metrics = train_round(station, SPEC, arrays(), config)
    assert metrics["num-examples"] == len(train_items)
    assert metrics["holdout-examples"] == len(items) - len(train_items) > 0
    assert metrics["skipped-unreadable"] == metrics["skipped-unknown-label"] == 0
    assert 0.0 <= metrics["local-acc"] <= 1.0 and 0.0 <= metrics["holdout-acc-after"] <= 1.0
    before = arrays()
    assert any(not np.array_equal(new[k].numpy(), before[k].numpy()) for k in new)
    evaluated = evaluate_round(station, SPEC, new)
    assert evaluated["num-examples"] == metrics["holdout-examples"]
    assert evaluated["eval-acc"] == pytest.approx(metrics["holdout-acc-after"])


def test_corrupt_files_and_unknown_labels_are_skipped_and_counted(tmp_path: Path) -> None:
    station = station_with(tmp_path, 30, corrupt=3, odd_labels=2)
    _, metrics = train_round(station, SPEC, arrays(), ConfigRecord({"local-epochs": 1}))
    assert metrics["skipped-unreadable"] == 3
    assert metrics["skipped-unknown-label"] == 2
    total = metrics["num-examples"] + metrics["holdout-examples"]
    assert total == 30 - 5


def test_nothing_to_train_on_is_a_clear_error(tmp_path: Path) -> None:
    empty = Station("st-09", tmp_path, 20, 1, 60.0)
    with pytest.raises(PartyError, match="kept no images"):
        train_round(empty, SPEC, arrays(), ConfigRecord())
    StationData(tmp_path).close()  # a store, but nothing labelled
    with pytest.raises(PartyError, match="no usable labelled training images"):
        train_round(empty, SPEC, arrays(), ConfigRecord())


def test_a_family_the_station_cannot_build_or_weights_that_do_not_fit(tmp_path: Path) -> None:
    station = station_with(tmp_path, 12)
    unknown = ModelSpec("resnet-9000", {}, CLASSES, Preprocess(image_size=32))
    with pytest.raises(FamilyError, match="resnet-9000"):
        train_round(station, unknown, arrays(), ConfigRecord())
    wider = ModelSpec("inspection-cnn", {"width": 8}, CLASSES, Preprocess(image_size=32))
    with pytest.raises(FamilyError, match="do not fit"):
        train_round(station, wider, arrays(), ConfigRecord())
    with pytest.raises(PartyError, match="model-spec"):
        model_spec(ConfigRecord({"model-spec": '{"family": "x"}'}))
    with pytest.raises(PartyError, match="no fedge fleet job"):
        model_spec(ConfigRecord())
    with pytest.raises(PartyError, match="batch-size"):
        train_round(station, SPEC, arrays(), ConfigRecord({"batch-size": 0}))
    assert ModelSpec.from_json(SPEC.to_json()) == SPEC


def test_the_agent_scores_exactly_the_tensor_the_trainer_trains_on(tmp_path: Path) -> None:
    """No training/serving skew: the agent's input for a file is the trainer's example."""
    from conftest import make_fleet_home

    from fedge.edge_agent.agent import EdgeAgent
    from fedge.edge_agent.inference import runtime
    from fedge.models.inspection import export_onnx
    from fedge.protocols.manifest import ModelManifest, TensorSpec

    image = (np.random.default_rng(1).random((48, 40)) * 255).astype(np.uint8)
    data = png(image)
    onnx = tmp_path / "m.onnx"
    export_onnx(new_model(0, width=4), onnx)
    manifest = ModelManifest(
        name="inspect", version=1, sha256="ab" * 32, size=onnx.stat().st_size,
        inputs=(TensorSpec("image", "float32", ("batch", 1, 32, 32)),),
        outputs=(TensorSpec("probs", "float32", ("batch", 2)),), classes=CLASSES,
        preprocess=Preprocess(image_size=32),
    )  # fmt: skip
    fh = make_fleet_home(tmp_path / "fleet", edges=("st-01",))
    agent = EdgeAgent(fh.agent_settings("st-01"))
    seen: list[np.ndarray] = []
    try:
        agent.serving_state.install(runtime.load(onnx, manifest))
        assert agent.model is not None
        real_run = agent.model.session.run

        def spy(names: object, feeds: dict[str, np.ndarray]) -> object:
            seen.append(feeds["image"].copy())
            return real_run(names, feeds)

        agent.model.session.run = spy
        scored = agent.score_image(data, suffix=".png")
        assert agent.station.labelled() == []  # kept, but not a training example unlabelled
        agent.station.label(scored.record.prediction_id, "clean")
        (item,) = agent.station.labelled()
        trained = trainer.load_examples([item], CLASSES, Preprocess(image_size=32))
    finally:
        agent.store.close()
        agent.station.close()
    assert seen[0].shape == (1, 1, 32, 32)
    np.testing.assert_array_equal(trained.x[0], seen[0][0])


def test_weights_round_trip_and_the_digits_family_builds() -> None:
    model = families.build("inspection-cnn", {"width": 4}, 2)
    data = families.weights_bytes(families.state_arrays(model))
    restored = families.weights_from_bytes(data)
    other = families.build("inspection-cnn", {"width": 4}, 2, seed=9)
    families.load_state_arrays(other, restored)
    for key, value in families.state_arrays(other).items():
        np.testing.assert_array_equal(value, restored[key])
    digits = families.build("digits-mlp", {"hidden": 16}, 10)
    assert sum(p.numel() for p in digits.parameters()) == 64 * 16 + 16 + 16 * 10 + 10
    with pytest.raises(FamilyError, match="not a readable"):
        families.weights_from_bytes(b"nope")


def test_an_image_declaring_too_many_pixels_is_refused_before_decoding(tmp_path: Path) -> None:
    from fedge.party.preprocess import ImageError, prepare

    buffer = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buffer, format="PNG")  # ~80 KB on disk, 81 Mpx
    with pytest.raises(ImageError, match="pixels"):
        prepare(buffer.getvalue(), Preprocess(image_size=32))


TINY_FAMILY = families.Family(
    "tiny-linear",
    lambda params, n: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, n)),
    lambda params: Preprocess(image_size=2),
)


def test_a_users_family_is_found_through_its_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import EntryPoint

    points = [
        EntryPoint("tiny-linear", f"{__name__}:TINY_FAMILY", families.ENTRY_POINT_GROUP),
        EntryPoint("not-a-family", f"{__name__}:png", families.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(families, "entry_points", lambda group: points[:1])
    families._installed.cache_clear()
    try:
        model = families.build("tiny-linear", {}, 3)
        assert sum(p.numel() for p in model.parameters()) == 4 * 3 + 3
        monkeypatch.setattr(families, "entry_points", lambda group: points)
        families._installed.cache_clear()
        with pytest.raises(FamilyError, match="is not a fedge Family"):
            families.get_family("tiny-linear")
    finally:
        families._installed.cache_clear()


@pytest.mark.integration
def test_the_station_app_loads_without_torch() -> None:
    """SecAgg+'s key stages and queries load the app in a fresh process and never build a
    network: torch (seconds to import) is imported only where a model is built (issue 32,
    item 6)."""
    import subprocess
    import sys

    code = (
        "import sys, fedge.party.station_app as app; "
        "assert app.app is not None; "
        "print(sorted(m for m in ('torch', 'opacus') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
