"""Reference path of the equivalence checker: ``onnx.reference`` plus the project's numpy oracles.

:func:`run_reference` evaluates a model with ``onnx.reference.ReferenceEvaluator`` and supplies
``OpRun`` classes for the ops the installed ``onnx`` cannot run:

* ``GroupedMatMul`` (default domain, opset 29) -> :func:`onnx_moe_fuse.verify.oracles.grouped_matmul.
  grouped_matmul`;
* ``com.microsoft.MoE`` -> :func:`onnx_moe_fuse.verify.oracles.moe.moe`;
* ``com.microsoft.QMoE`` -> :func:`onnx_moe_fuse.verify.oracles.moe.qmoe` (symmetric weights; zero-point
  inputs are accepted only when they hold the symmetric point, and FC3, ``router_weights``,
  sparse mixer and the FP4/FP8 extras are refused with ``NotImplementedError``);
* ``com.microsoft.MatMulNBits`` -> a numpy dequantisation (2/4/8 bits, packed or float zero points,
  ``g_idx``, bias; ``accuracy_level`` ignored: the reference is exact);
* ``SimplifiedLayerNormalization`` (default domain, where ONNX Runtime registers it) and
  ``com.microsoft.SkipSimplifiedLayerNormalization`` -> RMS norm in float64 (stash type float);
* ``com.microsoft.MatMulNBitsQkv`` -> :func:`onnx_moe_fuse.verify.oracles.matmul_nbits_qkv.
  matmul_nbits_qkv` (no biases: a bias input is refused with ``NotImplementedError``).

Opset 29 under onnx 1.23 (measured with onnx 1.23.2, whose newest opset is 28): the
ReferenceEvaluator does not refuse a model that declares ``"" : 29``. It never checks the declared
opset against its schemas; for each standard op it takes the newest implementation whose version
is at most the declared opset, and a ``new_ops`` class, keyed by (domain, op type), is used before
any built-in one. So an opset-29 model runs as it is, with ``GroupedMatMul`` from the OpRun below
(by the evaluator's code, the same class also takes precedence over onnx-weekly's own
implementation; that was read, not run). No copy with a lowered opset is needed. The caveat: an op that opset 29
changed would run with its opset-28 meaning under onnx 1.23 (every other op of the samples is at
its newest onnx 1.23 version: DequantizeLinear 28, TopK 24, Reshape/Squeeze/Unsqueeze 25, ...).
``onnx.checker``, by contrast, does refuse opset 29 under onnx 1.23 ("No Op registered for
GroupedMatMul with domain_version of 29").

:func:`random_feeds` makes fresh random inputs for every graph input, symbolic dims given small
values. It refuses, before allocating anything, inputs that would take more than
:data:`MAX_FEED_BYTES` in all (a model with a fixed 1e8-row input once asked for 48 GB):
:class:`FeedTooLargeError` names the input, its shape and its size.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from onnx_moe_fuse.errors import MoEFuseError
from onnx_moe_fuse.verify.oracles.grouped_matmul import grouped_matmul
from onnx_moe_fuse.verify.oracles.matmul_nbits_qkv import matmul_nbits_qkv
from onnx_moe_fuse.verify.oracles.moe import moe, qmoe
from onnx_moe_fuse.verify.oracles.quant import unpack_bits

__all__ = [
    "DEFAULT_DIM_VALUES",
    "MAX_FEED_BYTES",
    "FeedTooLargeError",
    "GroupedMatMul",
    "MatMulNBits",
    "MatMulNBitsQkv",
    "MoE",
    "QMoE",
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "feed_shapes",
    "reference_evaluator",
    "run_reference",
    "random_feeds",
]

#: Values for the symbolic dims the samples use; other names get ``default_dim``.
DEFAULT_DIM_VALUES: dict[str, int] = {"T": 5, "B": 2, "S": 3}

_MS = "com.microsoft"
_FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))


class GroupedMatMul(OpRun):
    """ONNX ``GroupedMatMul`` (opset 29): ``out[m, i] = input[m] @ weights[idx[m, i]] (+ bias)``."""

    op_domain = ""

    def _run(  # type: ignore[override]
        self,
        input: np.ndarray,  # noqa: A002 - named after the ONNX input
        weights: np.ndarray,
        group_indices: np.ndarray,
        bias: np.ndarray | None = None,
    ) -> tuple[np.ndarray]:
        return (grouped_matmul(input, weights, group_indices, bias),)


def _limit(value: float | None) -> float | None:
    """ORT's ``swiglu_limit``: absent or infinite means no clamp."""
    if value is None or math.isinf(value):
        return None
    return float(value)


