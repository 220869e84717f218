"""Symmetric integer weight packing for ONNX Runtime's QMoE and MatMulNBits, in plain numpy.

Conventions (pinned against ONNX Runtime 1.32 CPU by ``tests/verify/oracles``):

* Codes are unsigned. A code ``q`` of a ``bits``-wide weight means ``(q - zp) * scale`` with the
  symmetric zero point ``zp = 2 ** (bits - 1)``: 8 for 4-bit, 128 for 8-bit (2 for 2-bit).
* Sub-byte codes are packed along the reduction axis, the earliest element in the lowest bits:
  for 4-bit, byte ``j`` holds element ``2j`` in its low nibble and ``2j + 1`` in its high nibble.
* QMoE raw layout: weights ``[E, N, K / pack]`` uint8 (``pack`` = 2 for 4-bit, 1 for 8-bit), one
  row per output channel ``N``, packed along the reduction axis ``K``. Scales are ``[E, N]``
  (column-wise: one scale per output row) or ``[E, N, K / block_size]`` (block-wise).
* MatMulNBits layout: ``B [N, k_blocks, blob_size]`` uint8 with ``k_blocks = ceil(K / block_size)``
  and ``blob_size = block_size * bits / 8``; scales ``[N, k_blocks]``; no zero-point input means
  the symmetric zero point above. A last partial block is padded with the zero-point code.

``quantize_*`` helpers make test data: ``scale = max|w| / (2 ** (bits - 1) - 1)`` per row (or per
block), rounded to ``scale_dtype`` before the codes are computed, so ``dequantize`` of the result is
the closest grid point to ``w`` (or a stochastic rounding to a neighbour when ``rng`` is given).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

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

QMOE_BITS: tuple[int, ...] = (4, 8)
MATMUL_NBITS_BITS: tuple[int, ...] = (2, 4, 8)
_PACKABLE_BITS: tuple[int, ...] = (2, 4, 8)


def _check_bits(bits: int, allowed: tuple[int, ...], name: str = "bits") -> int:
    if (
        isinstance(bits, bool)
        or not isinstance(bits, (int, np.integer))
        or int(bits) not in allowed
    ):
        raise ValueError(f"{name} must be one of {allowed}, got {bits!r}")
    return int(bits)


def _check_block_size(block_size: int, name: str = "block_size") -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(f"{name} must be a positive integer, got {block_size!r}")
    if block_size <= 0:
        raise ValueError(f"{name} must be a positive integer, got {block_size}")
    return int(block_size)


def zero_point(bits: int) -> int:
    """Return the symmetric zero point ``2 ** (bits - 1)`` (8 for 4-bit, 128 for 8-bit)."""
    bits = _check_bits(bits, _PACKABLE_BITS)
    return 1 << (bits - 1)


def pack_size(bits: int) -> int:
    """Return how many codes one byte holds: 2 for 4-bit, 1 for 8-bit, 4 for 2-bit."""
    bits = _check_bits(bits, _PACKABLE_BITS)
    return 8 // bits


def pack_bits(codes: npt.ArrayLike, bits: int) -> np.ndarray:
    """Pack unsigned ``codes [..., K]`` into uint8 ``[..., K * bits / 8]``, earliest code lowest.

    ``K`` must be a multiple of ``8 / bits`` and every code must be below ``2 ** bits``.
    """
    bits = _check_bits(bits, _PACKABLE_BITS)
    c = np.asarray(codes)
    if not np.issubdtype(c.dtype, np.integer):
        raise ValueError(f"codes must be an integer array, got dtype {c.dtype}")
    if c.ndim < 1:
        raise ValueError("codes must have rank >= 1 (packed along the last axis)")
    per = 8 // bits
    if c.shape[-1] % per:
        raise ValueError(
            f"codes has {c.shape[-1]} elements on its last axis, not a multiple of {per} "
            f"({bits}-bit codes pack {per} to a byte)"
        )
    if c.size and (c.min() < 0 or c.max() >= (1 << bits)):
        raise ValueError(f"codes must lie in [0, {1 << bits}) for {bits}-bit packing")
    c = c.astype(np.uint8).reshape(*c.shape[:-1], c.shape[-1] // per, per)
    packed = np.zeros(c.shape[:-1], dtype=np.uint8)
    for j in range(per):
        packed |= (c[..., j] << (j * bits)).astype(np.uint8)
    return packed


def unpack_bits(packed: npt.ArrayLike, bits: int) -> np.ndarray:
    """Unpack uint8 ``[..., B]`` into uint8 codes ``[..., B * 8 / bits]``, earliest code lowest."""
    bits = _check_bits(bits, _PACKABLE_BITS)
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        raise ValueError(f"packed must be uint8, got dtype {p.dtype}")
    if p.ndim < 1:
        raise ValueError("packed must have rank >= 1 (packed along the last axis)")
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(p >> (j * bits)) & mask for j in range(per)]
    return np.stack(parts, axis=-1).reshape(*p.shape[:-1], p.shape[-1] * per).astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# QMoE raw layout
# ---------------------------------------------------------------------------------------------


def pack_qmoe(codes: npt.ArrayLike, bits: int) -> np.ndarray:
    """Pack codes ``[E, N, K]`` into QMoE's raw layout ``[E, N, K / pack]`` uint8."""
    bits = _check_bits(bits, QMOE_BITS, "bits (QMoE expert_weight_bits)")
    c = np.asarray(codes)
    if c.ndim != 3:
        raise ValueError(f"codes must have rank 3 [E, N, K], got shape {c.shape}")
    return pack_bits(c, bits)


