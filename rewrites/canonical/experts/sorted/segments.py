"""Segments of a sorted-experts block: the histogram, the offsets, and the per-expert MatMuls.

In the grouped_mm form each expert's rows are one contiguous segment of the sorted rows:
``Range(ends[e-1], ends[e], 1)`` with ``ends = CumSum(counts)`` and ``counts`` a histogram of the
ids. :func:`check_offsets` proves ``ends`` are the cumulated per-expert counts; :func:`projection`
proves ``Concat_e(Gather(rows, segment e) @ W[e])`` with ``W[e]`` the ``e``-th slice of one stacked
constant, and returns that constant. Both raise
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` with the reason when they cannot prove it;
they only read the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.value_proofs import (
    const_shape,
    elementwise_eval,
    offset_position,
    producer_op,
    small_const,
    strip,
    uses,
)
from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_ints, label
from onnx_moe_fuse.rewrites.graph.facts import node_axes as _axes
from onnx_moe_fuse.rewrites.graph.refusals import Refusal

__all__ = ["StackedWeight", "check_offsets", "projection"]


@dataclass
class StackedWeight:
    """One projection's stacked expert weights and whether each expert is used transposed."""

    value: ir.Value
    transposed: bool  # the MatMul uses Transpose(W[e]), so W is [E, N, K]

    def k_major_dims(self) -> tuple[int, int]:
        """``(K, N)`` of each expert as its MatMul uses it."""
        _, a, b = self.value.shape
        return (b, a) if self.transposed else (a, b)


# -- segments: histogram, offsets, ranges ------------------------------------------------------


def _check_histogram(histc: ir.Value, leaves: tuple[ir.Value, ...], num_experts: int) -> None:
    """Prove ``histc[e] = #{p : ids[p] == e}`` for ids in ``0..E-1``."""
    sub = producer_op(histc, "Sub")
    if sub is None:
        raise Refusal(f"the counts {histc.name!r} are not a Sub of two prefix counts")
    hi_slice, lo_slice = (producer_op(v, "Slice") for v in sub.inputs)
    if hi_slice is None or lo_slice is None or hi_slice.inputs[0] is not lo_slice.inputs[0]:
        raise Refusal(f"{label(sub)} does not subtract two slices of one prefix count")
    below = hi_slice.inputs[0]
    # Counts pass through exact casts only (float32 holds every count below 2**24 rows).
    reduce = producer_op(strip(below, _is_safe_cast), "ReduceSum")
    if reduce is None or _axes(reduce) not in ([1], [-1]) or attr_int(reduce, "keepdims", 1) != 0:
        raise Refusal(f"{below.name!r} is not a ReduceSum over the rows (axes=[1], keepdims=0)")
    less = producer_op(strip(reduce.inputs[0], _is_safe_cast), "Less")
    bounds = small_const(less.inputs[1], limit=4096) if less is not None else None
    if bounds is None or bounds.ndim != 2 or bounds.shape[1] != 1:
        raise Refusal(f"{reduce.inputs[0].name!r} is not Less(ids, constant bin edges [B, 1])")
    unsq = producer_op(less.inputs[0], "Unsqueeze")
    if unsq is None or _axes(unsq) != [0]:
        raise Refusal(f"{label(less)} does not compare one row of ids with the bin edges")
    edges = bounds[:, 0]
    positions = np.arange(len(edges))
    hi, lo = _slice_positions(hi_slice, positions), _slice_positions(lo_slice, positions)
    if hi is None or lo is None or len(hi) != num_experts or len(lo) != num_experts:
        raise Refusal(f"{label(sub)} does not give one count per expert ({num_experts})")
    samples = np.arange(num_experts)
    for leaf in leaves:
        if leaf.dtype is None or not leaf.dtype.is_integer():
            continue
        mapped = elementwise_eval(unsq.inputs[0], leaf, samples.astype(leaf.dtype.numpy()))
        if mapped is not None:
            break
    else:
        raise Refusal(f"{unsq.inputs[0].name!r} is not an elementwise function of the ids")
    below_edge = (mapped[:, None] < edges[None, :]).astype(np.int64)  # [id, edge]
    per_id = below_edge[:, hi] - below_edge[:, lo]
    if not np.array_equal(per_id, np.eye(num_experts, dtype=np.int64)):
        raise Refusal(f"the histogram bins of {histc.name!r} do not count each expert id once")


