"""Numpy oracle for the ONNX ``GroupedMatMul`` operator (ai.onnx opset 29).

``output[m, i] = input[m] @ weights[group_indices[m, i]] (+ bias[group_indices[m, i]])``

Shapes: ``input [M, K]``, ``weights [G, K, N]`` (K-major, the transpose of the QMoE/MoE expert
layout), ``group_indices [M, S]``, optional ``bias [G, N]``; the output is ``[M, S, N]``.

Precision: every product and sum is computed in float64, and the result is rounded once to the
input dtype (float16, bfloat16, float32 or float64). For float16/bfloat16 this is the correctly
rounded value of the float64 result, which may be more accurate than a runtime that accumulates
in float16/float32; compare with a tolerance suited to the dtype.

Indices must lie in ``[0, G)``. Negative indices are errors (the op does not count backwards
from ``G``); this oracle raises ``ValueError`` naming the first bad position in row-major order.
Zero tokens (``M == 0``) and zero selections (``S == 0``) give empty outputs.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["grouped_matmul", "SUPPORTED_DTYPES", "SUPPORTED_INDEX_DTYPES"]

SUPPORTED_INDEX_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.int32), np.dtype(np.int64))


def _float_dtypes() -> tuple[np.dtype, ...]:
    dtypes = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)]
    try:  # bfloat16 is not a numpy dtype; ml_dtypes (an onnx dependency) provides it.
        import ml_dtypes

        dtypes.append(np.dtype(ml_dtypes.bfloat16))
    except ImportError:  # pragma: no cover - ml_dtypes ships with onnx
        pass
    return tuple(dtypes)


SUPPORTED_DTYPES: tuple[np.dtype, ...] = _float_dtypes()


def _check_rank(name: str, arr: np.ndarray, rank: int, dims: str) -> None:
    if arr.ndim != rank:
        raise ValueError(
            f"{name} must have rank {rank} {dims}, got rank {arr.ndim} with shape {arr.shape}"
        )


def grouped_matmul(
    input: npt.ArrayLike,  # named after the ONNX input
    weights: npt.ArrayLike,
    group_indices: npt.ArrayLike,
    bias: npt.ArrayLike | None = None,
) -> np.ndarray:
    """Compute ONNX ``GroupedMatMul``: ``out[m, i] = input[m] @ weights[idx[m, i]] (+ bias)``.

    Args:
        input: token matrix ``[M, K]``, float16, bfloat16, float32 or float64.
        weights: group weights ``[G, K, N]``, same dtype as ``input``.
        group_indices: ``[M, S]`` int32 or int64, every value in ``[0, G)``.
        bias: optional ``[G, N]``, same dtype as ``input``.

    Returns:
        ``[M, S, N]`` array of the input dtype (computed in float64, rounded once).

    Raises:
        ValueError: on a wrong rank, shape, dtype, or an index outside ``[0, G)``; the message
            names the offending tensor.
    """
    x = np.asarray(input)
    w = np.asarray(weights)
    idx = np.asarray(group_indices)
    b = None if bias is None else np.asarray(bias)

    _check_rank("input", x, 2, "[M, K]")
    _check_rank("weights", w, 3, "[G, K, N]")
    _check_rank("group_indices", idx, 2, "[M, S]")
    if b is not None:
        _check_rank("bias", b, 2, "[G, N]")

    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"input has dtype {x.dtype}; GroupedMatMul accepts {names}")
    if w.dtype != x.dtype:
        raise ValueError(f"weights has dtype {w.dtype}, but input has dtype {x.dtype}")
    if b is not None and b.dtype != x.dtype:
        raise ValueError(f"bias has dtype {b.dtype}, but input has dtype {x.dtype}")
    if idx.dtype not in SUPPORTED_INDEX_DTYPES:
        raise ValueError(f"group_indices has dtype {idx.dtype}; expected int32 or int64")

    m, k = x.shape
    g, wk, n = w.shape
    if wk != k:
        raise ValueError(
            f"weights has K = {wk} (shape {w.shape}), but input has K = {k} (shape {x.shape})"
        )
    if idx.shape[0] != m:
        raise ValueError(
            f"group_indices has {idx.shape[0]} rows (shape {idx.shape}), but input has M = {m} rows"
        )
    if b is not None:
        if b.shape[0] != g:
            raise ValueError(
                f"bias has G = {b.shape[0]} (shape {b.shape}), but weights has G = {g}"
            )
        if b.shape[1] != n:
            raise ValueError(
                f"bias has N = {b.shape[1]} (shape {b.shape}), but weights has N = {n}"
            )

    bad = (idx < 0) | (idx >= g)
    if bad.any():
        pos = tuple(int(p) for p in np.argwhere(bad)[0])
        raise ValueError(f"group_indices[{pos[0]}, {pos[1]}] = {int(idx[pos])} is outside [0, {g})")

    s = idx.shape[1]
    x64 = x.astype(np.float64)
    w64 = w.astype(np.float64)
    out = np.zeros((m, s, n), dtype=np.float64)
    for group in np.unique(idx):
        rows, sels = np.nonzero(idx == group)
        out[rows, sels] = x64[rows] @ w64[group]
        if b is not None:
            out[rows, sels] += b[group].astype(np.float64)
    return out.astype(x.dtype)
