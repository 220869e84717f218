"""Symmetric quantisation of QMoE and MatMulNBits weights, and its inverse, in plain numpy.

The layouts (zero points, bit packing, QMoE's raw ``[E, N, K / pack]`` and MatMulNBits'
``B [N, k_blocks, blob_size]``) are ONNX Runtime's, defined once in
:mod:`onnx_moe_fuse.contract.packing`; the packing names are re-exported here, where the tests
and the samples have always imported them.

``quantize_*`` helpers make test data: ``scale = max|w| / (2 ** (bits - 1) - 1)`` per row (or per
block), rounded to ``scale_dtype`` before the codes are computed, so ``dequantize`` of the result is
the closest grid point to ``w`` (or a stochastic rounding to a neighbour when ``rng`` is given).
``dequantize_*`` compute ``(code - zero point) * scale`` in float64, rounded once.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from onnx_moe_fuse.contract.packing import (
    MATMUL_NBITS_BITS,
    QMOE_BITS,
    check_bits,
    check_block_size,
    nbits_blocks,
    pack_bits,
    pack_matmul_nbits,
    pack_qmoe,
    pack_size,
    unpack_bits,
    unpack_matmul_nbits,
    unpack_qmoe,
    zero_point,
)

__all__ = [
    "QMOE_BITS",
    "MATMUL_NBITS_BITS",
    "zero_point",
    "pack_size",
    "pack_bits",
    "unpack_bits",
    "pack_qmoe",
    "unpack_qmoe",
    "quantize_symmetric",
    "dequantize_qmoe",
    "pack_matmul_nbits",
    "unpack_matmul_nbits",
    "quantize_matmul_nbits",
    "dequantize_matmul_nbits",
]


def _round_codes(ratio: np.ndarray, bits: int, rng: np.random.Generator | None) -> np.ndarray:
    lo = -(1 << (bits - 1))
    hi = (1 << (bits - 1)) - 1
    if rng is None:
        q = np.rint(ratio)
    else:
        q = np.floor(ratio + rng.random(ratio.shape))
    return (np.clip(q, lo, hi) - lo).astype(np.uint8)


def _symmetric_scales(amax: np.ndarray, bits: int, scale_dtype: npt.DTypeLike) -> np.ndarray:
    qmax = (1 << (bits - 1)) - 1
    scales = (amax / qmax).astype(scale_dtype)
    # An all-zero row or block gets scale 1 (its codes are all zero points, so it stays zero).
    return np.where(scales == 0, np.ones_like(scales), scales)


def quantize_symmetric(
    w: npt.ArrayLike,
    bits: int,
    block_size: int | None = None,
    rng: np.random.Generator | None = None,
    *,
    scale_dtype: npt.DTypeLike = np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize float expert weights ``w [E, N, K]`` to QMoE raw layout.

    Args:
        w: float weights, output-major: ``N`` output channels, ``K`` reduction elements.
        bits: 4 or 8.
        block_size: ``None`` for column-wise scales ``[E, N]``; otherwise it must divide ``K``
            and the scales are ``[E, N, K / block_size]``.
        rng: when given, codes are rounded stochastically (unbiased) instead of to nearest, so
            test data hits both neighbours of each grid point.
        scale_dtype: dtype of the returned scales (float32 by default, as ORT's QMoE expects
            for float32 activations).

    Returns:
        ``(packed uint8 [E, N, K / pack], scales)``.
    """
    bits = check_bits(bits, QMOE_BITS, "bits (QMoE expert_weight_bits)")
    wf = np.asarray(w, dtype=np.float64)
    if wf.ndim != 3:
        raise ValueError(f"w must have rank 3 [E, N, K], got shape {wf.shape}")
    e, n, k = wf.shape
    if bits == 4 and k % 2:
        raise ValueError(f"w has K = {k}; 4-bit QMoE packing needs an even K")
    if block_size is None:
        scales = _symmetric_scales(np.abs(wf).max(axis=2, initial=0.0), bits, scale_dtype)
        ratio = wf / scales.astype(np.float64)[..., None]
    else:
        block_size = check_block_size(block_size)
        if k % block_size:
            raise ValueError(f"block_size = {block_size} does not divide w's K = {k}")
        blocks = wf.reshape(e, n, k // block_size, block_size)
        scales = _symmetric_scales(np.abs(blocks).max(axis=3, initial=0.0), bits, scale_dtype)
        ratio = (blocks / scales.astype(np.float64)[..., None]).reshape(e, n, k)
    codes = _round_codes(ratio, bits, rng)
    return pack_bits(codes, bits), scales


def dequantize_qmoe(
    packed: npt.ArrayLike,
    scales: npt.ArrayLike,
    bits: int,
    block_size: int | None = None,
    *,
    dtype: npt.DTypeLike = np.float32,
    zero_points: npt.ArrayLike | None = None,
) -> np.ndarray:
    """Dequantize QMoE raw weights ``[E, N, K / pack]`` to ``[E, N, K]`` of ``dtype``.

    ``value = (code - zp) * scale`` with ``zp`` 8 (4-bit) or 128 (8-bit), or the unpacked
    ``zero_points`` codes given (the scales' shape: ``[E, N]`` or ``[E, N, K / block_size]``).
    With ``block_size`` ``None`` the scales are ``[E, N]``; otherwise ``[E, N, K / block_size]``
    and ``block_size`` must divide ``K``. The product is formed in float64 (exact) and rounded
    once to ``dtype``.
    """
    bits = check_bits(bits, QMOE_BITS, "bits (QMoE expert_weight_bits)")
    p = np.asarray(packed)
    s = np.asarray(scales)
    if p.dtype != np.uint8:
        raise ValueError(f"packed weights must be uint8, got dtype {p.dtype}")
    if p.ndim != 3:
        raise ValueError(f"packed weights must have rank 3 [E, N, K/pack], got shape {p.shape}")
    if not np.issubdtype(s.dtype, np.floating):
        raise ValueError(f"scales must be floating point, got dtype {s.dtype}")
    e, n, kp = p.shape
    k = kp * pack_size(bits)
    codes = unpack_bits(p, bits).astype(np.float64)
    if zero_points is None:
        zp = np.full(s.shape, float(zero_point(bits)))
    else:
        zp = np.asarray(zero_points).astype(np.float64)
        if zp.shape != s.shape:
            raise ValueError(f"zero points must have the scales' shape {s.shape}, got {zp.shape}")
    if block_size is None:
        if s.shape != (e, n):
            raise ValueError(f"column-wise scales must have shape [E, N] = {(e, n)}, got {s.shape}")
        out = (codes - zp[..., None]) * s.astype(np.float64)[..., None]
    else:
        block_size = check_block_size(block_size)
        if k % block_size:
            raise ValueError(f"block_size = {block_size} does not divide K = {k}")
        nb = k // block_size
        if s.shape != (e, n, nb):
            raise ValueError(
                f"block-wise scales must have shape [E, N, K/block_size] = {(e, n, nb)}, "
                f"got {s.shape}"
            )
        blocks = codes.reshape(e, n, nb, block_size) - zp[..., None]
        out = (blocks * s.astype(np.float64)[..., None]).reshape(e, n, k)
    return out.astype(dtype)


def quantize_matmul_nbits(
    w: npt.ArrayLike,
    bits: int = 4,
    block_size: int = 32,
    rng: np.random.Generator | None = None,
    *,
    scale_dtype: npt.DTypeLike = np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``w [N, K]`` (one row per output column) to MatMulNBits ``(B, scales)``.

    Returns ``B [N, k_blocks, blob_size]`` uint8 and ``scales [N, k_blocks]`` of
    ``scale_dtype`` (MatMulNBits wants the activation dtype: float16 for float16 ``A``).
    """
    bits = check_bits(bits, MATMUL_NBITS_BITS)
    block_size = check_block_size(block_size)
    wf = np.asarray(w, dtype=np.float64)
    if wf.ndim != 2:
        raise ValueError(f"w must have rank 2 [N, K], got shape {wf.shape}")
    n, k = wf.shape
    kb, _ = nbits_blocks(k, bits, block_size)
    padded = np.zeros((n, kb * block_size))
    padded[:, :k] = wf
    blocks = padded.reshape(n, kb, block_size)
    scales = _symmetric_scales(np.abs(blocks).max(axis=2), bits, scale_dtype)
    ratio = blocks / scales.astype(np.float64)[..., None]
    codes = _round_codes(ratio, bits, rng).reshape(n, kb * block_size)[:, :k]
    return pack_matmul_nbits(codes, bits, block_size), scales


def dequantize_matmul_nbits(
    packed: npt.ArrayLike,
    scales: npt.ArrayLike,
    K: int,  # the ONNX attribute name
    bits: int = 4,
    block_size: int = 32,
    *,
    dtype: npt.DTypeLike = np.float32,
) -> np.ndarray:
    """Dequantize MatMulNBits ``B [N, k_blocks, blob]`` with ``scales [N, k_blocks]`` to ``[N, K]``.

    ``value = (code - zp) * scale`` with the symmetric zero point (8 for 4-bit), computed in
    float64 and rounded once to ``dtype``.
    """
    codes = unpack_matmul_nbits(packed, K, bits, block_size)
    s = np.asarray(scales)
    n = codes.shape[0]
    kb = -(-K // block_size)
    if s.shape != (n, kb):
        raise ValueError(f"scales must have shape [N, k_blocks] = {(n, kb)}, got {s.shape}")
    if not np.issubdtype(s.dtype, np.floating):
        raise ValueError(f"scales must be floating point, got dtype {s.dtype}")
    per_elem = np.repeat(s.astype(np.float64), block_size, axis=1)[:, :K]
    return ((codes.astype(np.float64) - zero_point(bits)) * per_elem).astype(dtype)
