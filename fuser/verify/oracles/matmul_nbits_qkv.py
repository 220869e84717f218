"""Numpy oracle for ``com.microsoft.MatMulNBitsQkv``: RMSNorm (+ skip) then three MatMulNBits.

``MatMulNBitsQkv(A, skip, norm_scale, q_B, q_scales, k_B, k_scales, v_B, v_scales)`` means::

    s = A + skip                         # when skip is given; output 3 (residual) is s
    normed = s / sqrt(mean(s * s, axis=-1) + epsilon) * norm_scale
    Q = normed @ dequant(q_B, q_scales).T    # [..., Nq]
    K = normed @ dequant(k_B, k_scales).T    # [..., Nkv]
    V = normed @ dequant(v_B, v_scales).T    # [..., Nkv]

which equals ONNX Runtime's CPU composition ``SimplifiedLayerNormalization`` (ai.onnx domain) or
``com.microsoft.SkipSimplifiedLayerNormalization`` followed by three ``com.microsoft.MatMulNBits``.
MatMulNBits weights use the layout of :mod:`onnx_moe_fuse.contract.packing`: ``B [N, k_blocks,
blob_size]`` uint8, scales ``[N, k_blocks]`` of the activation dtype, symmetric zero point
(8 for 4-bit), low bits first.

Precision: inputs may be float16, float32 or float64; everything is computed in float64 and
each output is rounded once to the input dtype. The normalised activations are *not* rounded to
the input dtype before the matmuls (ORT's float16 composition rounds them, the fused kernels do
not), so float16 comparisons need a float16-sized tolerance.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from onnx_moe_fuse.contract.packing import MATMUL_NBITS_BITS
from onnx_moe_fuse.verify.oracles.quant import dequantize_matmul_nbits

__all__ = ["rms_norm", "matmul_nbits", "matmul_nbits_qkv"]

_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _check_float(name: str, arr: np.ndarray) -> None:
    if arr.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, float32 or float64, got dtype {arr.dtype}")


def _check_same_dtype(name: str, arr: np.ndarray, ref: np.ndarray, ref_name: str) -> None:
    if arr.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {arr.dtype}, but {ref_name} has dtype {ref.dtype}")


def _rms_norm64(
    a: np.ndarray, scale: np.ndarray, epsilon: float, skip: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    s = a.astype(np.float64)
    if skip is not None:
        s = s + skip.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + float(epsilon))
    return s * inv * scale.astype(np.float64), (s if skip is not None else None)


def _validate_norm(
    a: np.ndarray, scale: np.ndarray, epsilon: float, skip: np.ndarray | None
) -> None:
    _check_float("a", a)
    if a.ndim < 1 or a.shape[-1] == 0:
        raise ValueError(f"a must have rank >= 1 and a non-empty last axis, got shape {a.shape}")
    _check_same_dtype("norm_scale", scale, a, "a")
    if scale.shape != (a.shape[-1],):
        raise ValueError(f"norm_scale must have shape [K] = ({a.shape[-1]},), got {scale.shape}")
    if skip is not None:
        _check_same_dtype("skip", skip, a, "a")
        if skip.shape != a.shape:
            raise ValueError(f"skip must have a's shape {a.shape}, got {skip.shape}")
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.floating)):
        raise ValueError(f"epsilon must be a real number, got {epsilon!r}")
    if not np.isfinite(epsilon) or epsilon < 0:
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon!r}")


def rms_norm(
    a: npt.ArrayLike,
    scale: npt.ArrayLike,
    epsilon: float,
    skip: npt.ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """RMS-normalise the last axis of ``a (+ skip)`` and multiply by ``scale``.

    Returns ``(normed, residual)``, both of ``a``'s dtype and shape; ``residual`` is
    ``a + skip`` when ``skip`` is given, else ``None`` (SkipSimplifiedLayerNormalization's
    output 3).
    """
    av = np.asarray(a)
    sc = np.asarray(scale)
    sk = None if skip is None else np.asarray(skip)
    _validate_norm(av, sc, epsilon, sk)
    normed, residual = _rms_norm64(av, sc, epsilon, sk)
    return normed.astype(av.dtype), (None if residual is None else residual.astype(av.dtype))


def _check_nbits(
    b_name: str,
    s_name: str,
    b: np.ndarray,
    scales: np.ndarray,
    act: np.ndarray,
    k: int,
    n: int | None,
    bits: int,
    block_size: int,
) -> int:
    if b.dtype != np.uint8:
        raise ValueError(f"{b_name} must be uint8, got dtype {b.dtype}")
    if b.ndim != 3:
        raise ValueError(f"{b_name} must have rank 3 [N, k_blocks, blob_size], got {b.shape}")
    kb = -(-k // block_size)
    blob = block_size * bits // 8
    rows = b.shape[0] if n is None else n
    if b.shape != (rows, kb, blob):
        raise ValueError(
            f"{b_name} must have shape [N, k_blocks, blob_size] = {(rows, kb, blob)} "
            f"(K = {k}, bits = {bits}, block_size = {block_size}), got {b.shape}"
        )
    _check_same_dtype(s_name, scales, act, "a")
    if scales.shape != (rows, kb):
        raise ValueError(
            f"{s_name} must have shape [N, k_blocks] = {(rows, kb)}, got {scales.shape}"
        )
    return rows


def _check_geometry(bits: int, block_size: int) -> tuple[int, int]:
    if isinstance(bits, bool) or bits not in MATMUL_NBITS_BITS:
        raise ValueError(f"bits must be one of {MATMUL_NBITS_BITS}, got {bits!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(f"block_size must be an integer, got {block_size!r}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    return int(bits), int(block_size)


def matmul_nbits(
    a: npt.ArrayLike,
    b_packed: npt.ArrayLike,
    scales: npt.ArrayLike,
    bits: int = 4,
    block_size: int = 32,
) -> np.ndarray:
    """Compute ``com.microsoft.MatMulNBits`` without zero points, g_idx or bias.

    ``a [..., K]`` (float16/32/64), ``b_packed [N, ceil(K / block_size), block_size * bits / 8]``
    uint8, ``scales [N, k_blocks]`` of ``a``'s dtype. Returns ``[..., N]`` of ``a``'s dtype.
    """
    av = np.asarray(a)
    b = np.asarray(b_packed)
    s = np.asarray(scales)
    bits, block_size = _check_geometry(bits, block_size)
    _check_float("a", av)
    if av.ndim < 1 or av.shape[-1] == 0:
        raise ValueError(f"a must have rank >= 1 and K > 0, got shape {av.shape}")
    k = av.shape[-1]
    _check_nbits("b_packed", "scales", b, s, av, k, None, bits, block_size)
    w = dequantize_matmul_nbits(b, s, k, bits, block_size, dtype=np.float64)
    return (av.astype(np.float64) @ w.T).astype(av.dtype)


def matmul_nbits_qkv(
    a: npt.ArrayLike,
    skip: npt.ArrayLike | None,
    norm_scale: npt.ArrayLike,
    q_b: npt.ArrayLike,
    q_scales: npt.ArrayLike,
    k_b: npt.ArrayLike,
    k_scales: npt.ArrayLike,
    v_b: npt.ArrayLike,
    v_scales: npt.ArrayLike,
    *,
    K: int,  # the ONNX attribute names
    Nq: int,
    Nkv: int,
    block_size: int = 32,
    bits: int = 4,
    epsilon: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Compute ``com.microsoft.MatMulNBitsQkv`` (no biases, symmetric weights).

    Args:
        a: ``[T, K]`` or ``[B, S, K]`` float16/float32/float64 activations.
        skip: ``None`` or an array of ``a``'s shape and dtype, added before the norm.
        norm_scale: ``[K]`` RMSNorm scale, ``a``'s dtype.
        q_b: ``[Nq, k_blocks, blob]`` uint8 MatMulNBits weights for Q.
        q_scales: ``[Nq, k_blocks]`` of ``a``'s dtype.
        k_b: ``[Nkv, k_blocks, blob]`` uint8 weights for K.
        k_scales: ``[Nkv, k_blocks]``.
        v_b: ``[Nkv, k_blocks, blob]`` uint8 weights for V.
        v_scales: ``[Nkv, k_blocks]``.
        K: hidden size, must equal ``a.shape[-1]``.
        Nq: Q output width.
        Nkv: K and V output width.
        block_size: quantisation block along ``K`` (power of two >= 16; 32 in the kernels).
        bits: weight bits (4 in the kernels).
        epsilon: RMSNorm epsilon.

    Returns:
        ``(Q [..., Nq], K [..., Nkv], V [..., Nkv], residual)``, all of ``a``'s dtype;
        ``residual`` is ``a + skip`` when ``skip`` is given, else ``None``.
    """
    av = np.asarray(a)
    sc = np.asarray(norm_scale)
    sk = None if skip is None else np.asarray(skip)
    bits, block_size = _check_geometry(bits, block_size)
    _validate_norm(av, sc, epsilon, sk)
    if av.ndim not in (2, 3):
        raise ValueError(f"a must have rank 2 [T, K] or 3 [B, S, K], got shape {av.shape}")
    for name, v in (("K", K), ("Nq", Nq), ("Nkv", Nkv)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if av.shape[-1] != K:
        raise ValueError(f"a has last axis {av.shape[-1]}, but K = {K}")
    mats = []
    for name, b, s, n in (
        ("q", q_b, q_scales, Nq),
        ("k", k_b, k_scales, Nkv),
        ("v", v_b, v_scales, Nkv),
    ):
        bv, sv = np.asarray(b), np.asarray(s)
        _check_nbits(f"{name}_B", f"{name}_scales", bv, sv, av, K, n, bits, block_size)
        mats.append(dequantize_matmul_nbits(bv, sv, K, bits, block_size, dtype=np.float64))
    normed, residual = _rms_norm64(av, sc, epsilon, sk)
    q, k, v = (normed @ w.T for w in mats)
    return (
        q.astype(av.dtype),
        k.astype(av.dtype),
        v.astype(av.dtype),
        None if residual is None else residual.astype(av.dtype),
    )