def _refuse(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"com.microsoft.{op}: {what} is not supported by the reference path")


class MoE(OpRun):
    """ORT ``com.microsoft.MoE`` through the numpy oracle (inputs at ORT's positions)."""

    op_domain = _MS

    def _run(  # type: ignore[override]
        self,
        input: np.ndarray,  # noqa: A002 - named after the ONNX input
        router_probs: np.ndarray,
        fc1_experts_weights: np.ndarray,
        fc1_experts_bias: np.ndarray | None = None,
        fc2_experts_weights: np.ndarray | None = None,
        fc2_experts_bias: np.ndarray | None = None,
        fc3_experts_weights: np.ndarray | None = None,
        fc3_experts_bias: np.ndarray | None = None,
        *,
        k: int = 1,
        activation_type: str = "relu",
        swiglu_fusion: int = 0,
        normalize_routing_weights: int = 0,
        activation_alpha: float = 1.0,
        activation_beta: float = 0.0,
        swiglu_limit: float | None = None,
        swiglu_limit_after_activation: int = 0,
        use_sparse_mixer: int = 0,
    ) -> tuple[np.ndarray]:
        if fc2_experts_weights is None:
            raise ValueError("com.microsoft.MoE: fc2_experts_weights (input 4) is required")
        if use_sparse_mixer:
            raise _refuse("MoE", "use_sparse_mixer=1")
        if swiglu_limit_after_activation:
            raise _refuse("MoE", "swiglu_limit_after_activation=1")
        out = moe(
            input,
            router_probs,
            fc1_experts_weights,
            fc2_experts_weights,
            fc1_bias=fc1_experts_bias,
            fc2_bias=fc2_experts_bias,
            fc3=fc3_experts_weights,
            fc3_bias=fc3_experts_bias,
            k=int(k),
            activation_type=_text(activation_type),
            swiglu_fusion=int(swiglu_fusion),
            normalize_routing_weights=int(normalize_routing_weights),
            activation_alpha=float(activation_alpha),
            activation_beta=float(activation_beta),
            swiglu_limit=_limit(swiglu_limit),
        )
        return (out.astype(input.dtype, copy=False),)


def _text(value: str | bytes) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _check_symmetric_zero_points(zp: np.ndarray | None, bits: int, name: str) -> None:
    """Accept an explicit zero-point input only when it holds the symmetric point everywhere."""
    if zp is None:
        return
    symmetric = 0x88 if bits == 4 else 0x80  # 4-bit: two packed codes of 8 per byte
    arr = np.asarray(zp)
    if arr.dtype != np.uint8 or np.any(arr != symmetric):
        raise _refuse("QMoE", f"{name} that are not the symmetric point {1 << (bits - 1)}")


