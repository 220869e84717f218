"""Read the routing of a dense MoE layer: the TopK, the router it reads, the weights.

Used by :mod:`.dense_experts` and :mod:`.mask`. A dense layer is routed by one ``TopK``
(values ``v``, indices ``idx``, both ``[T, k]``) over the last axis of ``[T, E]`` router
scores; the mask weights the experts by values ``w [T, k]`` computed from ``v``.

What the canonicalisation itself needs is proved here: the TopK selects k distinct experts of
E per row (its axis is the experts', the indices lie in ``[0, E)``), and ``w`` is ``[T, k]``,
one weight per selected expert. The identity ``sum_e dense[t, e] y_e = sum_j w[t, j]
y_{idx[t, j]}`` holds for any such ``w``: whether MoE can compute it (a softmax over the k axis,
a renormalisation) is the layer rules' proof, made on the per-slot form, so their near miss
names it. Which rows the router reads is read (:func:`router_reads`) but compared with the
experts' token rows by the layer proof, which knows them. Refusals are tagged part ``routing``
(:func:`~onnx_moe_fuse.rewrites.graph.refusals.part`) and carry the node at fault.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.dense.consts import (
    STD,
    axes_are,
    const_array,
    const_ints,
)
from onnx_moe_fuse.rewrites.graph.facts import (
    attr_int,
    label,
    static_last_dim,
    static_rank,
    value_label,
)
from onnx_moe_fuse.rewrites.graph.refusals import Refusal, part
from onnx_moe_fuse.rewrites.graph.selection_rounds import same_topk
from onnx_moe_fuse.rewrites.graph.symbolic_dims import value_dims

__all__ = ["Routing", "check_weights", "read_routing", "router_reads"]


@dataclass
class Routing:
    """One TopK over ``[T, E]`` router scores; ``tokens`` is what the router reads.

    ``router`` is the ``MatMul`` / ``Gemm`` behind the scores and ``tokens`` its input, both
    None when the scores cannot be read back to one; the layer proof then refuses the router.
    The selection itself is proved by :meth:`require_selection` and :meth:`require_scores`,
    which the layer proof calls once it has recognised the mask and the combine (so that a
    TopK over another axis is named in a layer known to be a dense MoE).
    """

    topk: ir.Node
    indices: ir.Value
    values: ir.Value
    experts: int
    k: int
    tokens: ir.Value | None
    router: ir.Node | None = None
    scores_rank: int | None = None

    def require_selection(self) -> None:
        """The TopK selects the k largest scores along the experts' (last) axis."""
        topk = self.topk
        with part("routing"):
            if self.scores_rank not in (2, None):
                raise Refusal(
                    f"the router scores '{value_label(topk.inputs[0])}' TopK '{label(topk)}' "
                    f"reads are of rank {self.scores_rank}, not [T, E]",
                    topk,
                )
            axis = attr_int(topk, "axis", -1)
            if axis not in (-1, 1):
                raise Refusal(
                    f"TopK '{label(topk)}' selects along axis {axis}, not over the experts "
                    "(last axis)",
                    topk,
                )
            if attr_int(topk, "largest", 1) != 1:
                raise Refusal(
                    f"TopK '{label(topk)}' selects the smallest scores, not the largest", topk
                )

    def require_scores(self) -> None:
        """The scores are provably ``[T, E]`` (checked after the rows the router reads)."""
        if self.scores_rank is None:
            with part("routing"):
                raise Refusal(
                    f"cannot prove that the router scores '{value_label(self.topk.inputs[0])}' "
                    f"TopK '{label(self.topk)}' reads are [T, E]",
                    self.topk,
                )


def read_routing(topk: ir.Node) -> Routing:
    """Read ``topk``'s k and the router width E, and the router behind the scores.

    What the selection must be is proved later (:meth:`Routing.require_selection`,
    :meth:`Routing.require_scores`); only what reading the mask needs is required here.
    """
    scores = topk.inputs[0]
    k = const_ints(topk.inputs[1]) if len(topk.inputs) > 1 else None
    experts = static_last_dim(scores) if scores is not None else None
    if experts is None and scores is not None:  # masked scores (group-limited top-k): derived dims
        dims = value_dims(scores)
        experts = dims[-1].coef if dims and not dims[-1].syms else None
    if k is None or len(k) != 1 or experts is None or not 1 <= k[0] <= experts:
        with part("routing"):
            raise Refusal(
                f"cannot prove k and the number of experts E of the router TopK '{label(topk)}'",
                topk,
            )
    router = router_reads(scores)
    tokens = router.inputs[0] if router is not None else None
    rank = static_rank(scores)
    if rank is None and scores is not None:
        dims = value_dims(scores)
        rank = len(dims) if dims is not None else None
    return Routing(topk, topk.outputs[1], topk.outputs[0], experts, k[0], tokens, router, rank)


