"""The reference path's RMS norms and 4-bit projections: MatMulNBits, MatMulNBitsQkv and the norms.

* ``com.microsoft.MatMulNBits`` -> a numpy dequantisation (2/4/8 bits, packed or float zero points,
  ``g_idx``, bias; ``accuracy_level`` ignored: the reference is exact);
* ``SimplifiedLayerNormalization`` (default domain, where ONNX Runtime registers it) and
  ``com.microsoft.SkipSimplifiedLayerNormalization`` -> RMS norm in float64 (stash type float);
* ``com.microsoft.MatMulNBitsQkv`` -> :func:`onnx_moe_fuse.verify.oracles.matmul_nbits_qkv.
  matmul_nbits_qkv` (no biases: a bias input is refused with ``NotImplementedError``).

MatMulNBits and MatMulNBitsQkv read their inputs by name at the positions of
:mod:`onnx_moe_fuse.contract.ops`, their attributes over ORT's defaults from there, and the
weight layout from :mod:`onnx_moe_fuse.contract.packing`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx.reference.op_run import OpRun

from onnx_moe_fuse.contract.ops import MATMUL_NBITS, MATMUL_NBITS_QKV, MS_DOMAIN, ContribOp
from onnx_moe_fuse.contract.packing import MATMUL_NBITS_BITS, unpack_bits, zero_point
from onnx_moe_fuse.verify.nodes import not_supported
from onnx_moe_fuse.verify.oracles.matmul_nbits_qkv import matmul_nbits_qkv

__all__ = [
    "MatMulNBits",
    "MatMulNBitsQkv",
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
]


def _refuse(op: ContribOp, what: str) -> NotImplementedError:
    return not_supported(op.qualified_name, what)


def _dequantize_nbits(
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    g_idx: np.ndarray | None,
    *,
    k: int,
    n: int,
    bits: int,
    block_size: int,
) -> np.ndarray:
    """MatMulNBits weights ``[N, K]`` in float64: ``(code - zero_point) * scale`` per block.

    ``B [N, k_blocks, blob]`` uint8 (low bits first); ``scales [N, k_blocks]`` or flat;
    ``zero_points``: None (the midpoint ``2 ** (bits - 1)``), uint8 packed ``[N, ceil(k_blocks *
    bits / 8)]`` (or flat), or of the scales' float type ``[N, k_blocks]``; ``g_idx [K]``: the
    block of each k (act order), else ``k // block_size``.
    """
    where = MATMUL_NBITS.qualified_name
    if bits not in MATMUL_NBITS_BITS:
        raise _refuse(MATMUL_NBITS, f"bits={bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"{where}: block_size={block_size} is not a power of 2 >= 16")
    kb = -(-k // block_size)
    blob = block_size * bits // 8
    b = np.asarray(b)
    if b.dtype != np.uint8 or b.size != n * kb * blob:
        raise ValueError(
            f"{where}: B must be uint8 [N, k_blocks, blob] = {(n, kb, blob)}, "
            f"got {b.dtype} {b.shape}"
        )
    codes = unpack_bits(b.reshape(n, kb * blob), bits).reshape(n, kb * block_size)[:, :k]
    sc = np.asarray(scales, dtype=np.float64)
    if sc.size != n * kb:
        raise ValueError(
            f"{where}: scales must hold N * k_blocks = {n * kb} values, got {sc.shape}"
        )
    sc = sc.reshape(n, kb)
    if zero_points is None:
        zp = np.full((n, kb), float(zero_point(bits)))
    else:
        z = np.asarray(zero_points)
        if z.dtype == np.uint8:
            per_row = -(-kb * bits // 8)
            if z.size != n * per_row:
                raise ValueError(
                    f"{where}: packed zero_points must hold N * ceil(k_blocks * "
                    f"bits / 8) = {n * per_row} bytes, got {z.shape}"
                )
            zp = unpack_bits(z.reshape(n, per_row), bits)[:, :kb].astype(np.float64)
        else:
            if z.size != n * kb:
                raise ValueError(f"{where}: zero_points must hold {n * kb} values, got {z.shape}")
            zp = z.astype(np.float64).reshape(n, kb)
    if g_idx is None:
        block_of_k = np.arange(k) // block_size
    else:
        block_of_k = np.asarray(g_idx).reshape(-1).astype(np.int64)
        if (
            block_of_k.shape != (k,)
            or block_of_k.min(initial=0) < 0
            or block_of_k.max(initial=0) >= kb
        ):
            raise ValueError(f"{where}: g_idx must be [K] block indices < {kb}")
    return (codes.astype(np.float64) - zp[:, block_of_k]) * sc[:, block_of_k]


class MatMulNBits(OpRun):
    """ORT ``com.microsoft.MatMulNBits``: ``Y = A @ dequant(B).T (+ bias)``, exact (float64)."""

    op_domain = MS_DOMAIN

    def _run(self, *inputs: np.ndarray | None, **attrs: Any) -> tuple[np.ndarray]:
        x = MATMUL_NBITS.named_inputs(inputs)
        # accuracy_level lets ORT quantise A to int8; the reference is exact
        a = MATMUL_NBITS.checked_attributes(attrs)
        if a["weight_prepacked"]:
            raise _refuse(MATMUL_NBITS, "weight_prepacked=1")
        A, K = x["A"], int(a["K"])  # noqa: N806 - the ONNX names
        if A.shape[-1] != K:
            raise ValueError(
                f"{MATMUL_NBITS.qualified_name}: A has last axis {A.shape[-1]}, but K = {K}"
            )
        w = _dequantize_nbits(
            x["B"],
            x["scales"],
            x["zero_points"],
            x["g_idx"],
            k=K,
            n=int(a["N"]),
            bits=int(a["bits"]),
            block_size=int(a["block_size"]),
        )
        y = A.astype(np.float64) @ w.T
        if x["bias"] is not None:
            y = y + x["bias"].astype(np.float64)
        return (y.astype(A.dtype),)


def _rms_norm(
    x: np.ndarray, scale: np.ndarray, epsilon: float, axis: int
) -> tuple[np.ndarray, np.ndarray]:
    """``x / sqrt(mean(x * x over axes [axis, rank)) + epsilon) * scale`` in float64.

    Returns the normalised-and-scaled value (float64) and ``1 / rms`` (float64, reduced axes kept).
    """
    axis = axis + x.ndim if axis < 0 else axis
    if not 0 <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for rank {x.ndim}")
    xf = x.astype(np.float64)
    axes = tuple(range(axis, x.ndim))
    inv = 1.0 / np.sqrt(np.mean(xf * xf, axis=axes, keepdims=True) + float(epsilon))
    return xf * inv * scale.astype(np.float64), inv


class SimplifiedLayerNormalization(OpRun):
    """ORT's ``SimplifiedLayerNormalization`` (registered in the default ONNX domain): RMS norm.

    ``Y = X / sqrt(mean(X^2 over axes [axis, rank)) + epsilon) * scale`` (type of ``scale``);
    optional output ``inv_std_var`` (float32, reduced axes kept as 1).
    """

    op_domain = ""

    def _run(
        self,
        X: np.ndarray,  # noqa: N803 - named after the ONNX input
        scale: np.ndarray,
        *,
        axis: int = -1,
        epsilon: float = 1e-5,
        stash_type: int = 1,
    ) -> tuple[np.ndarray, np.ndarray]:
        if stash_type not in (1, 11):
            raise not_supported("SimplifiedLayerNormalization", f"stash_type={stash_type}")
        y, inv = _rms_norm(X, scale, epsilon, int(axis))
        stash = np.float64 if stash_type == 11 else np.float32
        return y.astype(scale.dtype), inv.astype(stash)


class SkipSimplifiedLayerNormalization(OpRun):
    """ORT ``com.microsoft.SkipSimplifiedLayerNormalization``: RMS norm of ``input + skip (+bias)``.

    Outputs (as ONNX Runtime 1.32 CPU, measured): ``output``; ``mean`` (zeros, ``[..., 1]``);
    ``inv_std_var`` (``[..., 1]``, float32); ``input_skip_bias_sum`` (``input + skip (+ bias)``).
    ``skip`` may broadcast over ``input``'s leading axes.
    """

    op_domain = MS_DOMAIN

    def _run(
        self,
        input: np.ndarray,  # noqa: A002 - named after the ONNX input
        skip: np.ndarray,
        gamma: np.ndarray,
        bias: np.ndarray | None = None,
        *,
        epsilon: float = 1e-12,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        s = input.astype(np.float64) + skip.astype(np.float64)
        if bias is not None:
            s = s + bias.astype(np.float64)
        summed = s.astype(input.dtype)
        y, inv = _rms_norm(s, gamma, epsilon, -1)
        mean = np.zeros(inv.shape, dtype=np.float32)
        return y.astype(input.dtype), mean, inv.astype(np.float32), summed


class MatMulNBitsQkv(OpRun):
    """ORT ``com.microsoft.MatMulNBitsQkv`` through the numpy oracle (inputs at ORT's positions).

    Inputs and outputs as :data:`onnx_moe_fuse.contract.ops.MATMUL_NBITS_QKV` lists them; the
    fourth output (``input_skip_bias_sum``) only when ``skip`` is given.
    """

    op_domain = MS_DOMAIN

    def _run(self, *inputs: np.ndarray | None, **attrs: Any) -> tuple[np.ndarray, ...]:
        x = MATMUL_NBITS_QKV.named_inputs(inputs)
        # accuracy_level lets ORT quantise A to int8; the reference is exact
        a = MATMUL_NBITS_QKV.checked_attributes(attrs)
        for name in ("q_bias", "k_bias", "v_bias"):
            if x[name] is not None:
                raise _refuse(MATMUL_NBITS_QKV, name)
        if any(x[n] is None for n in ("k_B", "k_scales", "v_B", "v_scales")):
            raise ValueError(
                f"{MATMUL_NBITS_QKV.qualified_name}: k_B, k_scales, v_B, v_scales are required"
            )
        q, k, v, residual = matmul_nbits_qkv(
            x["A"],
            x["skip"],
            x["norm_scale"],
            x["q_B"],
            x["q_scales"],
            x["k_B"],
            x["k_scales"],
            x["v_B"],
            x["v_scales"],
            K=int(a["K"]),
            Nq=int(a["Nq"]),
            Nkv=int(a["Nkv"]),
            block_size=int(a["block_size"]),
            bits=int(a["bits"]),
            epsilon=float(a["epsilon"]),
        )
        if residual is None:
            return q, k, v
        return q, k, v, residual
