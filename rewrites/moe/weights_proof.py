"""Proof step 4: the expert weights and biases, float or behind DequantizeLinear, as K-major facts.

:func:`expert_weights` reads a projection's constant weights (through layout ops and
DequantizeLinear: int4/uint4/int8/uint8, any zero points, per channel or blocked) into an
:class:`~.plan.ExpertWeights` in GroupedMatMul's ``[E, K, N]`` layout; :func:`expert_bias`
reads its bias. Codes are decoded only when the rewrite needs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.dims import Dim, product, reshape_dims
from onnx_moe_fuse.rewrites.graph.facts import (
    attr_int,
    const_array,
    const_ints,
    const_tensor,
    label,
    node_axes,
    normalize_axes,
    value_label,
)
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.graph.symbolic_dims import lead_dims
from onnx_moe_fuse.rewrites.moe.plan import (
    FLOAT_TYPES,
    QUANT_TYPES,
    ExpertWeights,
    bound_node,
)
from onnx_moe_fuse.rewrites.moe.routing_proof import (
    dims_text,
)
from onnx_moe_fuse.rewrites.moe.selected_weights import same_indices

# -- 4. experts --------------------------------------------------------------------------------


#: Stacked expert weight layouts: ``"kn"`` is ``[E, K, N]`` (GroupedMatMul, Gather + MatMul with
#: the rows on the left), ``"nk"`` is ``[E, N, K]`` (output-major, as MoE/QMoE store them and as
#: torch's ``bmm(W[ids], x[..., None])`` reads them).
WEIGHT_LAYOUTS = ("kn", "nk")


def expert_weights(role: str, w: ir.Value | None, layout: str = "kn") -> ExpertWeights:
    """Prove ``w`` constant stacked expert weights in ``layout``; return them K-major.

    Float weights must be an initializer or a Constant; quantized ones a standard
    ``DequantizeLinear`` of constants (see :func:`_dequantized`). Whatever ``layout`` the source
    uses, the result is in GroupedMatMul's ``[E, K, N]`` (an ``"nk"`` source is transposed).
    """
    assert layout in WEIGHT_LAYOUTS
    if w is None:
        raise Refusal(f"{role} expert weights are missing")
    if w.is_graph_input():
        raise Refusal(
            f"{role} expert weights not constant: '{value_label(w)}' is a graph input, so they "
            "cannot be repacked into the fused layout at fusion time",
            w,
        )
    external = const_tensor(w)
    if isinstance(external, ir.ExternalTensor) and external.raw is None:
        return _external_floats(role, w, external, layout)
    arr = const_array(w)
    if arr is not None:
        if arr.ndim != 3:
            raise Refusal(
                f"{role} expert weights '{value_label(w)}' are not [E, {', '.join(layout.upper())}]",
                w,
            )
        dtype = ir.DataType.from_numpy(arr.dtype)
        if dtype not in FLOAT_TYPES:
            raise Refusal(
                f"{role} expert weights '{value_label(w)}' have type {dtype.name}; MoE takes "
                "float32/float16/bfloat16",
                w,
            )
        if layout == "nk":
            arr = arr.transpose(0, 2, 1)
        return ExpertWeights(
            role,
            w,
            tuple(arr.shape),  # type: ignore[arg-type]
            dtype,
            array=arr,
            layout=layout,
            float_source=const_tensor(w),
        )
    node = w.producer()
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        source, chain = _layout_source(w)
        if chain and source.is_graph_input():
            raise Refusal(
                f"{role} expert weights not constant: they reach the projection through "
                + " of ".join(f"a {n.op_type} '{label(n)}'" for n in chain)
                + f" of graph input '{value_label(source)}', so they cannot be repacked into "
                "the fused layout at fusion time",
                chain[0],
            )
        what = "a graph input" if node is None else f"computed by {node.op_type} '{label(node)}'"
        raise Refusal(
            f"{role} expert weights not constant: '{value_label(w)}' is {what}, so they cannot "
            "be repacked into the fused layout at fusion time",
            w,
        )
    return _dequantized(role, w, node, layout)


def _external_floats(
    role: str, w: ir.Value, tensor: ir.ExternalTensor, layout: str
) -> ExpertWeights:
    """Stacked expert weights held as external data: proved from the tensor's type and shape.

    Their bytes are not read here (a layer's float weights can be gigabytes): the emission
    moves them expert by expert (:mod:`.repack`). Integer external weights (codes without a
    DequantizeLinear) are refused as the in-memory ones are.
    """
    shape = tuple(int(d) for d in tensor.shape)
    if len(shape) != 3:
        raise Refusal(
            f"{role} expert weights '{value_label(w)}' are not [E, {', '.join(layout.upper())}]",
            w,
        )
    dtype = tensor.dtype
    if dtype not in FLOAT_TYPES:
        raise Refusal(
            f"{role} expert weights '{value_label(w)}' have type {dtype.name}; MoE takes "
            "float32/float16/bfloat16",
            w,
        )
    e, a, b = shape
    k_major = (e, a, b) if layout == "kn" else (e, b, a)
    return ExpertWeights(role, w, k_major, dtype, layout=layout, float_source=tensor)


#: Ops that only move or relabel the elements of a weight tensor.
_LAYOUT_OPS = frozenset({"Transpose", "Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze"})


def _layout_source(w: ir.Value) -> tuple[ir.Value, list[ir.Node]]:
    """What ``w`` is a layout op chain of (for the reason): (the source value, the chain)."""
    chain: list[ir.Node] = []
    value = w
    while len(chain) < 8:
        node = value.producer()
        if node is None or node.op_type not in _LAYOUT_OPS or node.inputs[0] is None:
            break
        chain.append(node)
        value = node.inputs[0]
    return value, chain


def _dequantized(role: str, w: ir.Value, dq: ir.Node, layout: str) -> ExpertWeights:
    """Quantized weights ``DequantizeLinear(q, scale, zero_point?)``, K-major facts.

    An ``"nk"`` source (``q`` ``[E, N, K]``) is read as its K-major transpose: ``q`` and 3-D
    scales swap their last two axes and the DequantizeLinear axis 1 / 2 is read as 2 / 1. The
    codes and 3-D scales are proved from their types and shapes only (their bytes are read at
    emission, one expert at a time); smaller scales and the zero points are read.
    """
    x_v = dq.inputs[0]
    s_v = dq.inputs[1] if len(dq.inputs) > 1 else None
    z_v = dq.inputs[2] if len(dq.inputs) > 2 else None
    q_t, s_t = const_tensor(x_v), const_tensor(s_v)
    z = const_array(z_v) if z_v is not None else None
    if q_t is None or s_t is None or (z_v is not None and z is None):
        raise Refusal(
            f"{role} quantized weights not constant: an input of DequantizeLinear '{label(dq)}' "
            "is not an initializer",
            dq,
        )
    qtype = q_t.dtype
    if qtype not in QUANT_TYPES:
        raise Refusal(
            f"{role} weights are {qtype.name} behind DequantizeLinear '{label(dq)}'; QMoE takes "
            "int4/uint4/int8/uint8",
            dq,
        )
    bits, signed = QUANT_TYPES[qtype]
    dims = ", ".join(layout.upper())
    q_shape = tuple(int(d) for d in q_t.shape)
    if len(q_shape) != 3:
        raise Refusal(f"{role} quantized weights of '{label(dq)}' are not [E, {dims}]", dq)
    axis = attr_int(dq, "axis", 1)
    assert axis is not None
    if not -3 <= axis < 3:
        raise Refusal(f"DequantizeLinear '{label(dq)}' has axis {axis} on rank-3 weights", dq)
    ax = axis % 3  # from here on, in K-major terms: 0 experts, 1 K, 2 N
    s_shape = tuple(int(d) for d in s_t.shape)
    if layout == "nk":
        q_shape = (q_shape[0], q_shape[2], q_shape[1])
        s_shape = (s_shape[0], s_shape[2], s_shape[1]) if len(s_shape) == 3 else s_shape
        ax = (0, 2, 1)[ax]
    e, kk, n = q_shape
    s_dtype = s_t.dtype
    out_dtype = attr_int(dq, "output_dtype", 0) or 0
    dtype = ir.DataType(out_dtype) if out_dtype else s_dtype
    if dtype not in FLOAT_TYPES or s_dtype != dtype:
        raise Refusal(
            f"{role} scales of '{label(dq)}' are {s_dtype.name.lower()}; QMoE takes float scales",
            dq,
        )
    block = attr_int(dq, "block_size", 0) or 0
    small = None  # scales read now (they are small), broadcast to [E, 1, N]
    blocks = 1
    s = None if len(s_shape) == 3 else const_array(s_v)
    if len(s_shape) != 3 and s is None:
        raise Refusal(f"{role} scales of '{label(dq)}' cannot be read", dq)
    if block:
        if ax != 1:
            raise Refusal(
                f"{role} weights are blocked along axis {axis} by '{label(dq)}'; QMoE blocks "
                f"along the reduction axis K (axis {1 if layout == 'kn' else 2} of [E, {dims}])",
                dq,
            )
        if s_shape != (e, -(-kk // block), n):
            raise Refusal(f"{role} scales of '{label(dq)}' have shape {s_shape}", dq)
        blocks = s_shape[1]
        if kk % block:
            if block < kk:
                raise Refusal(
                    f"{role} block size {block} does not divide K = {kk} ('{label(dq)}')", dq
                )
            block = 0  # one partial block over K: one scale per expert and output channel
    elif s is not None and (s.ndim == 0 or s.size == 1):
        small = np.broadcast_to(s.reshape(1, 1, 1), (e, 1, n))
    elif s is not None and s.ndim == 1:
        if ax == 2 and s.shape == (n,):
            small = np.broadcast_to(s.reshape(1, 1, n), (e, 1, n))
        elif ax == 0 and s.shape == (e,):
            small = np.broadcast_to(s.reshape(e, 1, 1), (e, 1, n))
        else:
            raise Refusal(
                f"{role} weights have one scale per input channel (axis {axis}) in "
                f"'{label(dq)}'; QMoE scales are per output channel or blocked along K",
                dq,
            )
    else:
        raise Refusal(f"{role} scales of '{label(dq)}' have shape {s_shape}", dq)
    sym = 0 if signed else 1 << (bits - 1)
    # no zero point means 0: symmetric for signed codes, the lowest code for unsigned ones
    stored = tuple(int(d) for d in s_t.shape)  # zero points have the scales' stored shape
    if z is None and signed:
        zero_points = None  # no zero point is 0, the symmetric point of signed codes
    else:
        # no zero point means 0: the lowest code for unsigned ones
        zp = np.zeros((), np.int64) if z is None else np.asarray(z)
        if z is None:
            zp = np.broadcast_to(zp, stored)
        zero_points = _zero_points(role, dq, zp, stored, layout, ax, (e, blocks, n))
        # into the unsigned code space of ExpertWeights.codes (a signed zp z becomes z + 2**(b-1))
        zero_points = zero_points - sym + (1 << (bits - 1))
        if np.all(zero_points == 1 << (bits - 1)):
            zero_points = None  # symmetric: the node needs no zero-point input
        else:
            zero_points = np.ascontiguousarray(zero_points.astype(np.uint8))
    return ExpertWeights(
        role,
        w,
        (e, kk, n),
        dtype,
        codes_source=q_t,
        layout=layout,
        offset=sym,
        small_scales=None if small is None else np.ascontiguousarray(small),
        scales_source=s_t if small is None else None,
        scale_blocks=blocks,
        bits=bits,
        block=block,
        source_nodes=(dq,),
        zero_points=zero_points,
    )


def _zero_points(
    role: str,
    dq: ir.Node,
    z: np.ndarray,
    s_shape: tuple[int, ...],
    layout: str,
    ax: int,
    shape: tuple[int, int, int],
) -> np.ndarray:
    """DequantizeLinear's zero points (the shape of its scales ``s``) as ``[E, blocks, N]``.

    ONNX gives ``y_zero_point`` the shape of ``y_scale``: a blocked 3-D one is read like the
    scales (transposed for an ``"nk"`` source), a scalar or per-axis one is broadcast like them
    (``ax``: the K-major axis of a 1-D one). Returned as int64 in the source's code space.
    """
    if z.shape != s_shape:
        raise Refusal(
            f"{role} zero points of '{label(dq)}' have shape {z.shape}, not the scales' {s_shape}",
            dq,
        )
    z = z.astype(np.int64)
    if z.ndim == 3:
        return z.transpose(0, 2, 1) if layout == "nk" else z
    e, blocks, n = shape
    if z.ndim == 0 or z.size == 1:
        return np.broadcast_to(z.reshape(1, 1, 1), shape)
    # per axis (the scales' branch proved which): the output channels (2) or the experts (0)
    return np.broadcast_to(z.reshape((1, 1, n) if ax == 2 else (e, 1, 1)), shape)


def expert_bias(
    role: str, bv: ir.Value | None, e: int, n: int, dtype: ir.DataType
) -> np.ndarray | None:
    """The constant per-expert bias ``[E, N]`` bound to ``bv`` (None when absent)."""
    if bv is None:
        return None
    arr = const_array(bv)
    if arr is None:
        raise Refusal(f"{role} expert bias '{value_label(bv)}' is not constant", bv)
    if arr.shape != (e, n):
        raise Refusal(
            f"{role} expert bias '{value_label(bv)}' has shape {arr.shape}, not {(e, n)}", bv
        )
    if ir.DataType.from_numpy(arr.dtype) != dtype:
        raise Refusal(f"{role} expert bias '{value_label(bv)}' has type {arr.dtype}", bv)
    return arr


def expert(
    b: Mapping[str, Any], tag: str, role: str, r: int, k: int, topk_idx: ir.Value, per_slot: bool
) -> ExpertWeights:
    """Prove one projection ``[*, k, N]`` of the selected experts; return its weights."""
    idx = b.get(f"{tag}_indices")
    if not same_indices(idx, topk_idx):
        raise Refusal(
            f"{role} selects experts with '{value_label(idx)}', not the routing TopK's indices "
            f"'{value_label(topk_idx)}'",
            idx,
        )
    ew = expert_weights(role, b.get(f"{tag}_weight"))
    e, kk, n = ew.shape
    lead = lead_dims(b["tokens"], r - 1)  # concrete where a static export fixes them
    kd = Dim.of(k)
    gmm = bound_node(b, f"{tag}_gmm")
    if gmm is not None:
        if not per_slot:
            if r != 2:
                raise Refusal(f"{role}: GroupedMatMul takes rank-2 tokens [M, K]", gmm)
        else:
            rows, ridx, unflat = (
                bound_node(b, f"{tag}_{s}") for s in ("rows", "row_idx", "unflat")
            )
            assert rows is not None and ridx is not None and unflat is not None
            checks = [
                (rows, [*lead, kd, Dim.of(kk)], [product(lead) * kd, Dim.of(kk)]),
                (ridx, [*lead, kd], [product(lead) * kd, Dim.of(1)]),
                (unflat, [product(lead) * kd, Dim.of(1), Dim.of(n)], [*lead, kd, Dim.of(n)]),
            ]
            for node, dims_in, want in checks:
                shape = const_ints(node.inputs[1])
                got = None
                if shape is not None:
                    got = reshape_dims(dims_in, shape, attr_int(node, "allowzero", 0) or 0)
                if got != want:
                    raise Refusal(
                        f"{role}: Reshape '{label(node)}' (shape {shape}) does not flatten or "
                        f"restore the (token, slot) rows consistently (from {dims_text(dims_in)} it "
                        f"must make {dims_text(want)})",
                        node,
                    )
        bias = expert_bias(role, b.get(f"{tag}_bias"), e, n, ew.dtype)
        return with_bias(ew, bias)

    gather = bound_node(b, f"{tag}_gather")
    mm = bound_node(b, f"{tag}_matmul")
    lhs_unsq = bound_node(b, f"{tag}_lhs_unsq")
    drop = bound_node(b, f"{tag}_drop")
    assert gather is not None and mm is not None and lhs_unsq is not None and drop is not None
    if attr_int(gather, "axis", 0) != 0:
        raise Refusal(
            f"{role}: Gather '{label(gather)}' does not select along the expert axis", gather
        )
    axes = node_axes(lhs_unsq)
    if per_slot:
        # [*, k, K] -> [*, k, 1, K]
        if axes is None or normalize_axes(axes, r + 2) != [r]:
            raise Refusal(
                f"{role}: Unsqueeze '{label(lhs_unsq)}' does not add the row axis (axes {axes})",
                lhs_unsq,
            )
        if bound_node(b, f"{tag}_expand") is not None:
            raise Refusal(f"{role}: unexpected Expand of the per-slot inputs", mm)
    else:
        # [*, K] -> [*, 1, 1, K] (-> Expand [*, k, 1, K])
        if axes is None or sorted(normalize_axes(axes, r + 2) or []) != [r - 1, r]:
            raise Refusal(
                f"{role}: Unsqueeze '{label(lhs_unsq)}' does not add the slot and row axes "
                f"(axes {axes})",
                lhs_unsq,
            )
        expand = bound_node(b, f"{tag}_expand")
        if expand is not None:
            shape = const_ints(expand.inputs[1])
            if shape is None or len(shape) > r + 2:
                raise Refusal(
                    f"{role}: Expand '{label(expand)}' has no usable constant shape", expand
                )
            padded = [1] * (r + 2 - len(shape)) + shape
            # a static export writes the token dims in: each is 1 or that dim of the tokens
            ok = all(v == 1 or Dim.of(v) == d for v, d in zip(padded[: r - 1], lead, strict=True))
            ok = ok and padded[r - 1] in (1, k)
            ok = ok and padded[r] == 1 and padded[r + 1] in (1, kk)
            if not ok:
                raise Refusal(
                    f"{role}: Expand '{label(expand)}' (shape {shape}) does not just repeat each "
                    "token over the k slots",
                    expand,
                )
    if drop.op_type == "Squeeze":
        axes = node_axes(drop)
        if axes is None or normalize_axes(axes, r + 2) != [r]:
            raise Refusal(f"{role}: Squeeze '{label(drop)}' does not drop the row axis", drop)
    else:
        shape = const_ints(drop.inputs[1])
        got = None
        if shape is not None:
            got = reshape_dims(
                [*lead, kd, Dim.of(1), Dim.of(n)], shape, attr_int(drop, "allowzero", 0) or 0
            )
        if got != [*lead, kd, Dim.of(n)]:
            raise Refusal(
                f"{role}: Reshape '{label(drop)}' (shape {shape}) does not just drop the row axis "
                f"(from {dims_text([*lead, kd, Dim.of(1), Dim.of(n)])} it must make "
                f"{dims_text([*lead, kd, Dim.of(n)])})",
                drop,
            )
    bias = None
    bg = bound_node(b, f"{tag}_bias_gather")
    if bg is not None:
        if attr_int(bg, "axis", 0) != 0:
            raise Refusal(
                f"{role}: bias Gather '{label(bg)}' does not select along the expert axis", bg
            )
        if not same_indices(b.get(f"{tag}_bias_indices"), topk_idx):  # as the weights' are
            raise Refusal(f"{role}: the bias is selected with other indices than the weights", bg)
        bias = expert_bias(role, b.get(f"{tag}_bias"), e, n, ew.dtype)
    return with_bias(ew, bias)


def with_bias(ew: ExpertWeights, bias: np.ndarray | None) -> ExpertWeights:
    """``ew`` with its proved bias attached."""
    if bias is None:
        return ew
    return dataclasses.replace(ew, bias=bias)
