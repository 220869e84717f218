"""The transfer of each op: a node's output meanings from its inputs' (the dispatch).

Layout ops go to :mod:`.layout`, arithmetic and projections to :mod:`.arith` (dense forms to
:mod:`.dense`), gathers, masks and scatters to :mod:`.indexing`, sorted rows and expert counts to
:mod:`.sorted_rows` (histogram counts, index facts and the sorted combines to :mod:`.id_tables`
and :mod:`.sorted_combine`), the tokens that chose an expert and columns of router values over every
expert to :mod:`.chosen_rows`; index tuples, copies and counts picked by constants are here. A node that
cannot be described raises :class:`~.layout.Departure` with what it computes instead.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning import (
    arith,
    chosen_rows,
    dense,
    indexing,
    layout,
    pair_rows,
    rounds,
    scatters,
    shared,
    sorted_combine,
    sorted_rows,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import Departure
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    Act,
    Coords,
    Counts,
    Factor,
    Mask,
    Meaning,
    Proj,
    Routing,
    RowIndex,
    Weights,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import (
    is_zeros,
    small_const,
    target_dims,
)
from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import attr_int, node_axes

__all__ = ["transfer"]

#: Ops that read only a value's shape: not part of the layer's data flow.
_SHAPE_READS = ("Shape", "Size")


def transfer(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> list[Meaning | None]:
    """The meanings of ``node``'s outputs from its inputs' (``Departure`` when it has none)."""
    op = node.op_type
    if op in _SHAPE_READS:
        return [None] * len(node.outputs)
    if node.domain not in ("", "ai.onnx"):
        raise Departure(f"a {node.domain} op")
    first = ins[0] if ins else None
    written = pair_rows.pair_transfer(node, ins, ctx)  # a boolean index_put of expert rows
    if written is not None:
        return written + [None] * (len(node.outputs) - len(written))
    if op in _LAYOUT and first is None:
        raise Departure(f"a {op} of a value this analysis does not describe")
    if op in _LAYOUT:
        return [_layout(node, first)]  # type: ignore[arg-type]
    extra = shared.shared_transfer(node, ins, ctx)  # a value of the tokens inside the combine
    if extra is not None:
        return extra + [None] * (len(node.outputs) - len(extra))
    extra = sorted_combine.extra_transfer(node, ins, ctx)  # id tables, counts, sorted combines
    if extra is not None:
        return extra + [None] * (len(node.outputs) - len(extra))
    chosen = chosen_rows.chosen_transfer(node, ins, ctx)  # tokens that chose e, E-wide scores
    if chosen is not None:
        return chosen + [None] * (len(node.outputs) - len(chosen))
    if (
        op in ("Gather", "GatherND")
        and first is not None
        and isinstance(first.term, chosen_rows.ScoreColumn)
    ):
        gather = indexing.gather if op == "Gather" else indexing.gather_nd
        return [chosen_rows.read_at_rows(gather(node, first, ins[1], ctx))]
    described = [m for m in ins if m is not None]
    if op not in ("Equal", "GatherElements", "Gather", "GatherND", "ScatterND", "ScatterElements"):
        if described and all(isinstance(m.term, Weights | Routing) for m in described):
            return [arith.routing_value(node, described, ctx)] + [None] * (len(node.outputs) - 1)
    if first is not None and isinstance(first.term, Counts) and op in ("Slice", "Gather"):
        return [_pick_counts(node, first)]
    if op == "Split" and first is not None and len(ins) > 1 and ins[1] is not None:
        return sorted_rows.split_segments(node, first, ins[1], ctx)
    if op == "TopK":
        return sorted_rows.argsort(node, first, ctx)
    if first is not None and isinstance(first.term, Coords) and op in ("Slice", "Split", "Gather"):
        return _coords(node, first, ctx)
    if op in ("Slice", "Split") or (op == "Gather" and first is not None and _is_act(first)):
        if first is None:
            raise Departure(f"a {op} of a value this analysis does not describe")
        return [arith.feature_select(node, first, out) for out in node.outputs]
    if op == "Equal":
        return [indexing.equal(node, ins, ctx)]
    if op == "CumSum" and first is not None and isinstance(first.term, Mask):
        raise rounds.dispatch_locations(node, first)
    if op == "Where" and (masked := rounds.masked_router(node, ins, ctx)) is not None:
        return [masked]
    if op in arith.ELEMENTWISE:
        if all(m is None for m in ins):
            raise Departure(f"a {op} of values this analysis does not describe")
        return [arith.elementwise(node, ins, ctx)] + [None] * (len(node.outputs) - 1)
    if op == "MatMul":
        return [arith.matmul(node, first, _weight_operand(ins, node, ctx), ctx.k)]
    if op == "GroupedMatMul":
        w = indexing.expert_stack(node.inputs[1], ctx.experts)
        bias = indexing.expert_stack(node.inputs[3], ctx.experts) if len(node.inputs) > 3 else None
        return [arith.grouped_matmul(node, [first, w, ins[2]], bias, ctx.k)]
    if op == "ReduceSum" and first is not None:
        return [arith.reduce_sum(node, first, ctx.k)]
    if op == "Gather":
        return [indexing.gather(node, first, ins[1], ctx)]
    if op == "GatherND":
        return [indexing.gather_nd(node, first, ins[1], ctx)]
    if op == "GatherElements":
        return [indexing.gather_elements(node, ins[1], ctx)]
    if op == "OneHot":
        return [indexing.one_hot(node, ins, ctx)]
    if op == "NonZero":
        return [indexing.nonzero(node, first, ctx)]
    if op == "Concat" and first is not None and all(v is node.inputs[0] for v in node.inputs):
        return [_copies(node, first)]
    if op == "Concat":
        joined = sorted_rows.concat_counts(ins) or sorted_rows.concat_segments(node, ins, ctx)
        return [joined if joined is not None else _concat_indices(node, ins)]
    if op == "DequantizeLinear":
        return [indexing.dequantize(node, ins)]
    if op in ("ScatterElements", "ScatterND"):
        into_zeros = ins[0] is None and is_zeros(node.inputs[0])
        weights = dense.scattered_weights(node, ins, into_zeros) or sorted_rows.chosen(
            node, ins, into_zeros
        )
        return [weights if weights is not None else scatters.scatter(node, ins, ctx)]
    if described and all(isinstance(m.term, Weights | Routing) for m in described):
        return [arith.routing_value(node, described, ctx)] + [None] * (len(node.outputs) - 1)
    what = ", ".join(m.term.text() for m in described) or "its inputs"
    raise Departure(f"{_article(op)} {op} of {what} (an op this analysis does not describe)")


_LAYOUT = ("Reshape", "Expand", "Tile", "Squeeze", "Unsqueeze", "Flatten", "Transpose")


def _layout(node: ir.Node, first: Meaning) -> Meaning:
    op = node.op_type
    if op == "Reshape":
        target = target_dims(node.inputs[1])
        if target is None:
            raise Departure("a Reshape to a shape that is not known")
        return layout.reshape(first, target, attr_int(node, "allowzero", 0) or 0)
    if op == "Flatten":
        return layout.flatten(first, attr_int(node, "axis", 1) or 0)
    if op == "Transpose":
        perm = node.attributes.get("perm")
        return layout.transpose(first, list(perm.value) if perm is not None else None)
    if op == "Squeeze":
        return layout.squeeze(first, node_axes(node, 1))
    if op == "Unsqueeze":
        axes = node_axes(node, 1)
        if axes is None:
            raise Departure("an Unsqueeze whose axes are not constant")
        return layout.unsqueeze(first, axes)
    if op == "Expand":
        target = target_dims(node.inputs[1])
        if target is None:
            raise Departure("an Expand to a shape that is not known")
        return layout.expand(first, target)
    reps = small_const(node.inputs[1])
    if reps is None:
        raise Departure("a Tile whose repeats are not constant")
    return layout.tile(first, [int(r) for r in reps.reshape(-1)])


def _coords(node: ir.Node, first: Meaning, ctx: Context) -> list[Meaning | None]:
    """Slice/Split/Gather of index tuples along their coordinate axis."""
    rank = len(first.axes)
    if node.op_type == "Gather":
        return [indexing.gather(node, first, None, ctx)]
    n = len(first.term.vars)  # type: ignore[attr-defined]
    if node.op_type == "Split":
        axis = (attr_int(node, "axis", 0) or 0) % rank
        sizes = small_const(node.inputs[1]) if len(node.inputs) > 1 else None
        count = len(node.outputs)
        counts = sizes.reshape(-1).tolist() if sizes is not None else [n // count] * count
        outs: list[Meaning | None] = []
        start = 0
        for c in counts:
            picked = list(range(start, start + int(c)))
            outs.append(indexing.coords_select(node, first, axis, picked, False))
            start += int(c)
        return outs
    axes = node_axes(node, 3)
    starts, ends = small_const(node.inputs[1]), small_const(node.inputs[2])
    steps = small_const(node.inputs[4]) if len(node.inputs) > 4 else None
    if starts is None or ends is None or starts.size != 1:
        raise Departure("a Slice of index tuples at other than constants")
    axis = (axes[0] if axes else 0) % rank
    step = int(steps.reshape(-1)[0]) if steps is not None else 1
    picked = list(range(n))[int(starts.reshape(-1)[0]) : int(ends.reshape(-1)[0]) : step]
    return [indexing.coords_select(node, first, axis, picked, False)]


def _pick_counts(node: ir.Node, first: Meaning) -> Meaning:
    """Some experts' counts: a Slice or a Gather of the counts at constants."""
    count = len(first.term.experts) if first.term.experts is not None else None  # type: ignore[attr-defined]
    if node.op_type == "Gather":
        index = small_const(node.inputs[1])
        if index is None:
            raise Departure("a Gather of the experts' counts at other than a constant")
        return sorted_rows.count_pick(node, first, [int(i) for i in index.reshape(-1)])
    starts, ends = small_const(node.inputs[1]), small_const(node.inputs[2])
    if starts is None or ends is None or starts.size != 1 or ends.size != 1:
        raise Departure("a Slice of the experts' counts at other than constants")
    top = count if count is not None else 1 << 30
    lo, hi = int(starts.reshape(-1)[0]), min(int(ends.reshape(-1)[0]), top)
    return sorted_rows.count_pick(node, first, list(range(lo, hi)))


