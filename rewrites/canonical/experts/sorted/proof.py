"""Proof that a grouped_mm (sorted rows) experts block computes per-slot expert projections.

transformers' ``grouped_mm`` experts, exported, compute for ``N = T*k`` routed rows::

    perm   = TopK(flat_ids, N, largest=0, sorted=1).indices     # argsort of the flat ids
    rows   = tokens[perm // k]                                   # token rows in sorted order
    counts = histogram of the sorted ids over the E experts      # Less/ReduceSum/Slice/Sub
    ends   = CumSum(counts); segment e = Range(ends[e-1], ends[e])
    fc1    = Concat_e(Gather(rows, segment e) @ W1[e])           # W1[e] = Squeeze(Split(W1)[e])
             (+ Gather(B1, sorted ids) or GatherND, a per-expert bias)
    act    = row-wise activation of fc1
    fc2    = Concat_e(Gather(act, segment e) @ W2[e])
    out    = un-sort(fc2 * flat_weights[perm]) -> Reshape [T, k, H] -> ReduceSum over k

:func:`analyse_sorted_block` proves, from the argsort TopK, that this equals
``out[t] = sum_j w[t, j] * act(x[t] @ W1[ids[t, j]]) @ W2[ids[t, j]]``:

* the sort is a permutation (TopK over the full length) and ascending, so sorted row ``p`` has
  the ``p``-th smallest id and each expert's rows are contiguous;
* the segment sizes are the per-expert counts of those same ids: the histogram is checked value
  by value over every id ``0..E-1`` the router can produce (its chain is elementwise in the id,
  so that is exhaustive), then summed (float counts are exact below 2**24 rows) and cumulated;
* segment ``e`` is ``Range(ends[e-1], ends[e], 1)``, the ``e``-th Concat input uses it with the
  ``e``-th slice of one stacked constant, for FC1 and FC2 alike, with the same segments;
* the activation treats each row on its own (:mod:`~onnx_moe_fuse.rewrites.canonical.experts.rowwise`), so it commutes with the
  permutation;
* the tokens are float32 (the dtype the layer rules fuse; other blocks are refused, naming it);
* the un-sort uses the inverse of the same ``perm``: a ``ScatterND(_, perm, arange)`` inverse, or
  ``ScatterND(_, perm, rows)``; the routing weights are gathered with the same ``perm``.

Range/ScatterND lengths are not proved equal to ``N``: a model in which they differ fails in ONNX
Runtime (ScatterND's updates must match its indices), so on any model that runs they agree. Only
reads the graph; a failed proof raises :class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` with
the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.rowwise import RowwiseRegion, rowwise_region
from onnx_moe_fuse.rewrites.canonical.experts.sorted.combine import combine
from onnx_moe_fuse.rewrites.canonical.experts.sorted.segments import (
    StackedWeight,
    check_offsets,
    projection,
)
from onnx_moe_fuse.rewrites.canonical.experts.value_proofs import (
    const_shape,
    is_floor_div,
    is_length_of,
    is_unsqueeze_last,
    producer_op,
    uses,
)
from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_ints, label
from onnx_moe_fuse.rewrites.graph.refusals import Refusal

__all__ = [
    "StackedWeight",
    "SortedBlock",
    "sort_candidates",
    "analyse_sorted_block",
]


@dataclass
class SortedBlock:
    """A proved block: the values the per-slot form is built from."""

    sort: ir.Node
    tokens: ir.Value  # [T, H]
    ids: ir.Value  # [T, k]
    weights: ir.Value  # [T, k]
    k: int
    num_experts: int
    fc1: StackedWeight
    fc2: StackedWeight
    activation: RowwiseRegion
    layer_out: ir.Value  # [T, H], the ReduceSum over k
    fc1_bias: ir.Value | None = None  # [E, N1], added per row as bias[sorted id]
    fc2_bias: ir.Value | None = None  # [E, H]
    # the wider float type a half-precision block sums its experts' outputs in (None: its own)
    upcast: ir.DataType | None = None


def _routing_ids(flat: ir.Value) -> ir.Value | None:
    reshape = producer_op(flat, "Reshape")
    if reshape is None:
        return None
    ids = reshape.inputs[0]
    topk = producer_op(ids, "TopK")
    return ids if topk is not None and ids.index() == 1 else None


def sort_candidates(graph: ir.Graph) -> list[ir.Node]:
    """TopK nodes over a flattened integer tensor (argsorts of ids): the blocks to analyse.

    Wider than the proof: a sort of ids that are not one routing TopK's indices is a candidate
    too, so that its refusal is reported.
    """
    found = []
    for node in graph:
        if node.op_type != "TopK" or node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        flat = node.inputs[0]
        reshape = producer_op(flat, "Reshape")
        if reshape is not None and flat.dtype is not None and flat.dtype.is_integer():
            found.append(node)
    return found


# -- sort, routing, tokens ---------------------------------------------------------------------


def _check_sort(sort: ir.Node) -> tuple[ir.Value, ir.Value, int, int]:
    """Return ``(flat, ids, k, E)`` for an ascending full-length argsort of the flat ids."""
    flat = sort.inputs[0]
    ids = _routing_ids(flat)
    if ids is None:
        raise Refusal(
            f"{label(sort)} sorts {flat.name!r}, which is not the flattened expert indices of "
            "one routing TopK"
        )
    if len(sort.inputs) < 2 or len(ids.producer().inputs) < 2:
        raise Refusal(f"{label(sort)} does not sort the ids of a TopK with a K input")
    if attr_int(sort, "largest", 1) != 0 or attr_int(sort, "sorted", 1) != 1:
        raise Refusal(f"{label(sort)} is not an ascending sort (largest=0, sorted=1)")
    if attr_int(sort, "axis", -1) not in (0, -1) or flat.shape is None or len(flat.shape) != 1:
        raise Refusal(f"{label(sort)} does not sort one flat list of ids")
    reshape = flat.producer()
    if reshape.op_type == "Reshape" and const_ints(reshape.inputs[1]) != [-1]:
        raise Refusal(f"{label(reshape)} does not flatten the ids with [-1]")
    if not is_length_of(sort.inputs[1], flat):
        raise Refusal(f"{label(sort)}'s K is not proved to be the length of {flat.name!r}")
    route = ids.producer()
    k_const = const_ints(route.inputs[1])
    if ids.shape is None or len(ids.shape) != 2 or not k_const or len(k_const) != 1:
        raise Refusal(f"the routing {label(route)} does not give [T, k] ids with a constant k")
    scores = route.inputs[0]
    if scores.shape is None or attr_int(route, "axis", -1) not in (-1, len(scores.shape) - 1):
        raise Refusal(f"the routing {label(route)} does not select along the experts axis")
    num_experts = scores.shape[-1]
    if not isinstance(num_experts, int):
        raise Refusal(f"the number of experts ({scores.name!r} last dim) is not static")
    return flat, ids, k_const[0], num_experts


def _sorted_tokens(perm: ir.Value, k: int, ids: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``(tokens, rows)``: the one gather of ``tokens[perm // k]`` (rows in sorted order)."""
    found = []
    for q_node in uses(perm):
        for q in q_node.outputs:
            for cand in [q, *[o for n in uses(q) for o in n.outputs]]:
                if not is_floor_div(cand, perm, k):
                    continue
                for user in uses(cand):
                    if user.op_type == "Gather" and attr_int(user, "axis", 0) == 0:
                        if user.inputs[1] is cand:
                            found.append((user.inputs[0], user.outputs[0]))
                    for g in [n for o in user.outputs for n in uses(o)]:
                        if (
                            g.op_type == "GatherND"
                            and attr_int(g, "batch_dims", 0) == 0
                            and is_unsqueeze_last(g.inputs[1], cand)
                        ):
                            found.append((g.inputs[0], g.outputs[0]))
    unique = {id(rows): (tokens, rows) for tokens, rows in found}
    if len(unique) != 1:
        raise Refusal(
            f"expected one gather of the token rows by {perm.name!r} // {k}, found {len(unique)}"
        )
    tokens, rows = next(iter(unique.values()))
    if tokens.shape is None or len(tokens.shape) != 2:
        raise Refusal(f"the tokens {tokens.name!r} are not a [T, H] matrix")
    if not _same_dim(tokens.shape[0], ids.shape[0]):
        raise Refusal(
            f"the tokens {tokens.name!r} and the ids {ids.name!r} are not proved to have the "
            "same number of rows"
        )
    return tokens, rows


