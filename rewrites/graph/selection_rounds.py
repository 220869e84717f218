"""Top-k selection written as rounds of top-1, each masking the experts chosen before.

PhiMoE's sparse mixer (transformers' ``sparsemixer``, eval mode) picks expert 1 as the argmax
of the router logits ``L`` and expert 2 as the argmax of ``L`` with expert 1 set to ``-inf``
(``torch.scatter(scores, -1, selected, -inf)``). Each round is a ``TopK(·, 1)`` once the
spelling pass has rewritten ``ArgMax``. Round ``j`` is column ``j`` of ``TopK(L, m)``:

* round 0, ``TopK(L, 1)`` (largest, along the experts' axis), is the first column of the sorted
  ``TopK(L, m)``: both take the largest value with the lowest index on ties;
* round ``j``, ``TopK(ScatterElements(L_prev, idx_prev, -inf), 1)`` where ``L_prev`` is the
  scores of round ``j-1`` and ``idx_prev`` its indices: ``L`` with every expert of the earlier
  rounds at ``-inf``, whose largest is the ``j``-th largest of ``L`` (ties: lowest index),
  which is column ``j`` of the sorted ``TopK(L, m)``. This holds while ``L`` has more than ``j``
  finite entries per row, which router logits, a projection of finite tokens, have; the
  readers here require ``L`` to be a projection (``MatMul``/``Gemm`` with an optional
  constant ``Add``) and ``E > j``.

:func:`selection_round` reads one round (its column and the logits ``L``); the spelling pass
rewrites ``Concat`` of rounds ``0..m-1`` into ``TopK(L, m)``'s indices, and the layer proof
(``moe.selected_weights``) reads a weight gathered at round ``j``'s indices as slot ``j``.
:func:`same_topk` says when two TopK nodes compute the same (the top-1 spellings make a TopK
for ``ArgMax`` and another for the ``ReduceMax`` beside it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import (
    attr_int,
    attr_str,
    const_array,
    normalize_axes,
    static_last_dim,
    static_rank,
)

__all__ = ["SelectionRound", "is_router_projection", "same_topk", "selection_round"]

_STD = ("", "ai.onnx")
_MAX_ROUNDS = 8


@dataclass(frozen=True)
class SelectionRound:
    """Round ``column`` of a top-1 selection over the router ``logits`` along ``axis``."""

    column: int
    logits: ir.Value
    axis: int
    topk: ir.Node


def _shape_source(value: ir.Value) -> ir.Value:
    """``value``, or the data a chain of ScatterElements writes into (the same shape)."""
    for _ in range(_MAX_ROUNDS):
        node = value.producer()
        if node is None or node.op_type != "ScatterElements" or node.inputs[0] is None:
            return value
        value = node.inputs[0]
    return value


def _normalised_axis(node: ir.Node, value: ir.Value) -> int | None:
    rank = static_rank(_shape_source(value))
    axis = attr_int(node, "axis", -1)
    if rank is None or axis is None or not -rank <= axis < rank:
        return None
    return axis % rank


def _top1(node: ir.Node | None) -> bool:
    if node is None or node.op_type != "TopK" or node.domain not in _STD or len(node.inputs) < 2:
        return False
    k = const_array(node.inputs[1])
    if k is None or np.asarray(k).size != 1 or int(np.asarray(k).reshape(-1)[0]) != 1:
        return False
    return attr_int(node, "largest", 1) == 1 and not any(
        a.is_ref() for a in node.attributes.values()
    )


def _all_minus_inf(value: ir.Value | None) -> bool:
    """``value`` is ``-inf`` everywhere: a constant, or ConstantOfShape / Expand of one."""
    if value is None:
        return False
    array = const_array(value)
    node = value.producer()
    if array is None and node is not None and node.domain in _STD:
        if node.op_type == "ConstantOfShape":
            attr = node.attributes.get("value")
            array = None if attr is None else attr.as_tensor().numpy()
        elif node.op_type == "Expand":
            array = const_array(node.inputs[0])
    if array is None or np.asarray(array).size == 0:
        return False
    data = np.asarray(array, dtype=np.float64)
    return bool(np.all(np.isneginf(data)))


def _is_projection(value: ir.Value) -> bool:
    """Router logits: ``MatMul``/``Gemm`` of the tokens, maybe plus a constant (finite rows)."""
    node = value.producer()
    if node is not None and node.op_type == "Add" and node.domain in _STD:
        consts = [v for v in node.inputs if v is not None and const_array(v) is not None]
        if len(consts) == 1:
            value = next(v for v in node.inputs if v is not None and const_array(v) is None)
            node = value.producer()
    return node is not None and node.domain in _STD and node.op_type in ("MatMul", "Gemm")


def is_router_projection(value: ir.Value) -> bool:
    """Router logits with finite rows: a ``MatMul``/``Gemm`` of the tokens (+ a constant)."""
    return _is_projection(value)


def selection_round(indices: ir.Value | None) -> SelectionRound | None:
    """The round ``indices`` (a TopK-1's indices) is, over which logits; None if not one."""
    if indices is None:
        return None
    node = indices.producer()
    if not _top1(node) or indices is not node.outputs[1]:
        return None
    scores = node.inputs[0]
    axis = _normalised_axis(node, scores) if scores is not None else None
    if axis is None or axis != static_rank(_shape_source(scores)) - 1:
        return None
    scatter = scores.producer()
    if scatter is None or scatter.op_type != "ScatterElements" or scatter.domain not in _STD:
        return SelectionRound(0, scores, axis, node) if _is_projection(scores) else None
    if attr_str(scatter, "reduction", "none") != "none" or len(scatter.inputs) < 3:
        return None
    if _normalised_axis(scatter, scores) != axis or not _all_minus_inf(scatter.inputs[2]):
        return None
    previous = selection_round(scatter.inputs[1])
    if previous is None or previous.column + 1 >= _MAX_ROUNDS:
        return None
    if scatter.inputs[0] is not previous.topk.inputs[0]:
        return None  # round j masks the scores round j-1 read
    experts = static_last_dim(_shape_source(scores))
    if experts is None or experts <= previous.column + 1:
        return None  # round j needs more than j experts (else it picks a masked one again)
    return SelectionRound(previous.column + 1, previous.logits, axis, node)


def same_topk(node: ir.Node, selection: ir.Node) -> bool:
    """``node`` is ``selection`` or computes the same: the same scores, k, axis and order.

    (The top-1 spellings turn ``ArgMax`` and ``ReduceMax`` of one row into two such TopKs.)
    """
    if node is selection:
        return True
    if node.op_type != "TopK" or node.domain not in ("", "ai.onnx"):
        return False
    if len(node.inputs) != len(selection.inputs) or node.inputs[0] is not selection.inputs[0]:
        return False
    k, k_sel = const_array(node.inputs[1]), const_array(selection.inputs[1])
    if k is None or k_sel is None or not np.array_equal(np.ravel(k), np.ravel(k_sel)):
        return False
    rank = static_rank(_shape_source(node.inputs[0]))
    axes = [attr_int(n, "axis", -1) for n in (node, selection)]
    if None in axes:
        return False
    norm = axes if rank is None else normalize_axes(axes, rank)
    return (
        norm is not None
        and norm[0] == norm[1]
        and all(
            attr_int(node, name, default) == attr_int(selection, name, default)
            for name, default in (("largest", 1), ("sorted", 1))
        )
    )
