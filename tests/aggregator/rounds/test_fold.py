"""Streaming weighted mean against the batch reference; FedBuff's staleness weight."""

import gc
import math
import tracemalloc
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from fedge.aggregator.rounds.deadline import staleness_weight
from fedge.aggregator.rounds.fold import StreamingMean, accumulator_dtype, weighted_mean


def test_tiny_literal_mean() -> None:
    fold = StreamingMean()
    fold.add({"w": np.array([1.0, 2.0], np.float32), "b": np.array(0.0, np.float32)}, 1.0)
    fold.add({"w": np.array([4.0, 8.0], np.float32), "b": np.array(3.0, np.float32)}, 2.0)
    result = fold.result()
    np.testing.assert_array_equal(result["w"], np.array([3.0, 6.0], np.float32))
    np.testing.assert_array_equal(result["b"], np.array(2.0, np.float32))
    assert result["w"].dtype == np.float32
    assert result["b"].shape == ()
    assert (fold.count, fold.total_weight) == (2, 3.0)
    reference = weighted_mean(
        [
            {"w": np.array([1.0, 2.0]), "b": np.array(0.0)},
            {"w": np.array([4.0, 8.0]), "b": np.array(3.0)},
        ],
        [1.0, 2.0],
    )
    np.testing.assert_array_equal(reference["w"], [3.0, 6.0])


def test_lists_are_named_by_position() -> None:
    fold = StreamingMean()
    fold.add([np.ones(2), np.zeros((1, 2))], 1.0)
    fold.add([np.zeros(2), np.ones((1, 2))], 3.0)
    assert list(fold.result()) == ["0", "1"]
    np.testing.assert_allclose(fold.result_arrays()[1], [[0.75, 0.75]])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chunk", [7, 1 << 16])
def test_streaming_equals_batch_on_random_updates(
    dtype: type[np.floating[Any]], chunk: int
) -> None:
    rng = np.random.default_rng(0)
    shapes = {"conv": (4, 3, 3, 3), "fc": (50, 20), "bias": (20,), "scalar": ()}
    updates = [
        {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()} for _ in range(30)
    ]
    weights = [float(w) for w in rng.integers(1, 500, size=30)]
    fold = StreamingMean(chunk_elements=chunk)
    for update, weight in zip(updates, weights, strict=True):
        fold.add(update, weight)
    streamed, reference = fold.result(), weighted_mean(updates, weights)
    for key in shapes:
        assert streamed[key].dtype == dtype
        assert streamed[key].shape == shapes[key]
        np.testing.assert_allclose(streamed[key], reference[key], rtol=1e-6, atol=1e-6)


def test_non_contiguous_updates_fold_the_same() -> None:
    rng = np.random.default_rng(1)
    updates = [{"w": rng.standard_normal((6, 4)).astype(np.float32).T} for _ in range(5)]
    assert not updates[0]["w"].flags.c_contiguous
    fold = StreamingMean(chunk_elements=5)
    for update in updates:
        fold.add(update, 2.5)
    np.testing.assert_allclose(
        fold.result()["w"], weighted_mean(updates, [2.5] * 5)["w"], rtol=1e-6
    )


def test_updates_are_not_modified() -> None:
    update = {"w": np.array([1.0, 2.0], np.float32)}
    fold = StreamingMean()
    fold.add(update, 3.0)
    fold.add(update, 0.5)
    np.testing.assert_array_equal(update["w"], [1.0, 2.0])


def test_float16_accumulates_in_float32_without_overflow() -> None:
    assert accumulator_dtype(np.dtype(np.float16)) == np.float32
    fold = StreamingMean()
    for _ in range(3):
        fold.add({"w": np.full(3, 100.0, np.float16)}, 1000.0)  # 1e5 > float16's 65504
    result = fold.result()["w"]
    assert result.dtype == np.float16
    np.testing.assert_array_equal(result, np.full(3, 100.0, np.float16))


def test_integer_arrays_are_averaged_and_rounded_back() -> None:
    fold = StreamingMean()
    fold.add({"num_batches_tracked": np.array(10, np.int64)}, 1.0)
    fold.add({"num_batches_tracked": np.array(13, np.int64)}, 2.0)
    result = fold.result()["num_batches_tracked"]
    assert result.dtype == np.int64
    assert int(result) == 12