def _slice_positions(node: ir.Node, positions: np.ndarray) -> list[int] | None:
    ins = [const_ints(v) if v is not None else None for v in node.inputs[1:5]]
    starts, ends = ins[0], ins[1]
    axes = ins[2] if len(ins) > 2 and node.inputs[3] is not None else [0]
    steps = ins[3] if len(ins) > 3 and node.inputs[4] is not None else [1]
    if None in (starts, ends, axes, steps) or len(starts) != 1 or axes not in ([0], [-1]):
        return None
    start, end, step = starts[0], ends[0], steps[0]
    if step == 0:
        return None
    n = len(positions)
    # ONNX clamps like Python slicing for these bounds (INT64 extremes included).
    return [
        int(p) for p in positions[slice(max(min(start, n), -n - 1), max(min(end, n), -n - 1), step)]
    ]


def _is_safe_cast(node: ir.Node) -> bool:
    to = node.attributes.get("to")
    return node.op_type == "Cast" and to is not None and ir.DataType(to.value) in (
        ir.DataType.INT32, ir.DataType.INT64, ir.DataType.FLOAT, ir.DataType.DOUBLE,
    )  # fmt: skip


def check_offsets(offsets: ir.Value, leaves: tuple[ir.Value, ...], num_experts: int) -> None:
    """Prove ``offsets = CumSum(per-expert counts)`` (inclusive, forward)."""
    cumsum = producer_op(strip(offsets, _is_safe_cast), "CumSum")
    if cumsum is None:
        raise Refusal(f"the segment ends {offsets.name!r} are not a CumSum of counts")
    if (
        const_ints(cumsum.inputs[1]) not in ([0], [-1])
        or attr_int(cumsum, "exclusive", 0) != 0
        or attr_int(cumsum, "reverse", 0) != 0
    ):
        raise Refusal(f"{label(cumsum)} is not an inclusive forward CumSum along axis 0")
    _check_histogram(strip(cumsum.inputs[0], _is_safe_cast), leaves, num_experts)


def _segment_of(index: ir.Value) -> tuple[ir.Value, int]:
    """``(offsets, e)`` for ``Range(offsets[e-1] or 0, offsets[e], 1)``."""
    rng = producer_op(index, "Range")
    if rng is None:
        raise Refusal(f"{index.name!r} is not a Range")
    start, end, delta = rng.inputs
    if const_ints(delta) != [1]:
        raise Refusal(f"{label(rng)} does not step by 1")
    end_pos = offset_position(end)
    if end_pos is None:
        raise Refusal(f"the end of {label(rng)} is not one of the segment ends")
    offsets, e = end_pos
    if e == 0:
        if const_ints(start) != [0]:
            raise Refusal(f"the first segment {label(rng)} does not start at 0")
    else:
        start_pos = offset_position(start)
        if start_pos is None or start_pos[0] is not offsets or start_pos[1] != e - 1:
            raise Refusal(f"{label(rng)} does not start where segment {e - 1} ends")
    return offsets, e


