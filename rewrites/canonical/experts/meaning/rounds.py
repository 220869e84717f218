"""Routing weights of a selection written as top-1 rounds (PhiMoE's sparse mixer).

PhiMoE picks its k experts in k argmax rounds, each round masking the experts chosen before by
a ScatterElements of ``-inf``; the spelling pass rewrites the ``Concat`` of the rounds' indices
into ``TopK(L, k)``'s indices (:mod:`onnx_moe_fuse.rewrites.graph.selection_rounds`: round ``j``
is column ``j`` of the sorted TopK while a row has more than ``j`` finite logits). Its weights
stay as written: ``Concat(w_0, ..., w_{k-1})`` along the last axis, where ``w_j`` is a
``GatherElements`` of a ``[T, E]`` router value at round ``j``'s indices, so column ``j`` of the
Concat is a value at slot ``j``'s expert: a ``[T, k]`` value of the routing alone, laid out
``[t, j]``. :func:`round_weights` finds such Concats for the analysis to seed as weights (what
the weights are, non-negative and per selected expert, stays the layer rules' proof:
``moe.selected_weights`` reads the same Concat as slots).
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import Departure
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import Mask, Meaning, Routing
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import is_const, value_dims
from onnx_moe_fuse.rewrites.graph.facts import attr_int
from onnx_moe_fuse.rewrites.graph.selection_rounds import selection_round

__all__ = ["dispatch_locations", "masked_router", "round_departure", "round_weights"]

_STD = ("", "ai.onnx")


def _last_axis(node: ir.Node, rank: int) -> bool:
    axis = attr_int(node, "axis", -1 if node.op_type != "GatherElements" else 0)
    return axis is not None and axis % rank == rank - 1


def _column_of(value: ir.Value | None, logits: ir.Value) -> int | None:
    """The round whose indices a one-column ``GatherElements`` of a router value reads."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "GatherElements" or node.domain not in _STD:
        return None
    dims = value_dims(value)
    if dims is None or len(dims) != 2 or dims[1].syms or dims[1].coef != 1:
        return None
    if not _last_axis(node, 2):
        return None
    found = selection_round(node.inputs[1])
    return found.column if found is not None and found.logits is logits else None


def round_weights(topk: ir.Node, k: int) -> list[ir.Value]:
    """The ``[T, k]`` Concats of round-gathered weights whose rounds are ``topk``'s columns.

    ``topk`` must be the sorted, largest-first TopK of the rounds' logits along their last axis
    (its columns are the rounds); each Concat input ``j`` is gathered at round ``j``'s indices.
    """
    logits = topk.inputs[0] if topk.inputs else None
    dims = value_dims(logits)
    if logits is None or dims is None or len(dims) != 2 or k < 2:
        return []
    if attr_int(topk, "sorted", 1) != 1 or attr_int(topk, "largest", 1) != 1:
        return []
    if not _last_axis(topk, 2):
        return []
    found: list[ir.Value] = []
    for first, _ in logits.uses():  # round 0: a TopK(L, 1) beside this one
        if first.op_type != "TopK" or first is topk or len(first.outputs) < 2:
            continue
        start = selection_round(first.outputs[1])
        if start is None or start.column != 0 or start.logits is not logits:
            continue
        for gather, _ in first.outputs[1].uses():
            for concat, _ in gather.outputs[0].uses() if gather.outputs else ():
                if concat.op_type != "Concat" or concat.domain not in _STD:
                    continue
                if len(concat.inputs) != k or not _last_axis(concat, 2):
                    continue
                columns = [_column_of(v, logits) for v in concat.inputs]
                if columns == list(range(k)) and concat.outputs[0] not in found:
                    found.append(concat.outputs[0])
    return found


def _round_text(value: ir.Value, logits: ir.Value) -> str:
    found = selection_round(value)
    if found is None:
        return "not a top-1 of the logits with the earlier rounds' experts scattered to -inf"
    if found.logits is not logits:
        return f"a round over other logits ('{found.logits.name}')"
    return f"round {found.column}"


def round_departure(topk: ir.Node) -> tuple[ir.Node, str, bool] | None:
    """Where ``topk`` is a top-1 round whose indices a ``Concat`` joins with others: that Concat.

    Returns the Concat, what its inputs are, and whether they are the rounds ``0..m-1`` in
    order (a selection in rounds, which the spelling pass makes one ``TopK(L, m)``: the layer is
    analysed at that TopK, and this round is part of its router). None for other TopKs.
    """
    if len(topk.outputs) < 2 or not topk.inputs:
        return None
    first = selection_round(topk.outputs[1])
    if first is None:
        return None
    for concat, _ in topk.outputs[1].uses():
        if concat.op_type != "Concat" or concat.domain not in _STD or not _last_axis(concat, 2):
            continue
        columns = [selection_round(v) for v in concat.inputs]
        ok = all(
            c is not None and c.column == j and c.logits is first.logits
            for j, c in enumerate(columns)
        )
        parts = "; ".join(
            f"input {j} '{v.name}' is {_round_text(v, first.logits)}"
            for j, v in enumerate(concat.inputs)
            if v is not None
        )
        return concat, parts, ok
    if first.column == 0 and not _masked_by_next_round(topk):
        return None  # a top-1 of its own (a top-1 router), not one round of several
    joined = any(
        u.op_type == "TopK" and u is not topk and u.domain in _STD
        for u, _ in first.logits.uses()
        if selection_round(u.outputs[1] if len(u.outputs) > 1 else None) is None
    )
    what = f"round {first.column} of the top-1 rounds over '{first.logits.name}'"
    return topk, what, joined


def _masked_by_next_round(topk: ir.Node) -> bool:
    """The TopK's indices are scattered to -inf into the scores a later round reads."""
    for scatter, _ in topk.outputs[1].uses():
        if scatter.op_type == "ScatterElements" and scatter.outputs:
            if any(selection_round(u.outputs[1]) is not None
                   for u, _ in scatter.outputs[0].uses()
                   if u.op_type == "TopK" and len(u.outputs) > 1):  # fmt: skip
                return True
    return False


def masked_router(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> Meaning | None:
    """``Where(mask of the chosen experts, fill, router logits)``: the next round's scores.

    DeepSpeed's top-2 gate masks the first round's expert (``masked_fill(mask1, -inf)``) in the
    router's own logits before its second argmax: a value of the routing alone, not expert work.
    None where the data operands are not constants or the router's values.
    """
    cond = ins[0] if ins else None
    if cond is None or not isinstance(cond.term, Mask) or len(node.inputs) != 3:
        return None
    for v, m in zip(node.inputs[1:], ins[1:], strict=True):
        if m is not None or v is None or not (is_const(v) or id(v) in ctx.router):
            return None
    return Meaning(cond.axes, Routing())


def dispatch_locations(node: ir.Node, mask: Meaning) -> Departure:
    """Why a ``CumSum`` of the experts' one-hot mask is where the analysis stops.

    DeepSpeed's (and Switch's capacity) gates number each token's place in its expert's buffer
    by a cumulative sum of the mask over the tokens, then dispatch the tokens into ``[E, C, H]``
    capacity slots (a one-hot of the locations, an einsum). That is the layer only if every
    location is proved below the capacity C and distinct per expert; this analysis does not
    prove it, so the dispatch is named, with what it computes.
    """
    return Departure(
        f"a CumSum of the mask idx[t, j] == e laid out {mask.layout()}: each token's location "
        "in its expert's capacity buffer (a capacity dispatch; it is the layer only where every "
        "location is proved distinct and below the capacity, which this analysis does not prove)"
    )
