"""The generated scratch-inspection images and the edge's PNG loader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedge.datasets.defects import CLASSES, make_defect_images, write_png_dir
from fedge.party.preprocess import prepare
from fedge.protocols.manifest import Preprocess


def test_shapes_and_dtypes() -> None:
    images, labels = make_defect_images(12, seed=0)
    assert images.shape == (12, 32, 32)
    assert images.dtype == np.uint8
    assert labels.shape == (12,)
    assert labels.dtype == np.int64
    assert set(np.unique(labels)) <= {0, 1}
    assert CLASSES == ("clean", "scratch")


def test_other_size() -> None:
    images, _ = make_defect_images(3, size=24, seed=0)
    assert images.shape == (3, 24, 24)


def test_empty_request() -> None:
    images, labels = make_defect_images(0, seed=0)
    assert images.shape == (0, 32, 32)
    assert labels.shape == (0,)


def test_same_seed_same_bytes_other_seed_differs() -> None:
    a_images, a_labels = make_defect_images(40, seed=7)
    b_images, b_labels = make_defect_images(40, seed=7)
    c_images, _ = make_defect_images(40, seed=8)
    assert np.array_equal(a_images, b_images)
    assert np.array_equal(a_labels, b_labels)
    assert not np.array_equal(a_images, c_images)


@pytest.mark.parametrize(
    ("n", "fraction"), [(100, 0.5), (101, 0.5), (50, 0.2), (30, 0.0), (30, 1.0)]
)
def test_label_balance_is_exact(n: int, fraction: float) -> None:
    _, labels = make_defect_images(n, seed=1, scratch_fraction=fraction)
    assert int(labels.sum()) == round(n * fraction)


def test_labels_are_shuffled() -> None:
    # Scratches must not all sit at the front, or a sequential split would be one-class.
    _, labels = make_defect_images(200, seed=2)
    assert 0.3 < labels[:100].mean() < 0.7


def test_images_use_the_range_without_saturating() -> None:
    images, _ = make_defect_images(200, seed=3)
    assert 60 < images.mean() < 200
    saturated = np.mean((images == 0) | (images == 255))
    assert saturated < 0.01
    # Illumination varies between images, not just within them.
    assert images.reshape(200, -1).mean(axis=1).std() > 10


def test_scratches_add_local_contrast() -> None:
    # Same seed, all-clean vs all-scratched: the stream is drawn identically, so the
    # only difference is the scratch layer, which must be thin (a small part of the
    # image) and present in every scratched image.
    clean, _ = make_defect_images(50, seed=4, scratch_fraction=0.0)
    scratched, labels = make_defect_images(50, seed=4, scratch_fraction=1.0)
    assert labels.all()
    diff = np.abs(scratched.astype(np.int16) - clean.astype(np.int16)).reshape(50, -1)
    assert (diff.max(axis=1) > 0).all()
    changed = (diff > 3).mean(axis=1)
    assert changed.max() < 0.35


@pytest.mark.parametrize(("n", "size", "fraction"), [(-1, 32, 0.5), (4, 4, 0.5), (4, 32, 1.5)])
def test_invalid_arguments(n: int, size: int, fraction: float) -> None:
    with pytest.raises(ValueError):
        make_defect_images(n, size=size, seed=0, scratch_fraction=fraction)


def test_png_round_trip(tmp_path: Path) -> None:
    images, _ = make_defect_images(6, seed=5)
    paths = write_png_dir(images, tmp_path / "out", "scratch")
    assert [p.name for p in paths] == [f"scratch_{i:05d}.png" for i in range(6)]
    for path, image in zip(paths, images, strict=True):
        with Image.open(path) as opened:
            assert opened.mode == "L"
        # Read back as training and serving read it (the one preprocessing function).
        loaded = prepare(path, Preprocess(image_size=32))[0]
        assert loaded.dtype == np.float32
        assert loaded.shape == (32, 32)
        # PNG is lossless and pixels are scaled by 1/255: what training sees, to float
        # rounding (x * (1/255) and x / 255 may differ in the last bit).
        np.testing.assert_allclose(loaded, image.astype(np.float32) / np.float32(255.0), atol=1e-7)


def test_a_colour_file_of_another_size_is_read_as_grey_32x32(tmp_path: Path) -> None:
    rgb = np.zeros((64, 48, 3), dtype=np.uint8)
    rgb[:, :, 0] = 255
    path = tmp_path / "red.png"
    Image.fromarray(rgb).save(path)
    loaded = prepare(path, Preprocess(image_size=32))[0]
    assert loaded.shape == (32, 32)
    assert loaded.dtype == np.float32
    assert 0.0 <= loaded.min() <= loaded.max() <= 1.0
    # Pure red has luminance 299/1000 in Pillow's L conversion.
    assert np.allclose(loaded, 76 / 255, atol=1 / 255)


def test_write_png_dir_rejects_wrong_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_png_dir(np.zeros((4, 4), dtype=np.uint8), tmp_path, "x")
    with pytest.raises(ValueError):
        write_png_dir(np.zeros((1, 4, 4), dtype=np.float32), tmp_path, "x")


@pytest.mark.integration
def test_module_does_not_import_torch() -> None:
    # The loader runs on edge devices that have onnxruntime but no torch.
    code = "import sys, fedge.datasets.defects; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pits_are_a_second_unseen_shape_and_leave_other_bytes_alone() -> None:
    plain, plain_labels = make_defect_images(60, seed=4, dent_fraction=0.5)
    same, same_labels = make_defect_images(60, seed=4, dent_fraction=0.5, pit_fraction=0.0)
    np.testing.assert_array_equal(plain, same)
    np.testing.assert_array_equal(plain_labels, same_labels)
    clean, _ = make_defect_images(40, seed=5, scratch_fraction=0.0)
    pits, labels = make_defect_images(40, seed=5, scratch_fraction=1.0, pit_fraction=1.0)
    assert np.all(labels == 1)
    # Pits are dark: each pitted image's darkest pixel sits below the clean surface's.
    assert np.median(pits.min(axis=(1, 2))) < np.median(clean.min(axis=(1, 2)))
    with pytest.raises(ValueError, match="must be <= 1"):
        make_defect_images(10, seed=0, dent_fraction=0.6, pit_fraction=0.6)
