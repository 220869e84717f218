"""Tests for the GroupedMatMul oracle: a separate loop reference, the op page's examples, errors.

Random inputs are fresh each run; the seed is in every assertion message, and setting
``TEST_SEED`` replays a run.
"""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

from onnx_moe_fuse.verify.oracles.grouped_matmul import grouped_matmul


def _rng() -> tuple[np.random.Generator, int]:
    seed = int(os.environ.get("TEST_SEED", secrets.randbits(32)))
    return np.random.default_rng(seed), seed


def _loop_reference(x: np.ndarray, w: np.ndarray, idx: np.ndarray, b: np.ndarray | None):
    """Direct per-(token, selection) loop, float64, independent of the oracle's grouping."""
    m, s = idx.shape
    out = np.empty((m, s, w.shape[2]))
    for t in range(m):
        for i in range(s):
            g = int(idx[t, i])
            row = np.einsum("k,kn->n", x[t].astype(np.float64), w[g].astype(np.float64))
            out[t, i] = row if b is None else row + b[g].astype(np.float64)
    return out


def _nonzero(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Draw normal samples pushed away from zero, so no test tensor holds zeros."""
    v = rng.standard_normal(shape)
    return np.where(np.abs(v) < 0.1, np.sign(v + 1e-12) * 0.1, v)


TOLERANCE = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-13}


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_loop_reference(dtype, index_dtype, with_bias):
    rng, seed = _rng()
    m, k, n, g, s = 7, 5, 6, 4, 3
    x = _nonzero(rng, (m, k)).astype(dtype)
    w = _nonzero(rng, (g, k, n)).astype(dtype)
    idx = rng.integers(0, g, size=(m, s)).astype(index_dtype)
    b = _nonzero(rng, (g, n)).astype(dtype) if with_bias else None
    got = grouped_matmul(x, w, idx, b)
    assert got.dtype == np.dtype(dtype) and got.shape == (m, s, n), f"seed={seed}"
    want = _loop_reference(x, w, idx, b)
    einsum = np.einsum("mk,mskn->msn", x.astype(np.float64), w.astype(np.float64)[idx])
    if b is not None:
        einsum = einsum + b.astype(np.float64)[idx]
    np.testing.assert_allclose(want, einsum, rtol=1e-12, atol=1e-12, err_msg=f"seed={seed}")
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"seed={seed}")


def test_bfloat16_matches_loop_reference():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng, seed = _rng()
    bf16 = ml_dtypes.bfloat16
    x = _nonzero(rng, (4, 8)).astype(bf16)
    w = _nonzero(rng, (3, 8, 5)).astype(bf16)
    idx = rng.integers(0, 3, size=(4, 2))
    got = grouped_matmul(x, w, idx)
    assert got.dtype == np.dtype(bf16), f"seed={seed}"
    want = _loop_reference(x, w, idx, None)
    np.testing.assert_allclose(
        got.astype(np.float64), want, rtol=1e-2, atol=1e-2, err_msg=f"seed={seed}"
    )


def test_many_tokens_few_groups_random():
    rng, seed = _rng()
    x = _nonzero(rng, (40, 16)).astype(np.float32)
    w = _nonzero(rng, (6, 16, 12)).astype(np.float32)
    idx = rng.integers(0, 6, size=(40, 4))
    b = _nonzero(rng, (6, 12)).astype(np.float32)
    np.testing.assert_allclose(
        grouped_matmul(x, w, idx, b),
        _loop_reference(x, w, idx, b),
        rtol=1e-5,
        atol=1e-5,
        err_msg=f"seed={seed}",
    )


# ---------------------------------------------------------------------------------------------
# The examples on the ONNX GroupedMatMul (opset 29) op page, expected values worked by hand.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_example_additional_types(dtype, index_dtype):
    x = np.array([[1, 2], [3, 4]], dtype=dtype)
    w = np.array([[[1, 0], [0, 1]], [[0, 1], [1, 0]]], dtype=dtype)
    idx = np.array([[0, 1], [1, 0]], dtype=index_dtype)
    b = np.array([[0.5, 1], [1.5, 2]], dtype=dtype)
    got = grouped_matmul(x, w, idx, b)
    want = np.array([[[1.5, 3], [3.5, 3]], [[5.5, 5], [3.5, 5]]], dtype=dtype)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, want)


_DEFAULT_X = np.array([[1, 0, -1], [0, 1, 2], [1, 1, 0], [0, 0, 1]], dtype=np.float32)
_DEFAULT_W = np.array([[[1, 0], [0, 1], [-1, 0]], [[0, 1], [1, 0], [0, 1]]], dtype=np.float32)
_DEFAULT_IDX = np.array([[0], [1], [0], [1]], dtype=np.int64)
_DEFAULT_WANT = np.array([[[2, 0]], [[1, 2]], [[1, 1]], [[0, 1]]], dtype=np.float32)


def test_example_default():
    got = grouped_matmul(_DEFAULT_X, _DEFAULT_W, _DEFAULT_IDX)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, _DEFAULT_WANT)


def test_example_without_bias_explicit_empty_input():
    # An empty input name ("") means the optional bias is absent: bias=None here.
    np.testing.assert_array_equal(
        grouped_matmul(_DEFAULT_X, _DEFAULT_W, _DEFAULT_IDX, None), _DEFAULT_WANT
    )


def test_example_with_bias():
    x = np.array([[1, 0], [0, 1]], dtype=np.float32)
    w = np.array([[[1, 0], [0, 1]], [[0, 1], [1, 0]], [[1, 1], [0, 0]]], dtype=np.float32)
    idx = np.array([[0, 1], [2, 0]], dtype=np.int64)
    b = np.array([[0.1, 0.2], [0.3, 0.0], [0.5, 0.5]], dtype=np.float32)
    want = np.array([[[1.1, 0.2], [0.3, 1.0]], [[0.5, 0.5], [0.1, 1.2]]], dtype=np.float32)
    np.testing.assert_allclose(grouped_matmul(x, w, idx, b), want, rtol=1e-7, atol=0)


def test_example_with_unused_group():
    x = np.array([[1, 2], [3, 4], [5, 6], [7, 8]], dtype=np.float32)
    w = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    idx = np.array([[0], [0], [2], [2]], dtype=np.int64)
    want = np.array([[[4, 7]], [[8, 15]], [[100, 111]], [[136, 151]]], dtype=np.float32)
    np.testing.assert_array_equal(grouped_matmul(x, w, idx), want)


def test_example_single_group():
    x = np.array([[1, 2], [3, 4], [5, 6]], dtype=np.float32)
    w = np.array([[[1, 2, 3], [4, 5, 6]]], dtype=np.float32)
    idx = np.zeros((3, 1), dtype=np.int64)
    want = np.array([[[9, 12, 15]], [[19, 26, 33]], [[29, 40, 51]]], dtype=np.float32)
    np.testing.assert_array_equal(grouped_matmul(x, w, idx), want)


def test_example_zero_selections():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    w = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    got = grouped_matmul(x, w, np.empty((2, 0), dtype=np.int64))
    assert got.shape == (2, 0, 4) and got.dtype == np.float32


def test_example_zero_tokens():
    x = np.empty((0, 3), dtype=np.float32)
    w = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    got = grouped_matmul(x, w, np.empty((0, 2), dtype=np.int64))
    assert got.shape == (0, 2, 4) and got.dtype == np.float32


def test_zero_tokens_with_bias_and_no_groups():
    got = grouped_matmul(
        np.empty((0, 3), np.float64),
        np.empty((0, 3, 4), np.float64),
        np.empty((0, 1), np.int32),
        np.empty((0, 4), np.float64),
    )
    assert got.shape == (0, 1, 4) and got.dtype == np.float64


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def _ok():
    x = np.ones((4, 3), np.float32)
    w = np.ones((4, 3, 2), np.float32)
    idx = np.zeros((4, 2), np.int64)
    b = np.ones((4, 2), np.float32)
    return x, w, idx, b


def _replace(i: int, value):
    args = list(_ok())
    args[i] = value
    return args


ERROR_CASES = [
    ("input_rank", _replace(0, np.ones((4, 3, 1), np.float32)), r"input must have rank 2"),
    ("weights_rank", _replace(1, np.ones((3, 2), np.float32)), r"weights must have rank 3"),
    ("indices_rank", _replace(2, np.zeros(4, np.int64)), r"group_indices must have rank 2"),
    ("bias_rank", _replace(3, np.ones(2, np.float32)), r"bias must have rank 2"),
    (
        "k_mismatch",
        _replace(1, np.ones((4, 5, 2), np.float32)),
        r"weights has K = 5 .*input has K = 3",
    ),
    ("m_mismatch", _replace(2, np.zeros((3, 2), np.int64)), r"group_indices has 3 rows"),
    ("bias_g", _replace(3, np.ones((3, 2), np.float32)), r"bias has G = 3 .*weights has G = 4"),
    ("bias_n", _replace(3, np.ones((4, 5), np.float32)), r"bias has N = 5 .*weights has N = 2"),
    ("input_dtype", _replace(0, np.ones((4, 3), np.int32)), r"input has dtype int32"),
    ("weights_dtype", _replace(1, np.ones((4, 3, 2), np.float64)), r"weights has dtype float64"),
    ("bias_dtype", _replace(3, np.ones((4, 2), np.float16)), r"bias has dtype float16"),
    (
        "indices_dtype",
        _replace(2, np.zeros((4, 2), np.float32)),
        r"group_indices has dtype float32",
    ),
    (
        "indices_uint",
        _replace(2, np.zeros((4, 2), np.uint32)),
        r"group_indices has dtype uint32",
    ),
    (
        "index_too_big",
        _replace(2, np.array([[0, 1], [2, 3], [1, 1], [0, 7]], np.int64)),
        r"^group_indices\[3, 1\] = 7 is outside \[0, 4\)$",
    ),
    (
        "index_equals_g",
        _replace(2, np.array([[0, 1], [4, 3], [1, 1], [0, 9]], np.int32)),
        r"^group_indices\[1, 0\] = 4 is outside \[0, 4\)$",
    ),
    (
        "negative_index",
        _replace(2, np.array([[0, 1], [2, 3], [-1, 1], [0, 0]], np.int64)),
        r"^group_indices\[2, 0\] = -1 is outside \[0, 4\)$",
    ),
]


@pytest.mark.parametrize(
    ("args", "pattern"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_errors(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        grouped_matmul(*args)


def test_index_with_no_groups_is_an_error():
    with pytest.raises(ValueError, match=r"group_indices\[0, 0\] = 0 is outside \[0, 0\)"):
        grouped_matmul(
            np.ones((1, 2), np.float32), np.ones((0, 2, 3), np.float32), np.zeros((1, 1), np.int64)
        )
