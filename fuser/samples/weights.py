"""Quantisation of sample expert weights for ``DequantizeLinear`` (GroupedMatMul's ``[E, K, N]``).

These helpers make test data in standard-ONNX form: the quantized tensor keeps GroupedMatMul's
K-major layout ``[E, K, N]`` and ``DequantizeLinear`` dequantizes along ``axis=1`` (K, the
reduction axis). They are not the project's QMoE packing (``onnx_moe_fuse.contract.packing``,
quantised by ``onnx_moe_fuse.verify.oracles.quant``), which works in QMoE's output-major layout.

* int4, blocked along K: signed int4 codes in ``[-7, 7]``, no zero point (so 0, the symmetric
  point for a signed type), scales ``[E, K / block, N]``; ``DequantizeLinear(axis=1,
  block_size=block)``.
* uint8 per output channel, symmetric: codes in ``[1, 255]``, zero point 128 everywhere, scales and
  zero points ``[E, 1, N]``; written as blocked ``DequantizeLinear(axis=1, block_size=K)`` (one
  block spanning K is one scale per expert and output channel, which a per-axis DQ cannot say).
* uint8 per output channel, asymmetric (a near miss): min/max quantisation, zero points that are
  not 128.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["quantize_int4_blocked", "quantize_uint8_channel", "quantize_uint8_asymmetric"]


def quantize_int4_blocked(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``w [E, K, N]`` to signed int4 blocked along K; returns ``(codes, scales)``."""
    e, k, n = w.shape
    if k % block:
        raise ValueError(f"K = {k} is not a multiple of the block size {block}")
    blocks = w.reshape(e, k // block, block, n)
    scale = (np.abs(blocks).max(axis=2) / 7.0).astype(np.float32)  # [E, K/block, N]
    codes = np.clip(np.rint(blocks / scale[:, :, None, :]), -7, 7).reshape(e, k, n)
    return codes.astype(np.int8).astype(ml_dtypes.int4), scale


def quantize_uint8_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize ``w [E, K, N]`` to uint8 per (expert, output channel), zero point 128."""
    scale = (np.abs(w).max(axis=1, keepdims=True) / 127.0).astype(np.float32)  # [E, 1, N]
    codes = np.clip(np.rint(w / scale) + 128, 0, 255).astype(np.uint8)
    zero_point = np.full(scale.shape, 128, dtype=np.uint8)
    return codes, scale, zero_point


def quantize_uint8_asymmetric(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize ``w [E, K, N]`` to uint8 per channel by min/max: zero points are not all 128."""
    lo = np.minimum(w.min(axis=1, keepdims=True), 0.0)
    hi = np.maximum(w.max(axis=1, keepdims=True), 0.0)
    scale = ((hi - lo) / 255.0).astype(np.float32)
    zero_point = np.clip(np.rint(-lo / scale), 0, 255).astype(np.uint8)
    if np.all(zero_point == 128):  # pragma: no cover - random weights never do this
        zero_point[0, 0, 0] = 100
    codes = np.clip(np.rint(w / scale) + zero_point, 0, 255).astype(np.uint8)
    return codes, scale, zero_point