def unpack_qmoe(packed: npt.ArrayLike, bits: int) -> np.ndarray:
    """Unpack QMoE raw weights ``[E, N, K / pack]`` into uint8 codes ``[E, N, K]``."""
    bits = _check_bits(bits, QMOE_BITS, "bits (QMoE expert_weight_bits)")
    p = np.asarray(packed)
    if p.ndim != 3:
        raise ValueError(f"packed must have rank 3 [E, N, K/pack], got shape {p.shape}")
    return unpack_bits(p, bits)


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
    bits = _check_bits(bits, QMOE_BITS, "bits (QMoE expert_weight_bits)")
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
        block_size = _check_block_size(block_size)
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
) -> np.ndarray:
    """Dequantize QMoE raw weights ``[E, N, K / pack]`` to ``[E, N, K]`` of ``dtype``.

    ``value = (code - zp) * scale`` with ``zp`` 8 (4-bit) or 128 (8-bit). With ``block_size``
    ``None`` the scales are ``[E, N]``; otherwise ``[E, N, K / block_size]`` and ``block_size``
    must divide ``K``. The product is formed in float64 (exact) and rounded once to ``dtype``.
    """
    bits = _check_bits(bits, QMOE_BITS, "bits (QMoE expert_weight_bits)")
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
    codes = unpack_bits(p, bits).astype(np.float64) - zero_point(bits)
    if block_size is None:
        if s.shape != (e, n):
            raise ValueError(f"column-wise scales must have shape [E, N] = {(e, n)}, got {s.shape}")
        out = codes * s.astype(np.float64)[..., None]
    else:
        block_size = _check_block_size(block_size)
        if k % block_size:
            raise ValueError(f"block_size = {block_size} does not divide K = {k}")
        nb = k // block_size
        if s.shape != (e, n, nb):
            raise ValueError(
                f"block-wise scales must have shape [E, N, K/block_size] = {(e, n, nb)}, "
                f"got {s.shape}"
            )
        out = codes.reshape(e, n, nb, block_size) * s.astype(np.float64)[..., None]
        out = out.reshape(e, n, k)
    return out.astype(dtype)


# ---------------------------------------------------------------------------------------------
# MatMulNBits layout
# ---------------------------------------------------------------------------------------------


def _nbits_geometry(k: int, bits: int, block_size: int) -> tuple[int, int]:
    if k <= 0:
        raise ValueError(f"K must be positive, got {k}")
    if (block_size * bits) % 8:
        raise ValueError(f"block_size = {block_size} times bits = {bits} is not a whole byte count")
    return -(-k // block_size), block_size * bits // 8


def pack_matmul_nbits(codes: npt.ArrayLike, bits: int = 4, block_size: int = 32) -> np.ndarray:
    """Pack codes ``[N, K]`` into MatMulNBits ``B [N, ceil(K / block_size), blob_size]`` uint8.

    A last partial block is padded with the zero-point code (it dequantizes to 0).
    """
    bits = _check_bits(bits, MATMUL_NBITS_BITS)
    block_size = _check_block_size(block_size)
    c = np.asarray(codes)
    if c.ndim != 2:
        raise ValueError(f"codes must have rank 2 [N, K], got shape {c.shape}")
    n, k = c.shape
    kb, _ = _nbits_geometry(k, bits, block_size)
    padded = np.full((n, kb * block_size), zero_point(bits), dtype=np.int64)
    padded[:, :k] = c
    return pack_bits(padded.reshape(n, kb, block_size), bits)


def unpack_matmul_nbits(
    packed: npt.ArrayLike,
    K: int,  # the ONNX attribute name
    bits: int = 4,
    block_size: int = 32,
) -> np.ndarray:
    """Unpack MatMulNBits ``B [N, k_blocks, blob_size]`` into uint8 codes ``[N, K]``."""
    bits = _check_bits(bits, MATMUL_NBITS_BITS)
    block_size = _check_block_size(block_size)
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        raise ValueError(f"B must be uint8, got dtype {p.dtype}")
    if p.ndim != 3:
        raise ValueError(f"B must have rank 3 [N, k_blocks, blob_size], got shape {p.shape}")
    kb, blob = _nbits_geometry(K, bits, block_size)
    if p.shape[1:] != (kb, blob):
        raise ValueError(
            f"B must have shape [N, {kb}, {blob}] for K = {K}, bits = {bits}, "
            f"block_size = {block_size}, got {p.shape}"
        )
    return unpack_bits(p, bits).reshape(p.shape[0], kb * block_size)[:, :K]


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
    bits = _check_bits(bits, MATMUL_NBITS_BITS)
    block_size = _check_block_size(block_size)
    wf = np.asarray(w, dtype=np.float64)
    if wf.ndim != 2:
        raise ValueError(f"w must have rank 2 [N, K], got shape {wf.shape}")
    n, k = wf.shape
    kb, _ = _nbits_geometry(k, bits, block_size)
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
