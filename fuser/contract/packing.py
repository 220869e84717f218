"""How QMoE and MatMulNBits store integer weights: zero points, bit packing, the two layouts.

Conventions (pinned against ONNX Runtime 1.32 CPU by ``tests/verify/oracles``):

* Codes are unsigned. A code ``q`` of a ``bits``-wide weight means ``(q - zp) * scale`` with the
  symmetric zero point ``zp = 2 ** (bits - 1)``: 8 for 4-bit, 128 for 8-bit (2 for 2-bit).
* Sub-byte codes are packed along the reduction axis, the earliest element in the lowest bits:
  for 4-bit, byte ``j`` holds element ``2j`` in its low nibble and ``2j + 1`` in its high nibble.
* QMoE raw layout: weights ``[E, N, K / pack]`` uint8 (``pack`` = 2 for 4-bit, 1 for 8-bit), one
  row per output channel ``N``, packed along the reduction axis ``K``. Scales are ``[E, N]``
  (column-wise: one scale per output row) or ``[E, N, K / block_size]`` (block-wise). An
  explicit zero-point input that holds the symmetric point everywhere has
  :func:`symmetric_zero_point_byte` in every byte (:data:`QMOE_SYMMETRIC_ZERO_POINT_BYTE`).
* QMoE zero points (inputs 11-13; measured on ORT 1.32 CPU, the shapes of its schema): codes in
  the weights' unsigned code space, ``value = (q - zp) * scale``, packed like the codes (earliest
  lowest, a last partial byte padded with 0 bits). Column-wise (no ``block_size``): ``[E,
  ceil(N * bits / 8)]``, packed along the output channels ``N``; block-wise: ``[E, N,
  ceil(K / block_size * bits / 8)]``, packed along the blocks of each row
  (:func:`pack_qmoe_zero_points`, :func:`unpack_qmoe_zero_points`).
* MatMulNBits layout: ``B [N, k_blocks, blob_size]`` uint8 with ``k_blocks = ceil(K / block_size)``
  and ``blob_size = block_size * bits / 8``; scales ``[N, k_blocks]``; no zero-point input means
  the symmetric zero point above. A last partial block is padded with the zero-point code.

The rules pack with these (``rewrites/moe/emit.py``, ``rewrites/qkv/projections.py``) and the
canonical passes unpack with them; the oracles' quantisation and dequantisation
(``onnx_moe_fuse.verify.oracles.quant``) build on them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = [
    "MATMUL_NBITS_BITS",
    "PACKABLE_BITS",
    "QMOE_BITS",
    "QMOE_SYMMETRIC_ZERO_POINT_BYTE",
    "check_bits",
    "check_block_size",
    "nbits_blocks",
    "pack_bits",
    "pack_matmul_nbits",
    "pack_qmoe",
    "pack_qmoe_zero_points",
    "pack_size",
    "symmetric_zero_point_byte",
    "unpack_bits",
    "unpack_matmul_nbits",
    "unpack_qmoe",
    "unpack_qmoe_zero_points",
    "zero_point",
]

#: QMoE's ``expert_weight_bits``.
QMOE_BITS: tuple[int, ...] = (4, 8)
#: MatMulNBits' ``bits``.
MATMUL_NBITS_BITS: tuple[int, ...] = (2, 4, 8)
#: The code widths the byte packing knows.
PACKABLE_BITS: tuple[int, ...] = (2, 4, 8)


def check_bits(bits: int, allowed: tuple[int, ...] = PACKABLE_BITS, name: str = "bits") -> int:
    """``bits`` as an int when it is one of ``allowed``; else ``ValueError`` naming ``name``."""
    if (
        isinstance(bits, bool)
        or not isinstance(bits, (int, np.integer))
        or int(bits) not in allowed
    ):
        raise ValueError(f"{name} must be one of {allowed}, got {bits!r}")
    return int(bits)


def check_block_size(block_size: int, name: str = "block_size") -> int:
    """``block_size`` as an int when it is a positive integer; else ``ValueError``."""
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(f"{name} must be a positive integer, got {block_size!r}")
    if block_size <= 0:
        raise ValueError(f"{name} must be a positive integer, got {block_size}")
    return int(block_size)


def zero_point(bits: int) -> int:
    """Return the symmetric zero point ``2 ** (bits - 1)`` (8 for 4-bit, 128 for 8-bit)."""
    bits = check_bits(bits)
    return 1 << (bits - 1)


def pack_size(bits: int) -> int:
    """Return how many codes one byte holds: 2 for 4-bit, 1 for 8-bit, 4 for 2-bit."""
    bits = check_bits(bits)
    return 8 // bits


def pack_bits(codes: npt.ArrayLike, bits: int) -> np.ndarray:
    """Pack unsigned ``codes [..., K]`` into uint8 ``[..., K * bits / 8]``, earliest code lowest.

    ``K`` must be a multiple of ``8 / bits`` and every code must be below ``2 ** bits``.
    """
    bits = check_bits(bits)
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
    bits = check_bits(bits)
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        raise ValueError(f"packed must be uint8, got dtype {p.dtype}")
    if p.ndim < 1:
        raise ValueError("packed must have rank >= 1 (packed along the last axis)")
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(p >> (j * bits)) & mask for j in range(per)]
    return np.stack(parts, axis=-1).reshape(*p.shape[:-1], p.shape[-1] * per).astype(np.uint8)


def symmetric_zero_point_byte(bits: int) -> int:
    """The byte of a packed zero-point input holding the symmetric point: 0x88 for 4-bit, 0x80 for 8."""
    bits = check_bits(bits)
    return int(pack_bits(np.full(8 // bits, zero_point(bits)), bits)[0])


#: :func:`symmetric_zero_point_byte` for QMoE's bit widths: every byte of a zero-point input
#: that holds the symmetric point.
QMOE_SYMMETRIC_ZERO_POINT_BYTE: dict[int, int] = {
    bits: symmetric_zero_point_byte(bits) for bits in QMOE_BITS
}


# -- QMoE raw layout ------------------------------------------------------------------------------


def pack_qmoe(codes: npt.ArrayLike, bits: int) -> np.ndarray:
    """Pack codes ``[E, N, K]`` into QMoE's raw layout ``[E, N, K / pack]`` uint8."""
    bits = check_bits(bits, QMOE_BITS, "bits (QMoE expert_weight_bits)")
    c = np.asarray(codes)
    if c.ndim != 3:
        raise ValueError(f"codes must have rank 3 [E, N, K], got shape {c.shape}")
    return pack_bits(c, bits)