class QMoE(OpRun):
    """ORT ``com.microsoft.QMoE`` through the numpy oracle (inputs at ORT's positions)."""

    op_domain = _MS

    def _run(  # type: ignore[override]
        self,
        input: np.ndarray,  # noqa: A002 - named after the ONNX input
        router_probs: np.ndarray,
        fc1_experts_weights: np.ndarray,
        fc1_scales: np.ndarray | None = None,
        fc1_experts_bias: np.ndarray | None = None,
        fc2_experts_weights: np.ndarray | None = None,
        fc2_scales: np.ndarray | None = None,
        fc2_experts_bias: np.ndarray | None = None,
        fc3_experts_weights: np.ndarray | None = None,
        fc3_scales: np.ndarray | None = None,
        fc3_experts_bias: np.ndarray | None = None,
        fc1_zero_points: np.ndarray | None = None,
        fc2_zero_points: np.ndarray | None = None,
        fc3_zero_points: np.ndarray | None = None,
        router_weights: np.ndarray | None = None,
        *extras: np.ndarray | None,
        k: int = 1,
        activation_type: str = "relu",
        expert_weight_bits: int = 4,
        fc1_expert_weight_bits: int | None = None,
        fc2_expert_weight_bits: int | None = None,
        fc3_expert_weight_bits: int | None = None,
        block_size: int | None = None,
        swiglu_fusion: int = 0,
        normalize_routing_weights: int = 0,
        activation_alpha: float = 1.0,
        activation_beta: float = 0.0,
        swiglu_limit: float | None = None,
        swiglu_limit_after_activation: int = 0,
        use_sparse_mixer: int = 0,
        quant_type: str = "int",
        weights_prepacked: int = -1,
        accuracy_level: int = 0,  # ORT numerics only; the oracle is exact
    ) -> tuple[np.ndarray]:
        del accuracy_level
        if fc2_experts_weights is None or fc1_scales is None or fc2_scales is None:
            raise ValueError("com.microsoft.QMoE: fc1/fc2 weights and scales are required")
        if fc3_experts_weights is not None or fc3_scales is not None or fc3_zero_points is not None:
            raise _refuse("QMoE", "FC3")
        if fc3_experts_bias is not None:
            raise _refuse("QMoE", "fc3_experts_bias")
        if router_weights is not None:
            raise _refuse("QMoE", "router_weights (input 14)")
        if any(e is not None for e in extras):
            raise _refuse("QMoE", "FP4/FP8 inputs (15+)")
        if use_sparse_mixer:
            raise _refuse("QMoE", "use_sparse_mixer=1")
        if swiglu_limit_after_activation:
            raise _refuse("QMoE", "swiglu_limit_after_activation=1")
        if _text(quant_type) != "int":
            raise _refuse("QMoE", f"quant_type={_text(quant_type)!r}")
        if weights_prepacked == 1:
            raise _refuse("QMoE", "weights_prepacked=1")
        bits = int(expert_weight_bits)
        for name, b in (("fc1", fc1_expert_weight_bits), ("fc2", fc2_expert_weight_bits)):
            if b is not None and int(b) != bits:
                raise _refuse("QMoE", f"{name}_expert_weight_bits={b} != expert_weight_bits={bits}")
        del fc3_expert_weight_bits
        _check_symmetric_zero_points(fc1_zero_points, bits, "fc1_zero_points")
        _check_symmetric_zero_points(fc2_zero_points, bits, "fc2_zero_points")
        out = qmoe(
            input,
            router_probs,
            fc1_experts_weights,
            fc1_scales,
            fc2_experts_weights,
            fc2_scales,
            k=int(k),
            activation_type=_text(activation_type),
            expert_weight_bits=bits,
            block_size=int(block_size) if block_size else None,
            swiglu_fusion=int(swiglu_fusion),
            activation_alpha=float(activation_alpha),
            activation_beta=float(activation_beta),
            swiglu_limit=_limit(swiglu_limit),
            fc1_bias=fc1_experts_bias,
            fc2_bias=fc2_experts_bias,
            normalize_routing_weights=int(normalize_routing_weights),
        )
        return (out.astype(input.dtype, copy=False),)


