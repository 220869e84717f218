"""The Q/K/V projections' proofs: MatMulNBits or MatMul of a DequantizeLinear, 4-bit, block 32.

Each projection is read into a :class:`_Projection` (weights in MatMulNBits layout, scales,
width) or refused with a plain-words reason naming the node and the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.contract.ops import MATMUL_NBITS
from onnx_moe_fuse.contract.packing import pack_matmul_nbits, unpack_bits, zero_point
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.qkv.graph import (
    BITS,
    BLOCK,
    KERNEL_DTYPES,
    PRECISION,
    const,
    dtype_name,
    elem_type,
    int_attr,
    item_label,
    static_rank,
    static_shape,
)

# -- analysis ----------------------------------------------------------------------------------


@dataclass
class Projection:
    """One projection, read and validated."""

    node: ir.Node
    output: ir.Value
    n: int
    k: int
    dtype: ir.DataType
    b: ir.Value | np.ndarray  # a value to pass through, or a repacked array
    scales: ir.Value | np.ndarray
    names: list[str] = field(default_factory=list)  # for the role evidence


@dataclass
class Plan:
    """Everything the rewrite needs, proven by the analysis."""

    anchor: ir.Node
    normed: ir.Value
    a: ir.Value
    skip: ir.Value | None
    scale: ir.Value | np.ndarray
    epsilon: float
    dtype: ir.DataType
    k: int
    projections: list[Projection]  # in pattern slot order
    roles: dict[str, int]  # "q" / "k" / "v" -> index into projections
    residual: ir.Value | None  # the pattern's residual output (skip forms)
    emit_residual: bool  # the fused node's output 3 replaces the residual
    replaced: list[ir.Node]

    @property
    def nq(self) -> int:
        """Q width."""
        return self.projections[self.roles["q"]].n

    @property
    def nkv(self) -> int:
        """K and V width."""
        return self.projections[self.roles["k"]].n

    def attributes(self) -> dict[str, int | float]:
        """Every attribute of the fused node."""
        return {
            "K": self.k,
            "Nq": self.nq,
            "Nkv": self.nkv,
            "bits": BITS,
            "block_size": BLOCK,
            "epsilon": self.epsilon,
            "accuracy_level": 0,
        }


def _check_zero_points_nbits(proj: ir.Node, zp: ir.Value, n: int, kb: int) -> None:
    arr = const(zp)
    if arr is None:
        raise Refusal(
            f"{item_label(proj)}: its zero points {item_label(zp)} are not constant, so they cannot be "
            "proven symmetric (all 8)",
            proj,
            zp,
        )
    if arr.dtype == np.uint8:
        per_row = -(-kb * BITS // 8)
        if arr.size != n * per_row:
            raise Refusal(
                f"{item_label(proj)}: zero points of unexpected shape {arr.shape}", proj, zp
            )
        points = unpack_bits(arr.reshape(n, per_row), BITS)[:, :kb]
    else:
        points = arr.astype(np.float64).reshape(-1)
    if not np.all(points == zero_point(BITS)):
        raise Refusal(
            f"{item_label(proj)}: asymmetric zero points (not all 8); MatMulNBitsQkv has no "
            "zero-point inputs, its 4-bit weights are symmetric (zero point 8)",
            proj,
            zp,
        )


def _nbits_projection(node: ir.Node, output: ir.Value, bindings: dict[str, Any], s: int):
    b, scales = bindings[f"p{s}_B"], bindings[f"p{s}_scales"]
    zp, g_idx, bias = (bindings.get(f"p{s}_{n}") for n in ("zero_points", "g_idx", "bias"))
    label = item_label(node)
    k, n = int_attr(node, "K", None), int_attr(node, "N", None)
    bits, bs = (
        int_attr(node, "bits", MATMUL_NBITS.default("bits")),
        int_attr(node, "block_size", None),
    )
    if k is None or n is None or bs is None:
        raise Refusal(f"{label}: MatMulNBits without its K, N or block_size attribute", node)
    if int_attr(node, "weight_prepacked", MATMUL_NBITS.default("weight_prepacked")):
        raise Refusal(f"{label}: weight_prepacked=1 (an execution-provider layout)", node)
    if bits != BITS:
        raise Refusal(
            f"{label}: {bits}-bit weights (bits={bits}); MatMulNBitsQkv's kernels take 4-bit "
            "weights only",
            node,
        )
    if bs != BLOCK:
        raise Refusal(
            f"{label}: quantised with block_size {bs} along K; MatMulNBitsQkv's kernels take "
            f"block_size {BLOCK} only",
            node,
        )
    if bias is not None:
        raise Refusal(f"{label}: has a bias input; MatMulNBitsQkv's kernels add none", node, bias)
    kb = -(-k // bs)
    if g_idx is not None:
        arr = const(g_idx)
        if arr is None or not np.array_equal(arr.reshape(-1), np.arange(k) // bs):
            raise Refusal(
                f"{label}: an act-order g_idx ({item_label(g_idx)}) that is not the plain k // "
                f"{bs} block order",
                node,
                g_idx,
            )
    if zp is not None:
        _check_zero_points_nbits(node, zp, n, kb)
    b_type = elem_type(b)
    if b_type is not None and b_type != ir.DataType.UINT8:
        raise Refusal(f"{label}: B is {dtype_name(b_type)}, not uint8", node, b)
    b_shape = static_shape(b)
    if b_shape is not None and b_shape != (n, kb, bs * bits // 8):
        raise Refusal(
            f"{label}: B has shape {list(b_shape)}, not [N, k_blocks, blob] = "
            f"{[n, kb, bs * bits // 8]}",
            node,
            b,
        )
    dtype = elem_type(scales)
    if dtype is None:
        raise Refusal(f"{label}: cannot tell the element type of its scales", node, scales)
    s_shape = static_shape(scales)
    scales_out: ir.Value | np.ndarray = scales
    if s_shape != (n, kb):
        arr = const(scales)
        if arr is None or arr.size != n * kb:
            raise Refusal(
                f"{label}: scales of shape {s_shape if s_shape is None else list(s_shape)} "
                f"that cannot be proven to be [N, k_blocks] = {[n, kb]}",
                node,
                scales,
            )
        scales_out = np.ascontiguousarray(arr.reshape(n, kb))
    names = [node.name, output.name, b.name, scales.name]
    return Projection(node, output, n, k, dtype, b, scales_out, [x for x in names if x])


def _dq_projection(node: ir.Node, output: ir.Value, bindings: dict[str, Any], s: int):
    label = item_label(node)
    weight = bindings[f"p{s}_weight"]
    dq = weight.producer()
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain != "":
        raise Refusal(
            f"{label}: its weights {item_label(weight)} are not a DequantizeLinear output (float or "
            "otherwise quantised weights); MatMulNBitsQkv takes 4-bit blocked weights",
            node,
            weight,
        )
    codes_v = dq.inputs[0]
    scale_v = dq.inputs[1] if len(dq.inputs) > 1 else None
    zp_v = dq.inputs[2] if len(dq.inputs) > 2 else None
    codes, scale = const(codes_v), const(scale_v)
    if codes is None or scale is None:
        raise Refusal(
            f"{label}: the DequantizeLinear weights or scales are not constant, so they cannot "
            "be repacked at fusion time (weights not constant)",
            node,
            dq,
        )
    ctype = elem_type(codes_v)
    if ctype in (ir.DataType.INT8, ir.DataType.UINT8):
        raise Refusal(
            f"{label}: 8-bit weights ({dtype_name(ctype)} behind DequantizeLinear); "
            "MatMulNBitsQkv's kernels take 4-bit weights only",
            node,
            dq,
        )
    if ctype not in (ir.DataType.INT4, ir.DataType.UINT4):
        raise Refusal(
            f"{label}: weights of type {dtype_name(ctype)} behind DequantizeLinear; "
            "MatMulNBitsQkv takes int4 / uint4 weights only",
            node,
            dq,
        )
    if codes.ndim != 2:
        raise Refusal(f"{label}: DequantizeLinear weights of rank {codes.ndim}, not [K, N]", dq)
    k, n = codes.shape
    axis = int_attr(dq, "axis", 1)
    bs = int_attr(dq, "block_size", 0)
    if not bs:
        raise Refusal(
            f"{label}: the weights are quantised per tensor or per channel, not in blocks of "
            f"{BLOCK} along K",
            node,
            dq,
        )
    if axis not in (0, -2):
        raise Refusal(
            f"{label}: the weights are blocked along axis {axis} (N), not along K", node, dq
        )
    if bs != BLOCK:
        raise Refusal(
            f"{label}: quantised with block_size {bs} along K; MatMulNBitsQkv's kernels take "
            f"block_size {BLOCK} only",
            node,
            dq,
        )
    kb = -(-k // bs)
    if scale.shape != (kb, n):
        raise Refusal(
            f"{label}: DequantizeLinear scale of shape {list(scale.shape)}, not [k_blocks, N] = "
            f"{[kb, n]}",
            node,
            dq,
        )
    out_dtype = int_attr(dq, "output_dtype", 0)
    dtype = ir.DataType(out_dtype) if out_dtype else ir.DataType.from_numpy(scale.dtype)
    if out_dtype and ir.DataType.from_numpy(scale.dtype) != dtype:
        raise Refusal(f"{label}: DequantizeLinear output_dtype differs from its scale's", dq)
    signed = ctype == ir.DataType.INT4
    if zp_v is None:
        if not signed:
            raise Refusal(
                f"{label}: asymmetric zero point: a uint4 DequantizeLinear without zero point has "
                "zero point 0, not MatMulNBits' 8",
                node,
                dq,
            )
    else:
        zp = const(zp_v)
        if zp is None:
            raise Refusal(
                f"{label}: the zero points are not constant, so they cannot be proven symmetric",
                node,
                zp_v,
            )
        want = 0 if signed else zero_point(BITS)
        if zp.size not in (1, kb * n) or not np.all(zp.astype(np.int64) == want):
            raise Refusal(
                f"{label}: asymmetric zero points (not all {want} for "
                f"{dtype_name(ctype)}); MatMulNBitsQkv's 4-bit weights are symmetric",
                node,
                zp_v,
            )
    # unsigned codes around MatMulNBits' zero point 8 (int4 shifted by it), values 0..15
    unsigned = codes.astype(np.int64) + (zero_point(BITS) if signed else 0)
    b = pack_matmul_nbits(unsigned.T, BITS, bs)
    scales = np.ascontiguousarray(scale.T.astype(scale.dtype))
    names = [node.name, output.name, weight.name, codes_v.name, dq.name]
    return Projection(node, output, n, k, dtype, b, scales, [x for x in names if x])


def read_projections(bindings: dict[str, Any]) -> list[Projection]:
    projections = []
    for s in (1, 2, 3):
        output = bindings[f"p{s}"]
        node = output.producer()
        if node.op_type == "MatMulNBits":
            projections.append(_nbits_projection(node, output, bindings, s))
        else:
            projections.append(_dq_projection(node, output, bindings, s))
    ks = {p.k for p in projections}
    if len(ks) != 1:
        raise Refusal(
            "the projections disagree on K: "
            + ", ".join(f"{item_label(p.node)} K={p.k}" for p in projections),
            *[p.node for p in projections],
        )
    dtypes = {p.dtype for p in projections}
    if len(dtypes) != 1:
        raise Refusal(
            "the projections compute in different types: "
            + ", ".join(f"{item_label(p.node)} {dtype_name(p.dtype)}" for p in projections),
            *[p.node for p in projections],
        )
    dtype = projections[0].dtype
    if dtype not in KERNEL_DTYPES:
        raise Refusal(
            f"the projections compute in {dtype_name(dtype)}; MatMulNBitsQkv's kernels take "
            "float32 and float16",
            projections[0].node,
        )
    return projections


def first_rank(*values: ir.Value | None) -> int | None:
    for v in values:
        r = static_rank(v)
        if r is not None:
            return r
    return None


def check_last_axis(node: ir.Node, axis: int, rank: int | None, what: str) -> None:
    if axis == -1 or (rank is not None and axis == rank - 1):
        return
    if rank is None and axis >= 0:
        raise Refusal(
            f"{item_label(node)}: {what} axis {axis}, and the input's rank is unknown, so it cannot "
            "be proven to be the last axis",
            node,
        )
    raise Refusal(f"{item_label(node)}: {what} axis {axis}, not the last axis", node)


def precise_enough(node: ir.Node, compute: ir.DataType | None, dtype: ir.DataType, what: str):
    if compute is None:
        raise Refusal(f"{item_label(node)}: cannot tell the type {what} is computed in", node)
    if PRECISION.get(compute, 0) < PRECISION[dtype]:
        raise Refusal(
            f"{item_label(node)}: {what} is computed in {dtype_name(compute)}, less precise than "
            f"the model's {dtype_name(dtype)} (the fused node computes in float32)",
            node,
        )