def _stacked_slice(value: ir.Value) -> tuple[ir.Value, int, bool] | None:
    """``(stack, e, transposed)`` when ``value`` is ``stack[e]`` (or its transpose)."""
    transposed = False
    tr = producer_op(value, "Transpose")
    if tr is not None:
        perm = tr.attributes.get("perm")
        if perm is None or list(perm.value) != [1, 0]:
            return None
        value, transposed = tr.inputs[0], True
    sq = producer_op(value, "Squeeze")
    if sq is not None and _axes(sq) == [0]:
        split = producer_op(sq.inputs[0], "Split")
        if split is None or attr_int(split, "axis", 0) != 0:
            return None
        stack = split.inputs[0]
        sizes = const_ints(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] else None
        n = stack.shape[0] if stack.shape is not None else None
        if (sizes is None and n != len(split.outputs)) or (
            sizes and sizes != [1] * len(split.outputs)
        ):
            return None
        return stack, sq.inputs[0].index(), transposed
    gather = producer_op(value, "Gather")
    if gather is not None and attr_int(gather, "axis", 0) == 0:
        index = small_const(gather.inputs[1])
        if index is not None and index.shape == () and index.dtype.kind in "iu" and int(index) >= 0:
            return gather.inputs[0], int(index), transposed
    return None


def projection(
    rows: ir.Value, num_experts: int, tag: str
) -> tuple[ir.Value, StackedWeight, dict[int, ir.Value], ir.Value]:
    """Prove ``Concat_e(Gather(rows, segment e) @ W[e])``; returns (concat, W, ranges, offsets)."""
    gathers = uses(rows)
    concats = set()
    ranges: dict[int, ir.Value] = {}
    slices: dict[int, tuple[ir.Value, int, bool]] = {}
    offsets: ir.Value | None = None
    for gather in gathers:
        if (
            gather.op_type != "Gather"
            or attr_int(gather, "axis", 0) != 0
            or gather.inputs[0] is not rows
        ):
            raise Refusal(f"{tag}: {rows.name!r} feeds {label(gather)}, not a segment Gather")
        off, e = _segment_of(gather.inputs[1])
        if offsets is not None and off is not offsets:
            raise Refusal(f"{tag}: the segments of {rows.name!r} use different ends")
        offsets = off
        mm_users = uses(gather.outputs[0])
        if (
            len(mm_users) != 1
            or mm_users[0].op_type != "MatMul"
            or mm_users[0].inputs[0] is not gather.outputs[0]
        ):
            raise Refusal(
                f"{tag}: segment {e} rows {gather.outputs[0].name!r} do not feed one MatMul"
            )
        matmul = mm_users[0]
        weight = _stacked_slice(matmul.inputs[1])
        if weight is None:
            raise Refusal(f"{tag}: {label(matmul)}'s weight is not a slice of a stacked constant")
        if e in ranges:
            raise Refusal(f"{tag}: segment {e} is computed twice")
        ranges[e], slices[e] = gather.inputs[1], weight
        users = uses(matmul.outputs[0])
        if len(users) != 1 or users[0].op_type != "Concat":
            raise Refusal(f"{tag}: {label(matmul)} does not feed one Concat")
        concats.add(users[0])
    if len(concats) != 1 or sorted(ranges) != list(range(num_experts)):
        raise Refusal(f"{tag}: the {num_experts} expert segments are not all concatenated once")
    concat = concats.pop()
    if attr_int(concat, "axis", 0) != 0 or len(concat.inputs) != num_experts:
        raise Refusal(f"{tag}: {label(concat)} does not stack the segments along the rows")
    for e, v in enumerate(concat.inputs):
        mm = v.producer()
        if mm.inputs[0].producer().inputs[1] is not ranges[e]:
            raise Refusal(f"{tag}: {label(concat)} input {e} is not expert {e}'s segment")
    stacks = {id(s[0]) for s in slices.values()}
    stack, _, transposed = slices[0]
    if len(stacks) != 1 or any(slices[e][1] != e or slices[e][2] != transposed for e in slices):
        raise Refusal(f"{tag}: segment e does not use slice e of one stacked weight")
    if const_shape(stack) is None or stack.shape is None or len(stack.shape) != 3:
        raise Refusal(f"{tag}: the stacked weight {stack.name!r} is not a constant [E, K, N]")
    if stack.shape[0] != num_experts:
        raise Refusal(
            f"{tag}: {stack.name!r} holds {stack.shape[0]} experts, the router {num_experts}"
        )
    return concat.outputs[0], StackedWeight(stack, transposed), ranges, offsets
