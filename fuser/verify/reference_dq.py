"""A blocked ``DequantizeLinear`` for the reference path that does not replicate its scales.

onnx's reference ``DequantizeLinear`` repeats blocked scales (and zero points) to the full
shape of the codes before multiplying: for one layer of stacked int4 expert weights that is
several float32 copies of the layer (5.6 s and over 1 GB for the experts one Qwen3-30B-A3B
layer selects for 5 tokens). This one computes the same numbers, the ONNX formula
``y = (x - zero_point) * scale`` with each block's scale, by viewing the codes as
``[..., blocks, block, ...]`` and broadcasting the scales over the block axis. Anything else
(per-tensor or per-axis scales, partial blocks, float8 codes) is left to onnx's own
implementation. Per-layer verification (:mod:`.layers`) installs it; the whole-model path keeps
onnx's.
"""

from __future__ import annotations

import numpy as np
from onnx.helper import tensor_dtype_to_np_dtype
from onnx.reference.ops.op_dequantize_linear import DequantizeLinear_25, _CommonDequantizeLinear

__all__ = ["DequantizeLinear", "dequantize"]

#: Integer code types (ml_dtypes' int4/uint4 have numpy kind "V": named here).
_INTEGER = frozenset({"int4", "uint4", "int8", "uint8", "int16", "uint16", "int32", "uint32"})


def _as_float32(x: np.ndarray) -> np.ndarray:
    """``x``'s integer values as float32; one-byte codes by arithmetic on their bytes (fast).

    ml_dtypes keeps an int4 or uint4 code in the low four bits of its byte: the value is
    ``(b & 15) ^ 8 - 8`` (signed) or ``b & 15``, two vectorised passes where a 256-entry
    table lookup took 6x as long (0.3 s against 2.0 s for 40 Qwen3-size experts); the
    other one-byte types are their bytes read as int8 or uint8.
    """
    if x.dtype.itemsize != 1:
        return x.astype(np.float32)
    b = np.ascontiguousarray(x).view(np.uint8)
    name = np.dtype(x.dtype).name
    if name == "int4":
        return np.subtract((b & np.uint8(15)) ^ np.uint8(8), np.float32(8), dtype=np.float32)
    if name == "uint4":
        return (b & np.uint8(15)).astype(np.float32)
    if name == "int8":
        return b.view(np.int8).astype(np.float32)
    if name == "uint8":
        return b.astype(np.float32)
    table = np.arange(256, dtype=np.uint8).view(x.dtype).astype(np.float32)
    return table[b]


def dequantize(x, x_scale, x_zero_point=None, axis=1, block_size=0, output_dtype=None):
    """ONNX ``DequantizeLinear`` of ``x``: blocked integer codes without replicated scales.

    Anything else (per-tensor or per-axis scales, partial blocks, float8 codes) is onnx's own
    implementation (its body reads nothing of the node: it is called as a function).
    """
    fast = bool(block_size) and np.dtype(x.dtype).name in _INTEGER and x.ndim == x_scale.ndim
    if fast:
        axis = axis % x.ndim
        k, b = x.shape[axis], int(block_size)
        fast = k % b == 0 and x_scale.shape[axis] == k // b
    if not fast:
        (y,) = _CommonDequantizeLinear._run(
            None, x, x_scale, x_zero_point, axis=axis, block_size=block_size,
            output_dtype=output_dtype,
        )  # fmt: skip
        return y
    split = (*x.shape[:axis], k // b, b, *x.shape[axis + 1 :])
    per_block = (*x_scale.shape[: axis + 1], 1, *x_scale.shape[axis + 1 :])
    y = _as_float32(x).reshape(split)
    if x_zero_point is not None:
        y -= x_zero_point.astype(np.float32).reshape(per_block)
    y *= x_scale.astype(np.float32).reshape(per_block)
    dtype = tensor_dtype_to_np_dtype(output_dtype) if output_dtype else x_scale.dtype
    return y.reshape(x.shape).astype(dtype, copy=False)


class DequantizeLinear(DequantizeLinear_25):
    """ONNX ``DequantizeLinear``; blocked integer codes computed without replicated scales."""

    op_domain = ""

    def _run(self, x, x_scale, x_zero_point=None, axis=1, block_size=0, output_dtype=None):  # type: ignore[override]
        return (dequantize(x, x_scale, x_zero_point, axis, block_size, output_dtype),)