# -- RMS norm and 4-bit projections (MatMulNBitsQkv and the composition it replaces) --------------


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
    if bits not in (2, 4, 8):
        raise _refuse("MatMulNBits", f"bits={bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(
            f"com.microsoft.MatMulNBits: block_size={block_size} is not a power of 2 >= 16"
        )
    kb = -(-k // block_size)
    blob = block_size * bits // 8
    b = np.asarray(b)
    if b.dtype != np.uint8 or b.size != n * kb * blob:
        raise ValueError(
            f"com.microsoft.MatMulNBits: B must be uint8 [N, k_blocks, blob] = {(n, kb, blob)}, "
            f"got {b.dtype} {b.shape}"
        )
    codes = unpack_bits(b.reshape(n, kb * blob), bits).reshape(n, kb * block_size)[:, :k]
    sc = np.asarray(scales, dtype=np.float64)
    if sc.size != n * kb:
        raise ValueError(
            f"com.microsoft.MatMulNBits: scales must hold N * k_blocks = {n * kb} values, got {sc.shape}"
        )
    sc = sc.reshape(n, kb)
    if zero_points is None:
        zp = np.full((n, kb), float(1 << (bits - 1)))
    else:
        z = np.asarray(zero_points)
        if z.dtype == np.uint8:
            per_row = -(-kb * bits // 8)
            if z.size != n * per_row:
                raise ValueError(
                    f"com.microsoft.MatMulNBits: packed zero_points must hold N * ceil(k_blocks * "
                    f"bits / 8) = {n * per_row} bytes, got {z.shape}"
                )
            zp = unpack_bits(z.reshape(n, per_row), bits)[:, :kb].astype(np.float64)
        else:
            if z.size != n * kb:
                raise ValueError(
                    f"com.microsoft.MatMulNBits: zero_points must hold {n * kb} values, got {z.shape}"
                )
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
            raise ValueError(f"com.microsoft.MatMulNBits: g_idx must be [K] block indices < {kb}")
    return (codes.astype(np.float64) - zp[:, block_of_k]) * sc[:, block_of_k]


class MatMulNBits(OpRun):
    """ORT ``com.microsoft.MatMulNBits``: ``Y = A @ dequant(B).T (+ bias)``, exact (float64)."""

    op_domain = _MS

    def _run(  # type: ignore[override]
        self,
        A: np.ndarray,  # noqa: N803 - named after the ONNX input
        B: np.ndarray,  # noqa: N803
        scales: np.ndarray,
        zero_points: np.ndarray | None = None,
        g_idx: np.ndarray | None = None,
        bias: np.ndarray | None = None,
        *,
        K: int,  # noqa: N803 - the ONNX attribute names
        N: int,  # noqa: N803
        bits: int = 4,
        block_size: int,
        accuracy_level: int = 0,  # lets ORT quantise A to int8; the reference is exact
        weight_prepacked: int = 0,
    ) -> tuple[np.ndarray]:
        del accuracy_level
        if weight_prepacked:
            raise _refuse("MatMulNBits", "weight_prepacked=1")
        if A.shape[-1] != K:
            raise ValueError(
                f"com.microsoft.MatMulNBits: A has last axis {A.shape[-1]}, but K = {K}"
            )
        w = _dequantize_nbits(
            B,
            scales,
            zero_points,
            g_idx,
            k=int(K),
            n=int(N),
            bits=int(bits),
            block_size=int(block_size),
        )
        y = A.astype(np.float64) @ w.T
        if bias is not None:
            y = y + bias.astype(np.float64)
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


def _refuse_default(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"{op}: {what} is not supported by the reference path")


class SimplifiedLayerNormalization(OpRun):
    """ORT's ``SimplifiedLayerNormalization`` (registered in the default ONNX domain): RMS norm.

    ``Y = X / sqrt(mean(X^2 over axes [axis, rank)) + epsilon) * scale`` (type of ``scale``);
    optional output ``inv_std_var`` (float32, reduced axes kept as 1).
    """

    op_domain = ""

    def _run(  # type: ignore[override]
        self,
        X: np.ndarray,  # noqa: N803 - named after the ONNX input
        scale: np.ndarray,
        *,
        axis: int = -1,
        epsilon: float = 1e-5,
        stash_type: int = 1,
    ) -> tuple[np.ndarray, np.ndarray]:
        if stash_type not in (1, 11):
            raise _refuse_default("SimplifiedLayerNormalization", f"stash_type={stash_type}")
        y, inv = _rms_norm(X, scale, epsilon, int(axis))
        stash = np.float64 if stash_type == 11 else np.float32
        return y.astype(scale.dtype), inv.astype(stash)


class SkipSimplifiedLayerNormalization(OpRun):
    """ORT ``com.microsoft.SkipSimplifiedLayerNormalization``: RMS norm of ``input + skip (+ bias)``.

    Outputs (as ONNX Runtime 1.32 CPU, measured): ``output``; ``mean`` (zeros, ``[..., 1]``);
    ``inv_std_var`` (``[..., 1]``, float32); ``input_skip_bias_sum`` (``input + skip (+ bias)``).
    ``skip`` may broadcast over ``input``'s leading axes.
    """

    op_domain = _MS

    def _run(  # type: ignore[override]
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

    Inputs: A, skip, norm_scale, q_B, q_scales, q_bias, k_B, k_scales, k_bias, v_B, v_scales,
    v_bias; outputs Q, K, V and (when ``skip`` is given) ``input_skip_bias_sum``.
    """

    op_domain = _MS

    def _run(  # type: ignore[override]
        self,
        A: np.ndarray,  # noqa: N803 - named after the ONNX input
        skip: np.ndarray | None,
        norm_scale: np.ndarray,
        q_B: np.ndarray,  # noqa: N803
        q_scales: np.ndarray,
        q_bias: np.ndarray | None = None,
        k_B: np.ndarray | None = None,  # noqa: N803
        k_scales: np.ndarray | None = None,
        k_bias: np.ndarray | None = None,
        v_B: np.ndarray | None = None,  # noqa: N803
        v_scales: np.ndarray | None = None,
        v_bias: np.ndarray | None = None,
        *,
        K: int,  # noqa: N803 - the ONNX attribute names
        Nq: int,  # noqa: N803
        Nkv: int,  # noqa: N803
        bits: int = 4,
        block_size: int,
        epsilon: float = 1e-6,
        accuracy_level: int = 0,  # lets ORT quantise A to int8; the reference is exact
    ) -> tuple[np.ndarray, ...]:
        del accuracy_level
        for name, bias in (("q_bias", q_bias), ("k_bias", k_bias), ("v_bias", v_bias)):
            if bias is not None:
                raise _refuse("MatMulNBitsQkv", name)
        if k_B is None or k_scales is None or v_B is None or v_scales is None:
            raise ValueError(
                "com.microsoft.MatMulNBitsQkv: k_B, k_scales, v_B, v_scales are required"
            )
        q, k, v, residual = matmul_nbits_qkv(
            A,
            skip,
            norm_scale,
            q_B,
            q_scales,
            k_B,
            k_scales,
            v_B,
            v_scales,
            K=int(K),
            Nq=int(Nq),
            Nkv=int(Nkv),
            block_size=int(block_size),
            bits=int(bits),
            epsilon=float(epsilon),
        )
        if residual is None:
            return q, k, v
        return q, k, v, residual


CUSTOM_OPS: tuple[type[OpRun], ...] = (
    GroupedMatMul,
    MoE,
    QMoE,
    MatMulNBits,
    SimplifiedLayerNormalization,
    SkipSimplifiedLayerNormalization,
    MatMulNBitsQkv,
)


def reference_evaluator(
    model: onnx.ModelProto | str | os.PathLike[str], *, check_shapes: bool = False
) -> ReferenceEvaluator:
    """Return a ReferenceEvaluator for ``model`` with the project's OpRun classes installed.

    ``check_shapes`` turns on the evaluator's check of every computed value against its declared
    type and shape (symbolic dims bound consistently).
    """
    if not isinstance(model, onnx.ModelProto):
        model = os.fspath(model)
    return ReferenceEvaluator(model, new_ops=list(CUSTOM_OPS), check_shape_annotations=check_shapes)


def run_reference(
    model: onnx.ModelProto | str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray],
    *,
    outputs: Sequence[str] | None = None,
    check_shapes: bool = False,
) -> dict[str, np.ndarray]:
    """Run ``model`` on ``feeds`` on the reference path; returns ``{output name: array}``.

    Standard ops run in ``onnx.reference``; ``GroupedMatMul``, ``com.microsoft.MoE``,
    ``com.microsoft.QMoE``, ``com.microsoft.MatMulNBits``, ``SimplifiedLayerNormalization``,
    ``com.microsoft.SkipSimplifiedLayerNormalization`` and ``com.microsoft.MatMulNBitsQkv`` run
    in the project's numpy code (see the module docstring). A model declaring opset 29 is run
    as it is (see the module docstring). ``outputs`` selects graph outputs (default: all).
    """
    ev = reference_evaluator(model, check_shapes=check_shapes)
    names = list(outputs) if outputs is not None else list(ev.output_names)
    results = ev.run(names, dict(feeds))
    return dict(zip(names, results, strict=True))


#: The most bytes :func:`random_feeds` makes for one model's inputs together (256 MiB): the
#: checker runs every path on them and keeps intermediates, so far more than this is used.
MAX_FEED_BYTES = 256 * 2**20


class FeedTooLargeError(MoEFuseError, ValueError):
    """The random inputs of a model would be too large to make; the message names the input.

    A bad input (the CLI's exit code 2), not a failed verification: ``input_name`` is the graph
    input that went over the limit, ``nbytes`` its size.
    """

    input_name: str
    nbytes: int

    def __init__(self, message: str, input_name: str, nbytes: int):
        """One line naming the input, its shape and size."""
        super().__init__(message, input_name=input_name, nbytes=nbytes)


def _size_text(nbytes: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _dim_value(dim: Any, dim_values: Mapping[str, int], default_dim: int) -> int:
    if dim.HasField("dim_value"):
        return int(dim.dim_value)
    if dim.HasField("dim_param") and dim.dim_param in dim_values:
        return int(dim_values[dim.dim_param])
    return default_dim


def feed_shapes(
    model: onnx.ModelProto,
    dim_values: Mapping[str, int] | None = None,
    *,
    default_dim: int = 3,
    max_bytes: int = MAX_FEED_BYTES,
) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """``{input: (dtype, shape)}`` of the inputs :func:`random_feeds` makes, checked for size.

    Raises :class:`FeedTooLargeError` when they would take more than ``max_bytes`` together,
    naming the input that goes over; ``TypeError`` / ``ValueError`` for an input it cannot make
    (not a tensor, no shape, a dtype it has no random values for).
    """
    dims = {**DEFAULT_DIM_VALUES, **(dim_values or {})}
    initialized = {init.name for init in model.graph.initializer}
    shapes: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    total = 0
    for value in model.graph.input:
        if value.name in initialized:
            continue
        if not value.type.HasField("tensor_type"):
            raise TypeError(f"input {value.name!r} is not a tensor; random_feeds makes tensors")
        tensor_type = value.type.tensor_type
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
        if not tensor_type.HasField("shape"):
            raise ValueError(f"input {value.name!r} has no shape; pass it yourself")
        shape = tuple(_dim_value(d, dims, default_dim) for d in tensor_type.shape.dim)
        if not (dtype in _FLOAT_DTYPES or dtype.kind in "iub"):
            raise TypeError(f"input {value.name!r} has dtype {dtype}; pass it yourself")
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
        total += nbytes
        if total > max_bytes:
            raise FeedTooLargeError(
                f"input {value.name!r} of shape {list(shape)} ({dtype}) would take "
                f"{_size_text(nbytes)} of random values; the checker makes at most "
                f"{_size_text(max_bytes)} of inputs per model: give its symbolic dims smaller "
                "values, or verify a smaller model",
                value.name,
                nbytes,
            )
        shapes[value.name] = (dtype, shape)
    return shapes


def random_feeds(
    model: onnx.ModelProto,
    seed: int,
    dim_values: Mapping[str, int] | None = None,
    *,
    default_dim: int = 3,
    scale: float = 1.0,
    max_bytes: int = MAX_FEED_BYTES,
) -> dict[str, np.ndarray]:
    """Fresh random values for every graph input that no initializer provides.

    Float inputs (float16/bfloat16/float32/float64) get ``scale * N(0, 1)`` values; integer inputs
    get integers in ``[0, 4)``; bool inputs random booleans. A symbolic dim takes its value from
    ``dim_values`` (over :data:`DEFAULT_DIM_VALUES`), an unnamed or unknown one ``default_dim``.
    The same ``seed`` gives the same feeds. Inputs over ``max_bytes`` in all raise
    :class:`FeedTooLargeError` before anything is allocated (:func:`feed_shapes`).
    """
    shapes = feed_shapes(model, dim_values, default_dim=default_dim, max_bytes=max_bytes)
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for name, (dtype, shape) in shapes.items():
        if dtype in _FLOAT_DTYPES:
            feeds[name] = (rng.standard_normal(shape) * scale).astype(dtype)
        elif dtype.kind in "iu":
            feeds[name] = rng.integers(0, 4, shape).astype(dtype)
        else:
            feeds[name] = rng.random(shape) < 0.5
    return feeds