def router_reads(scores: ir.Value) -> ir.Node | None:
    """The ``[MatMul | Gemm](tokens, W)`` behind the scores, through row-wise ops, else None.

    Only Softmax / Sigmoid / Cast / Identity and an Add of a constant lie between: each keeps
    the rows, so the scores have one row per row of the tokens that node reads.
    """
    value = scores
    for _ in range(8):
        node = value.producer()
        if node is None or node.domain not in STD:
            return None
        if node.op_type == "MatMul" or (node.op_type == "Gemm" and not attr_int(node, "transA", 0)):
            return node
        if node.op_type in ("Softmax", "Sigmoid", "Cast", "Identity"):
            value = node.inputs[0]
        elif node.op_type == "Add":
            a, b = node.inputs[0], node.inputs[1]
            value = a if const_array(b) is not None else b if const_array(a) is not None else None
        else:
            return None
        if value is None:
            return None
    return None


#: Ops through which ``[T, k]`` weights are made from the TopK's values (with scalars or per-row
#: values; Slice/Concat/Where may also regroup them): the identity of the rewrite holds for any
#: ``[T, k]`` weights, so which ones MoE can carry (per slot of the selection, non-negative) is
#: the layer rules' proof (``moe.selected_weights``), whose near miss names the node.
_SLOT_WISE = frozenset(
    {"Div", "Mul", "Reciprocal", "Identity", "Cast", "Softmax", "Add", "Sub", "Max", "Min",
     "Clip", "Sigmoid", "Exp", "Relu", "Abs", "Sqrt", "Neg", "Pow", "Slice", "Concat", "Where"}
)  # fmt: skip


def _keeps_slots(node: ir.Node) -> bool:
    """An op that maps ``[T, k]`` values (and scalars) to ``[T, k]`` or a broadcast ``[T, 1]``."""
    if node.domain not in STD:
        return False
    if node.op_type in _SLOT_WISE:
        return True  # a Softmax over any axis keeps the shape (the rules prove the axis)
    return (
        node.op_type == "ReduceSum"
        and attr_int(node, "keepdims", 1) == 1
        and axes_are(node, 2, [1])
    )


def check_weights(w: ir.Value, routing: Routing) -> None:
    """``w`` is computed from the TopK's values, keeping their ``[T, k]`` shape.

    Element-wise ops with scalars, a Softmax, and a ``ReduceSum`` over k that keeps the axis
    (a renormalisation's denominator, broadcast back).
    """
    with part("routing"):
        seen_values = False
        todo, seen = [w], set()
        while todo:
            v = todo.pop()
            if id(v) in seen:
                continue
            seen.add(id(v))
            made_by = v.producer()
            if v is routing.values or (
                made_by is not None and v.index() == 0 and same_topk(made_by, routing.topk)
            ):
                seen_values = True  # (a TopK computing the same: ArgMax + ReduceMax spelled)
                continue
            gather = v.producer()
            if (
                gather is not None
                and gather.op_type == "GatherElements"
                and len(gather.inputs) > 1
                and gather.inputs[1] is routing.indices
            ):
                seen_values = True  # scores taken at the selected experts: one per slot
                continue
            arr = const_array(v)
            if arr is not None and arr.size == 1:
                continue
            node = v.producer()
            if node is None or not _keeps_slots(node):
                raise Refusal(
                    f"the mask is weighted by '{value_label(v)}', which is not computed from "
                    "this TopK's values",
                    node if node is not None else routing.topk,
                )
            todo.extend(i for i in node.inputs if i is not None)
        if not seen_values:
            raise Refusal(
                f"the mask weights '{value_label(w)}' do not come from this TopK's values",
                routing.topk,
            )
