"""The router behind a routing TopK: the token rows it projects, and the nodes in between.

The analysis of meaning seeds its walk with the rows the router reads (``MatMul(rows, W)`` /
``Gemm`` by a constant 2-D weight). Between that projection and the TopK a router may compute
its scores in any element-wise way, reshape them (DeepSeek's expert groups ``[T, G, E/G]``
flattened back to ``[T, E]``) and mask some of them out (``masked_fill``: a ``Where`` of a mask
computed from the scores themselves, or a ScatterElements of ``-inf`` at an earlier round's
choice, PhiMoE's and DeepSpeed's argmax rounds). :func:`router_path` follows the score operand
of each such node back to the projection. It decides nothing about the routing: which experts
the TopK selects and with which weights is the layer rules' proof (row-wise scores,
non-negative per-selected weights, ``docs/routing.md``); here the rows only name what the
experts must read, and the path names the nodes that are the router, not expert work.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import (
    const_shape,
    is_const,
    value_dims,
)

__all__ = ["router_path"]

#: Element-wise score maps with one non-constant operand (the scores).
_WRAPPERS = (
    "Softmax", "Sigmoid", "Cast", "Identity", "Add", "Mul", "Div", "LogSoftmax", "Sub", "Neg",
    "Relu", "Exp", "Softplus", "Tanh",
)  # fmt: skip
#: Layout ops: the scores are their first operand (the rest are shapes and axes).
_LAYOUT = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
#: Ops that mask or overwrite scores: the scores are their data operand (``Where``'s x or y, a
#: scatter's data), the mask or the index and the fill are the router's own values.
_MASKS = {"Where": (1, 2), "ScatterElements": (0,), "ScatterND": (0,)}
_WEIGHT_WRAPPERS = ("Transpose", "Cast", "Identity", "DequantizeLinear")
_DEPTH = 16


def _projection_rows(node: ir.Node) -> ir.Value | None:
    """``node``'s token rows when it is a router projection by a constant 2-D weight."""
    if node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
        return None
    weight = node.inputs[1]
    shape = const_shape(weight)
    while shape is None and weight is not None and weight.producer() is not None:
        p = weight.producer()
        if p.op_type not in _WEIGHT_WRAPPERS:
            break
        weight = p.inputs[0]
        shape = const_shape(weight)
    return node.inputs[0] if shape is not None and len(shape) == 2 else None


def _scores_operand(node: ir.Node) -> ir.Value | None:
    """The one input of ``node`` that carries the scores, or None where it is not one."""
    op = node.op_type
    if op in _LAYOUT:
        return node.inputs[0] if node.inputs else None
    if op in _MASKS:
        data = [node.inputs[i] for i in _MASKS[op] if i < len(node.inputs)]
        data = [v for v in data if v is not None and not is_const(v)]
        return data[0] if len(data) == 1 else None
    if op not in _WRAPPERS:
        return None
    described = [i for i in node.inputs if i is not None and not is_const(i)]
    return described[0] if len(described) == 1 else None


def router_path(topk: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
    """The router rows behind ``topk``'s scores and the nodes from them to the TopK.

    None where the scores are not a projection of token rows reached through score maps,
    reshapes and masks, or where the TopK's rows are not the projection's (its leading dims
    differ from the rows': a TopK inside the router, over groups of experts).
    """
    v = topk.inputs[0] if topk.inputs else None
    path: list[ir.Node] = []
    for _ in range(_DEPTH):
        node = v.producer() if v is not None else None
        if node is None:
            return None
        path.append(node)
        rows = _projection_rows(node)
        if rows is not None:
            return (rows, path) if _same_rows(topk.inputs[0], rows) else None
        v = _scores_operand(node)
    return None


def _same_rows(scores: ir.Value, rows: ir.Value) -> bool:
    """The TopK's scores have the rows' rank and no leading dim that provably differs.

    A symbolic dim may have lost its tie to the rows' through a mask (a ``Where`` broadcast);
    the walk's own checks meet the ids with the rows where it matters.
    """
    sdims, rdims = value_dims(scores), value_dims(rows)
    if sdims is None or rdims is None:
        return True
    if len(sdims) != len(rdims):
        return False
    return all(a == b or a.syms or b.syms for a, b in zip(sdims[:-1], rdims[:-1], strict=True))