def unpack_qmoe(packed: npt.ArrayLike, bits: int) -> np.ndarray:
    """Unpack QMoE raw weights ``[E, N, K / pack]`` into uint8 codes ``[E, N, K]``."""
    bits = check_bits(bits, QMOE_BITS, "bits (QMoE expert_weight_bits)")
    p = np.asarray(packed)
    if p.ndim != 3:
        raise ValueError(f"packed must have rank 3 [E, N, K/pack], got shape {p.shape}")
    return unpack_bits(p, bits)


def _pack_padded(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack ``codes [..., M]`` along the last axis, padding it with 0 codes to whole bytes."""
    per = 8 // bits
    pad = -codes.shape[-1] % per
    if pad:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], pad), codes.dtype)], axis=-1)
    return pack_bits(codes, bits)


def pack_qmoe_zero_points(zero_points: npt.ArrayLike, bits: int, blockwise: bool) -> np.ndarray:
    """Pack zero-point codes ``[E, N, blocks]`` into a QMoE zero-point input (uint8).

    ``blockwise`` False (the node has no ``block_size``): ``blocks`` must be 1 and the result
    is ``[E, ceil(N * bits / 8)]``, packed along ``N``; True: ``[E, N, ceil(blocks * bits /
    8)]``, packed along the blocks. Every code must be below ``2 ** bits``.
    """
    bits = check_bits(bits, QMOE_BITS, "bits (QMoE expert_weight_bits)")
    z = np.asarray(zero_points)
    if z.ndim != 3:
        raise ValueError(f"zero points must have rank 3 [E, N, blocks], got shape {z.shape}")
    if not np.issubdtype(z.dtype, np.integer):
        raise ValueError(f"zero points must be integers, got dtype {z.dtype}")
    if blockwise:
        return _pack_padded(z, bits)
    if z.shape[2] != 1:
        raise ValueError(f"column-wise zero points have one block per row, got shape {z.shape}")
    return _pack_padded(z[:, :, 0], bits)


def unpack_qmoe_zero_points(
    packed: npt.ArrayLike, bits: int, n: int, blocks: int | None
) -> np.ndarray:
    """Unpack a QMoE zero-point input into uint8 codes ``[E, N, blocks]`` (the inverse above).

    ``blocks`` None: the column-wise ``[E, ceil(N * bits / 8)]`` form (one block per row);
    else the block-wise ``[E, N, ceil(blocks * bits / 8)]`` form. ``ValueError`` on a shape
    that is neither.
    """
    bits = check_bits(bits, QMOE_BITS, "bits (QMoE expert_weight_bits)")
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        raise ValueError(f"zero points must be uint8, got dtype {p.dtype}")
    per = 8 // bits
    if blocks is None:
        want: tuple[int, ...] = (-(-n // per),)
        if p.ndim != 2 or p.shape[1:] != want:
            raise ValueError(
                f"column-wise zero points must have shape [E, {want[0]}] (N = {n}), got {p.shape}"
            )
        return unpack_bits(p, bits)[:, :n, None]
    want = (n, -(-blocks // per))
    if p.ndim != 3 or p.shape[1:] != want:
        raise ValueError(
            f"block-wise zero points must have shape [E, {want[0]}, {want[1]}] (N = {n}, "
            f"{blocks} blocks), got {p.shape}"
        )
    return unpack_bits(p, bits)[:, :, :blocks]


# -- MatMulNBits layout ---------------------------------------------------------------------------


def nbits_blocks(k: int, bits: int, block_size: int) -> tuple[int, int]:
    """``(k_blocks, blob_size)`` of MatMulNBits' ``B`` for ``K = k``; ``ValueError`` if none."""
    if k <= 0:
        raise ValueError(f"K must be positive, got {k}")
    if (block_size * bits) % 8:
        raise ValueError(f"block_size = {block_size} times bits = {bits} is not a whole byte count")
    return -(-k // block_size), block_size * bits // 8


def pack_matmul_nbits(codes: npt.ArrayLike, bits: int = 4, block_size: int = 32) -> np.ndarray:
    """Pack codes ``[N, K]`` into MatMulNBits ``B [N, ceil(K / block_size), blob_size]`` uint8.

    A last partial block is padded with the zero-point code (it dequantizes to 0).
    """
    bits = check_bits(bits, MATMUL_NBITS_BITS)
    block_size = check_block_size(block_size)
    c = np.asarray(codes)
    if c.ndim != 2:
        raise ValueError(f"codes must have rank 2 [N, K], got shape {c.shape}")
    n, k = c.shape
    kb, _ = nbits_blocks(k, bits, block_size)
    padded = np.full((n, kb * block_size), zero_point(bits), dtype=np.int64)
    padded[:, :k] = c
    return pack_bits(padded.reshape(n, kb, block_size), bits)


def unpack_matmul_nbits(
    packed: npt.ArrayLike,
    K: int,  # noqa: N803 - the ONNX attribute name
    bits: int = 4,
    block_size: int = 32,
) -> np.ndarray:
    """Unpack MatMulNBits ``B [N, k_blocks, blob_size]`` into uint8 codes ``[N, K]``."""
    bits = check_bits(bits, MATMUL_NBITS_BITS)
    block_size = check_block_size(block_size)
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        raise ValueError(f"B must be uint8, got dtype {p.dtype}")
    if p.ndim != 3:
        raise ValueError(f"B must have rank 3 [N, k_blocks, blob_size], got shape {p.shape}")
    kb, blob = nbits_blocks(K, bits, block_size)
    if p.shape[1:] != (kb, blob):
        raise ValueError(
            f"B must have shape [N, {kb}, {blob}] for K = {K}, bits = {bits}, "
            f"block_size = {block_size}, got {p.shape}"
        )
    return unpack_bits(p, bits).reshape(p.shape[0], kb * block_size)[:, :K]
