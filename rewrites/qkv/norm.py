"""The RMS norm's proofs: the op spellings and the decomposed one, epsilon, scale, axis, precision.

:class:`_NormFacts` carries what the fused node needs (input, skip, scale, epsilon); the
norm's nodes and their other readers decide whether the norm stays beside the fused node.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.qkv.graph import (
    attr_or,
    const,
    const_scalar,
    dtype_name,
    elem_type,
    int_attr,
    item_label,
    np_dtype,
    pick,
    static_dims,
    static_shape,
)
from onnx_moe_fuse.rewrites.qkv.projections import (
    check_last_axis,
    precise_enough,
)


@dataclass
class _NormFacts:
    x: ir.Value  # the value normalised (A, or A + skip)
    scale: ir.Value
    scale_dtype: ir.DataType | None  # of ``scale`` as bound (before any Cast)
    epsilon: float
    axis_node: ir.Node


def decomposed_facts(b: dict[str, Any], dtype: ir.DataType, rank: int | None) -> _NormFacts:
    x = pick(b, "residual", "x")
    normed = b["normed"]
    anchor = normed.producer()
    x_up = b.get("x_up")
    # the element types along the chain (ONNX typing ties the rest together)
    casts = [v for v in (x_up, b.get("normalized_cast"), b.get("scale_cast")) if v is not None]
    if anchor.op_type == "Cast":
        casts.append(normed)
    x_type = elem_type(x)
    if x_type is None and not casts:
        x_type = dtype  # no Cast anywhere: every value of the chain has normed's type
    if x_type != dtype:
        raise Refusal(
            f"the norm's input {item_label(x)} is {dtype_name(x_type)}, but the projections compute "
            f"in {dtype_name(dtype)} (the fused node reads A in the projections' type)",
            x,
        )
    compute = ir.DataType(int_attr(x_up.producer(), "to", 0)) if x_up is not None else x_type
    precise_enough(x_up.producer() if x_up is not None else anchor, compute, dtype, "the norm")
    nc = b.get("normalized_cast")
    mul_type = ir.DataType(int_attr(nc.producer(), "to", 0)) if nc is not None else compute
    precise_enough(anchor, mul_type, dtype, "the scale multiplication")
    if anchor.op_type == "Cast" and int_attr(anchor, "to", 0) != dtype:
        raise Refusal(f"{item_label(anchor)}: casts to another type than the projections'", anchor)
    pow_exp = b.get("pow_exponent")
    if b.get("sq_pow") is not None and const_scalar(pow_exp) != 2.0:
        raise Refusal(
            f"{item_label(b['sq_pow'].producer())}: the power is {const_scalar(pow_exp)}, not 2",
            b["sq_pow"].producer(),
        )
    rm = b["mean_sq"].producer()
    axes_v = b.get("rm_axes")
    axes = const(axes_v) if axes_v is not None else None
    if axes_v is not None and axes is None:
        raise Refusal(f"{item_label(rm)}: its axes {item_label(axes_v)} are not constant", rm)
    axes_list = (
        [int(a) for a in axes.reshape(-1)] if axes is not None else attr_or(rm, "axes", None)
    )
    if not axes_list or len(axes_list) != 1:
        raise Refusal(
            f"{item_label(rm)}: reduces over axes {axes_list}, not the last axis only", rm
        )
    check_last_axis(rm, int(axes_list[0]), rank, "reduces over")
    if int_attr(rm, "keepdims", 1) != 1:
        raise Refusal(f"{item_label(rm)}: keepdims=0 (the mean does not broadcast back)", rm)
    eps = const_scalar(b.get("epsilon"))
    if eps is None:
        raise Refusal(
            f"the epsilon added to the mean square ({item_label(b.get('epsilon'))}) is not a "
            "constant scalar",
            b["mean_sq"].producer(),
        )
    if b.get("inv_div") is not None and const_scalar(b.get("one")) != 1.0:
        raise Refusal(
            f"{item_label(b['inv_div'].producer())}: divides {const_scalar(b.get('one'))}, not 1, "
            "by the RMS",
            b["inv_div"].producer(),
        )
    sc = b.get("scale_cast")
    scale = b["norm_scale"]
    scale_dtype = elem_type(scale) if sc is not None else mul_type
    return _NormFacts(x, scale, scale_dtype, eps, rm)


def op_norm_facts(b: dict[str, Any], dtype: ir.DataType, rank: int | None) -> _NormFacts:
    normed = b["normed"]
    node = normed.producer()
    scale = b["norm_scale"]
    if node.op_type == "SkipSimplifiedLayerNormalization":
        x = b["a"]
        if b.get("ssln_bias") is not None:
            raise Refusal(
                f"{item_label(node)}: SkipSimplifiedLayerNormalization with a bias input; "
                "MatMulNBitsQkv adds none",
                node,
                b["ssln_bias"],
            )
        eps = attr_or(node, "epsilon", 1e-12)
    else:
        x = pick(b, "residual", "x")
        eps = attr_or(node, "epsilon", 1e-5)
        check_last_axis(node, int_attr(node, "axis", -1), rank, "normalises over")
        stash = int_attr(node, "stash_type", 1)
        if stash != 1:
            raise Refusal(
                f"{item_label(node)}: stash_type={stash}; the fused node computes the norm in "
                "float32 (stash_type 1)",
                node,
            )
    x_type = elem_type(x)
    if x_type != dtype:
        raise Refusal(
            f"the norm's input {item_label(x)} is {dtype_name(x_type)}, but the projections compute "
            f"in {dtype_name(dtype)}",
            x,
        )
    return _NormFacts(x, scale, elem_type(scale), float(eps), node)


def fused_scale(facts: _NormFacts, dtype: ir.DataType, k: int) -> ir.Value | np.ndarray:
    """The ``[K]`` norm scale of the fused node's type: the value itself, or an exact copy."""
    scale = facts.scale
    if facts.scale_dtype == dtype and static_shape(scale) == (k,):
        return scale
    arr = const(scale)
    if arr is None:
        raise Refusal(
            f"the norm scale {item_label(scale)} ({dtype_name(facts.scale_dtype)}, shape "
            f"{static_dims(scale)}) cannot be proven to be [K] = [{k}] of {dtype_name(dtype)}",
            scale,
        )
    if arr.size == 1:
        arr = np.full((k,), arr.reshape(-1)[0], dtype=arr.dtype)
    elif arr.size != k or any(d != 1 for d in arr.shape[:-1]) or arr.shape[-1] != k:
        raise Refusal(
            f"the norm scale {item_label(scale)} has shape {list(arr.shape)}, not [K] = [{k}]",
            scale,
        )
    out = arr.reshape(k).astype(np_dtype(dtype))
    if not np.array_equal(out.astype(np.float64), arr.reshape(k).astype(np.float64)):
        raise Refusal(
            f"the norm scale {item_label(scale)} is {dtype_name(ir.DataType.from_numpy(arr.dtype))}"
            f" and not exactly representable in {dtype_name(dtype)}",
            scale,
        )
    return np.ascontiguousarray(out)


def same_shape(a: ir.Value, b: ir.Value) -> bool:
    da, db = static_dims(a), static_dims(b)
    return da is not None and da == db


def norm_region_nodes(normed: ir.Value, stops: Iterable[ir.Value | None]) -> list[ir.Node]:
    """The nodes computing ``normed`` from the boundary values ``stops`` (constants excluded)."""
    stop_ids = {id(v) for v in stops if v is not None}
    seen: dict[int, ir.Node] = {}
    todo = [normed.producer()]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        for v in node.inputs:
            if v is None or id(v) in stop_ids or v.is_graph_input() or v.is_initializer():
                continue
            p = v.producer()
            if p is not None and p.op_type != "Constant":
                todo.append(p)
    return list(seen.values())


def read_uses(value: ir.Value, allowed: set[int]) -> bool:
    """True when ``value`` is a graph output or read by a node outside ``allowed`` (ids)."""
    if value.is_graph_output():
        return True
    return any(id(user) not in allowed for user, _ in value.uses())