def _same_dim(a: int | ir.SymbolicDim, b: int | ir.SymbolicDim) -> bool:
    """Two dims known to be equal: the same integer, or the same named symbolic dim."""
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    return a.value is not None and a.value == b.value


# -- the whole block ---------------------------------------------------------------------------


_LAYER_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def analyse_sorted_block(sort: ir.Node) -> SortedBlock:
    """Prove the block whose argsort is ``sort``; raise a ``Refusal`` otherwise."""
    flat, ids, k, num_experts = _check_sort(sort)
    sorted_ids, perm = sort.outputs
    tokens, rows = _sorted_tokens(perm, k, ids)
    if tokens.dtype not in _LAYER_FLOATS:
        # The layer rules fuse float32, float16 and bfloat16 experts; a block in another type
        # would be rewritten for nothing, and its refusal should say why it is left.
        raise Refusal(
            f"the block computes in {_dtype_name(tokens.dtype)} ({tokens.name!r}); the layer "
            "rules fuse float32, float16 and bfloat16 experts"
        )
    fc1_out, fc1, ranges1, offsets = projection(rows, num_experts, "FC1")
    check_offsets(offsets, (sorted_ids, flat), num_experts)
    segment_ranges = {id(v) for v in ranges1.values()}

    def is_fc2_gather(node: ir.Node) -> bool:
        return (
            node.op_type == "Gather"
            and node.inputs[1] is not None
            and (
                id(node.inputs[1]) in segment_ranges
                or producer_op(node.inputs[1], "Range") is not None
            )
        )

    fc1_out, fc1_bias = _bias_added(fc1_out, sorted_ids, num_experts, tokens)
    region, why = rowwise_region(fc1_out, is_fc2_gather)
    if region is None:
        raise Refusal(f"activation: {why}")
    fc2_out, fc2, _, offsets2 = projection(region.end, num_experts, "FC2")
    if offsets2 is not offsets:
        raise Refusal("FC2's segments do not use FC1's segment ends")
    _check_weight_shapes(tokens, fc1, fc2)
    hidden = fc2.k_major_dims()[1]
    fc2_out, fc2_bias = _bias_added(fc2_out, sorted_ids, num_experts, tokens)
    layer_out, weights, upcast = combine(fc2_out, perm, k, hidden)
    if not layer_out.is_graph_output() and not layer_out.uses():
        raise Refusal(f"the layer output {layer_out.name!r} is not used")
    return SortedBlock(
        sort,
        tokens,
        ids,
        weights,
        k,
        num_experts,
        fc1,
        fc2,
        region,
        layer_out,
        fc1_bias,
        fc2_bias,
        upcast,
    )