def _copies(node: ir.Node, first: Meaning) -> Meaning:
    """``Concat`` of one value with itself: copies along that axis, copy-major (a Tile)."""
    rank = len(first.axes)
    axis = (attr_int(node, "axis", 0) or 0) % rank
    repeats = [len(node.inputs) if i == axis else 1 for i in range(rank)]
    return layout.tile(first, repeats)


def _concat_indices(node: ir.Node, ins: list[Meaning | None]) -> Meaning:
    """Index tuples put together along a unit (or coordinate) axis."""
    if not ins or any(m is None or not isinstance(m.term, RowIndex | Coords) for m in ins):
        raise Departure("a Concat of values other than row indices")
    rank = len(ins[0].axes)  # type: ignore[union-attr]
    axis = (attr_int(node, "axis", 0) or 0) % rank
    names: list[str] = []
    rest = None
    for m in ins:
        assert m is not None
        term = m.term
        if isinstance(term, RowIndex):
            if len(term.coefs) != 1 or term.coefs[0][1] != 1 or m.axes[axis] != ():
                raise Departure("a Concat of row indices that are not single index coordinates")
            names.append(term.coefs[0][0])
        else:
            names.extend(term.vars)  # type: ignore[union-attr]
        others = tuple(a for i, a in enumerate(m.axes) if i != axis)
        if rest is not None and others != rest:
            raise Departure("a Concat of index coordinates over different rows")
        rest = others
    axes = list(ins[0].axes)  # type: ignore[union-attr]
    axes[axis] = (Factor("c", Dim.of(len(names))),)
    return Meaning(tuple(axes), Coords(tuple(names)))


def _article(op: str) -> str:
    return "an" if op[0] in "AEIOU" else "a"


def _is_act(m: Meaning) -> bool:
    t = m.term
    return isinstance(t, Act) or (isinstance(t, Proj) and t.stage == 1)


def _weight_operand(ins: list[Meaning | None], node: ir.Node, ctx: Context) -> Meaning | None:
    """A MatMul's second operand: described, an expert stack, or one expert's own weight."""
    m = ins[1] if len(ins) > 1 else None
    if m is None and len(node.inputs) > 1:
        return indexing.expert_stack(node.inputs[1], ctx.experts) or indexing.single_weight(
            node.inputs[1]
        )
    return m