def test_mismatched_keys_are_named() -> None:
    fold = StreamingMean()
    fold.add({"a": np.zeros(2), "b": np.zeros(2)}, 1.0)
    with pytest.raises(ValueError, match=r"missing arrays \['b'\], unexpected \['c'\]"):
        fold.add({"a": np.zeros(2), "c": np.zeros(2)}, 1.0)


def test_mismatched_shape_and_dtype_are_named_and_leave_the_fold_untouched() -> None:
    fold = StreamingMean()
    fold.add({"a": np.ones(2), "b": np.ones((2, 2))}, 1.0)
    with pytest.raises(ValueError, match=r"array 'b': shape \(4,\), expected \(2, 2\)"):
        fold.add({"a": np.full(2, 9.0), "b": np.ones(4)}, 1.0)
    with pytest.raises(ValueError, match="array 'a': dtype float32, expected float64"):
        fold.add({"a": np.ones(2, np.float32), "b": np.ones((2, 2))}, 1.0)
    assert fold.count == 1
    np.testing.assert_array_equal(fold.result()["a"], [1.0, 1.0])


def test_zero_total_weight_is_an_error() -> None:
    fold = StreamingMean()
    with pytest.raises(ValueError, match="total weight is 0"):
        fold.result()
    fold.add({"a": np.ones(2)}, 0.0)
    assert fold.count == 1
    with pytest.raises(ValueError, match="total weight is 0"):
        fold.result()
    with pytest.raises(ValueError, match="total weight is 0"):
        weighted_mean([{"a": np.ones(2)}], [0.0])


@pytest.mark.parametrize("weight", [-1.0, math.nan, math.inf])
def test_bad_weights_are_rejected(weight: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        StreamingMean().add({"a": np.ones(2)}, weight)


def test_non_arrays_are_rejected() -> None:
    with pytest.raises(ValueError, match="'a' is a list"):
        StreamingMean().add({"a": [1.0, 2.0]}, 1.0)  # type: ignore[dict-item]


def test_peak_memory_stays_near_two_model_sizes() -> None:
    # 1M float32 parameters in a few arrays; each update is a fresh model the caller frees.
    shapes = [(500_000,), (300, 1000), (200_000,)]
    model_bytes = sum(int(np.prod(s)) for s in shapes) * 4
    base: list[npt.NDArray[np.float32]] = [np.ones(s, np.float32) for s in shapes]
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fold = StreamingMean()
        for i in range(20):
            update = [b * np.float32(i) for b in base]
            fold.add(update, 1.0 + i % 3)
            del update
        fold.result()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # accumulator (1) + the caller's update (1) + a 256 KiB buffer; float64 would be >= 3.
    assert peak / model_bytes < 2.5


# ---------------------------------------------------------------- staleness (FedBuff)


def test_staleness_weight_values() -> None:
    assert staleness_weight(0) == 1.0
    assert staleness_weight(3) == pytest.approx(0.5)  # 1/sqrt(4)
    assert staleness_weight(8) == pytest.approx(1 / 3)
    assert staleness_weight(1) == pytest.approx(1 / math.sqrt(2))
    assert staleness_weight(3, exponent=1.0) == pytest.approx(0.25)
    assert staleness_weight(5, exponent=0.0) == 1.0


def test_staleness_weight_rejects_negative_staleness() -> None:
    with pytest.raises(ValueError, match="staleness_rounds"):
        staleness_weight(-1)


def test_streamed_updates_fold_like_whole_ones() -> None:
    rng = np.random.default_rng(5)
    updates = [
        {
            "w": rng.normal(size=(3, 4)).astype(np.float32),
            "b": rng.normal(size=4).astype(np.float32),
        }
        for _ in range(4)
    ]
    weights = [1.0, 2.5, 0.0, 7.0]
    whole, streamed = StreamingMean(), StreamingMean()
    for update, weight in zip(updates, weights, strict=True):
        whole.add(update, weight)
        layout = {k: (v.shape, v.dtype) for k, v in update.items()}
        streamed.add_streamed(layout, iter(update.items()), weight)
    for key, value in whole.result().items():
        np.testing.assert_array_equal(streamed.result()[key], value)


def test_streamed_update_with_a_wrong_layout_changes_nothing() -> None:
    fold = StreamingMean()
    fold.add({"w": np.ones(3, np.float32)}, 1.0)
    with pytest.raises(ValueError, match="'w'"):
        fold.add_streamed({"w": ((4,), np.dtype(np.float32))}, iter([]), 1.0)
    assert fold.count == 1
    np.testing.assert_array_equal(fold.result()["w"], np.ones(3, np.float32))