def _dtype_name(dtype: ir.DataType | None) -> str:
    """``float16``, ``bfloat16``, ...: the numpy-style name of ``dtype``."""
    if dtype is None:
        return "an unknown dtype"
    return {ir.DataType.BFLOAT16: "bfloat16"}.get(dtype, str(np.dtype(dtype.numpy())))


def _bias_added(
    rows: ir.Value, sorted_ids: ir.Value, num_experts: int, tokens: ir.Value
) -> tuple[ir.Value, ir.Value | None]:
    """``(rows + bias[sorted_ids], bias)`` when that is the one use of ``rows``; else (rows, None).

    Sorted row ``p`` belongs to expert ``sorted_ids[p]``, so adding that expert's bias row is
    GroupedMatMul's bias in the per-slot form.
    """
    users = uses(rows)
    if len(users) != 1 or users[0].op_type != "Add":
        return rows, None
    add = users[0]
    other = add.inputs[1] if add.inputs[0] is rows else add.inputs[0]
    gather = producer_op(other, "Gather", "GatherND")
    if gather is None:
        return rows, None
    if gather.op_type == "Gather":
        by_sorted_ids = gather.inputs[1] is sorted_ids and attr_int(gather, "axis", 0) == 0
    else:
        by_sorted_ids = attr_int(gather, "batch_dims", 0) == 0 and is_unsqueeze_last(
            gather.inputs[1], sorted_ids
        )
    if not by_sorted_ids:
        return rows, None
    bias = gather.inputs[0]
    shape = const_shape(bias)
    if shape is None or len(shape) != 2 or shape[0] != num_experts or bias.dtype != tokens.dtype:
        return rows, None
    return add.outputs[0], bias


def _check_weight_shapes(tokens: ir.Value, fc1: StackedWeight, fc2: StackedWeight) -> None:
    hidden = tokens.shape[1]
    k1, _ = fc1.k_major_dims()
    _, n2 = fc2.k_major_dims()
    if not isinstance(hidden, int) or k1 != hidden or n2 != hidden:
        raise Refusal(f"the expert weights do not map {tokens.name!r}'s {hidden} features back")
    if fc1.value.dtype != tokens.dtype or fc2.value.dtype != tokens.dtype:
        raise Refusal("the expert weights and the tokens differ in dtype")
