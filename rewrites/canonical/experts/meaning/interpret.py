"""Interpret the nodes around one routing TopK: every value described by what it holds.

:func:`interpret_layer` seeds the description with the TopK's ids ``idx[t, j]`` and values
``w[t, j]`` and the router's token rows ``X[t, h]`` (and the ``[B, S, H]`` value those rows are
reshaped from), then walks forward in graph order through the nodes that read a described value,
applying each op's transfer (:mod:`.layout`, :mod:`.arith`, :mod:`.indexing`). The first value
that holds the whole layer (a :class:`~.terms.SlotSum` over every slot) ends the walk: the
:class:`Interpretation` has it. Where a node cannot be described, its :class:`Departure` is
kept; the one that departs furthest along the layer (the highest ``progress`` of what it read)
is what a near miss reports: the node, what it computes there and what the layer needed next.

Only the graph is read: shapes, small constants (axes, Reshape targets, scalars), never the
expert weights.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning import (
    arith,
    dense,
    indexing,
    layout,
    sorted_rows,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import Departure
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    Act,
    Coords,
    Counts,
    ExpertSum,
    Factor,
    Ids,
    Meaning,
    Param,
    Proj,
    Routing,
    RowIndex,
    SlotSum,
    Term,
    Tokens,
    Weighted,
    Weights,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import (
    const_shape,
    is_const,
    is_zeros,
    small_const,
    target_dims,
    value_dims,
)
from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import attr_int, label, node_axes

__all__ = ["DepartureAt", "Interpretation", "interpret_layer", "router_rows"]

#: What the layer needs next after a value of each progress (the near miss's "expected").
EXPECTED = {
    0: "the tokens gathered per slot, projected by each slot's expert (FC1)",
    1: "the tokens projected by the expert weights gathered at the ids (FC1)",
    2: "an elementwise activation of FC1's outputs, then FC2 by the same ids",
    3: "the activations projected by each slot's expert (FC2)",
    4: "FC2's outputs times the routing weights w[t, j]",
    5: "the weighted outputs summed over the slots j per token",
    6: "the rest of the slots added",
}

_ROUTER_WRAPPERS = ("Softmax", "Sigmoid", "Cast", "Identity", "Add", "Mul", "Div", "LogSoftmax")
_TOKEN_LAYOUT = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")


@dataclass(frozen=True)
class DepartureAt:
    """A node that could not be described: what it read and why."""

    node: ir.Node
    reason: str
    progress: int
    read: tuple[str, ...]

    @property
    def expected(self) -> str:
        """What the layer needed at this point."""
        return EXPECTED.get(self.progress, EXPECTED[0])

    def sentence(self) -> str:
        """The near miss's words."""
        read = "; ".join(self.read)
        return (
            f"{self.node.op_type} '{label(self.node)}' computes {self.reason}, reading {read}; "
            f"expected {self.expected}"
        )


@dataclass
class Interpretation:
    """The meanings found around one TopK; ``output`` holds the layer, where one was found."""

    topk: ir.Node
    tokens: ir.Value | None
    k: int
    experts: int = 0
    meanings: dict[int, tuple[ir.Value, Meaning]] = field(default_factory=dict)
    output: ir.Value | None = None
    departures: list[DepartureAt] = field(default_factory=list)
    token_values: list[ir.Value] = field(default_factory=list)

    def meaning(self, value: ir.Value | None) -> Meaning | None:
        """The description of ``value`` (None when it has none)."""
        if value is None:
            return None
        found = self.meanings.get(id(value))
        return found[1] if found is not None else None

    def furthest(self) -> DepartureAt | None:
        """The departure furthest along the layer (the earliest among equals)."""
        if not self.departures:
            return None
        best = max(d.progress for d in self.departures)
        return next(d for d in self.departures if d.progress == best)


def router_rows(topk: ir.Node) -> ir.Value | None:
    """The token rows the router projects: ``MatMul(rows, W)`` / ``Gemm`` behind the scores."""
    v = topk.inputs[0] if topk.inputs else None
    for _ in range(8):
        node = v.producer() if v is not None else None
        if node is None:
            return None
        if node.op_type in ("MatMul", "Gemm") and len(node.inputs) >= 2:
            weight = node.inputs[1]
            shape = const_shape(weight)
            while shape is None and weight is not None and weight.producer() is not None:
                p = weight.producer()
                if p.op_type not in ("Transpose", "Cast", "Identity", "DequantizeLinear"):
                    break
                weight = p.inputs[0]
                shape = const_shape(weight)
            return node.inputs[0] if shape is not None and len(shape) == 2 else None
        if node.op_type not in _ROUTER_WRAPPERS:
            return None
        described = [i for i in node.inputs if i is not None and not is_const(i)]
        if len(described) != 1:
            return None
        v = described[0]
    return None


def _router_nodes(topk: ir.Node, rows: ir.Value) -> set[int]:
    """The nodes from the router rows to the TopK's scores (the projection and its wrappers)."""
    out: set[int] = set()
    v = topk.inputs[0] if topk.inputs else None
    for _ in range(8):
        node = v.producer() if v is not None else None
        if node is None:
            break
        out.add(id(node))
        if rows in node.inputs:
            break
        v = next((i for i in node.inputs if i is not None and not is_const(i)), None)
    return out


class _Walk:
    """The forward walk of :func:`interpret_layer`."""

    def __init__(self, topk: ir.Node, order: dict[int, int]) -> None:
        self.topk = topk
        self.order = order
        self.heap: list[tuple[int, int, ir.Node]] = []
        self.queued: set[int] = set()

    def push_users(self, value: ir.Value) -> None:
        for user, _ in value.uses():
            if id(user) not in self.queued and id(user) in self.order:
                self.queued.add(id(user))
                heapq.heappush(self.heap, (self.order[id(user)], id(user), user))


def _seed(result: Interpretation, value: ir.Value, meaning: Meaning) -> None:
    result.meanings[id(value)] = (value, meaning)


def _seed_tokens(result: Interpretation, rows: ir.Value, tokens: Dim) -> list[ir.Value]:
    """The router rows ``[T, H]`` and the ``[B, S, H]`` value they are reshaped from."""
    dims = value_dims(rows)
    if dims is None or len(dims) != 2:
        return []
    h = Factor("h", dims[1])
    _seed(result, rows, Meaning(((Factor("t", tokens),), (h,)), Tokens()))
    seeded = [rows]
    node = rows.producer()
    if node is not None and node.op_type in _TOKEN_LAYOUT and node.inputs:
        source = node.inputs[0]
        sdims = value_dims(source)
        if sdims is not None and len(sdims) == 3 and sdims[2] == dims[1]:
            if sdims[0] * sdims[1] == tokens:
                hi, lo = Factor("t.hi", sdims[0]), Factor("t.lo", sdims[1])
                _seed(result, source, Meaning(((hi,), (lo,), (h,)), Tokens()))
                seeded.append(source)
    return seeded


def interpret_layer(topk: ir.Node, order: dict[int, int], experts: int) -> Interpretation:
    """Describe the values around ``topk`` (a TopK over ``experts`` scores); see the module."""
    k_arr = small_const(topk.inputs[1]) if len(topk.inputs) > 1 else None
    k = int(k_arr.reshape(-1)[0]) if k_arr is not None and k_arr.size == 1 else 0
    rows = router_rows(topk)
    result = Interpretation(topk, rows, k, experts)
    ids, values = topk.outputs[1], topk.outputs[0]
    row_dims = value_dims(rows) if rows is not None else None
    if k <= 0 or row_dims is None or len(row_dims) != 2:
        return result
    tokens = row_dims[0]
    tj = layout.normalise(((Factor("t", tokens),), (Factor("j", Dim.of(k)),)))
    _seed(result, ids, Meaning(tj, Ids()))
    _seed(result, values, Meaning(tj, Weights(values)))
    walk = _Walk(topk, order)
    result.token_values = _seed_tokens(result, rows, tokens)
    for v in (ids, values, *result.token_values):
        walk.push_users(v)
    ctx = Context(tokens, k, experts)
    ranges = _Ranges(ctx)
    router = _router_nodes(topk, rows)  # the router itself is no departure from the layer
    departed: dict[int, DepartureAt] = {}  # node -> the departure it stems from
    furthest: tuple[int, ir.Value] | None = None  # the value furthest along the layer
    while walk.heap:
        _, _, node = heapq.heappop(walk.heap)
        if id(node) in router:
            continue
        ins = [_input_meaning(result, v, ranges) for v in node.inputs]
        try:
            outs = transfer(node, ins, ctx)
        except Departure as why:
            progress = max((m.term.progress for m in ins if m is not None), default=0)
            read = tuple(
                f"'{v.name}' = {m.text()}"
                for v, m in zip(node.inputs, ins, strict=False)
                if v is not None and m is not None
            )
            here = DepartureAt(node, str(why), progress, read)
            root = _root_departure(node, ins, departed)
            if root is not None:  # an input departed earlier: that node is where it began
                here = DepartureAt(root.node, root.reason, max(progress, root.progress), root.read)
            departed[id(node)] = here
            result.departures.append(here)
            continue
        for out, m in zip(node.outputs, outs, strict=False):
            if m is None:
                continue
            _seed(result, out, m)
            if _complete(m.term, k, experts) and _token_layout(m):
                result.output = out
                return result
            if furthest is None or m.term.progress > furthest[0]:
                furthest = (m.term.progress, out)
            walk.push_users(out)
    unfinished = _unfinished(result, furthest, k, experts)
    if unfinished is not None:
        result.departures.append(unfinished)
    return result


def _root_departure(
    node: ir.Node, ins: list[Meaning | None], departed: dict[int, DepartureAt]
) -> DepartureAt | None:
    """The departure an undescribed input of ``node`` stems from (a few producers up), if any."""
    todo = [v for v, m in zip(node.inputs, ins, strict=False) if v is not None and m is None]
    for _ in range(16):
        if not todo:
            return None
        producer = todo.pop(0).producer()
        if producer is None:
            continue
        if id(producer) in departed:
            return departed[id(producer)]
        todo.extend(v for v in producer.inputs if v is not None and not is_const(v))
    return None


def _unfinished(
    result: Interpretation, furthest: tuple[int, ir.Value] | None, k: int, experts: int
) -> DepartureAt | None:
    """A departure for the walk's furthest value when nothing consumed it into the layer."""
    if furthest is None:
        return None
    progress, value = furthest
    best = max((d.progress for d in result.departures), default=-1)
    node = value.producer()
    m = result.meaning(value)
    if node is None or m is None or progress < best:
        return None
    term = m.term
    if progress == best and not isinstance(term, ExpertSum | SlotSum):
        return None  # a departure at this stage says more
    if isinstance(term, ExpertSum):
        missing = sorted(set(range(experts)) - term.experts)
        why = (
            f"{term.text()}, but experts {missing} have no branch (a trace of a loop over only "
            "the experts its example input chose?)"
        )
    elif isinstance(term, SlotSum):
        missing = sorted(set(range(k)) - term.slots)
        why = f"{term.text()}, but slots {missing} are never added"
    elif _complete(term, k, experts):
        why = f"the whole layer laid out {m.layout()}, never laid out as the tokens"
    else:
        why = f"{term.text()}, which nothing takes further"
    return DepartureAt(node, why, progress, (f"'{value.name}' = {m.text()}",))


def _token_layout(m: Meaning) -> bool:
    """Laid out ``[tokens, features]`` (the layer output's layouts)."""
    names = [[f.var for f in a] for a in m.axes]
    return (
        len(names[-1:]) == 1
        and len(names[-1]) == 1
        and names[:-1] in ([["t"]], [["t.hi"], ["t.lo"]])
    )


def _complete(term: Term, k: int, experts: int) -> bool:
    """The whole layer: every slot summed, or every expert's loop branch added."""
    if isinstance(term, SlotSum):
        return len(term.slots) == k
    if isinstance(term, Weighted) and k == 1:  # one slot: its weighted output is the sum
        return True
    # branches of experts past E (a mask over more experts than the router has) add nothing
    return isinstance(term, ExpertSum) and term.experts >= frozenset(range(experts))


class _Ranges:
    """Row indices computed from ``Range`` nodes, described on demand (with their layout ops)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.tokens, self.k = ctx.tokens, ctx.k
        self.memo: dict[int, Meaning | None] = {}

    def describe(self, value: ir.Value, depth: int = 0) -> Meaning | None:
        if id(value) in self.memo:
            return self.memo[id(value)]
        self.memo[id(value)] = None
        node = value.producer()
        out = None
        if node is not None and depth < 12 and value.dtype in _INT_TYPES:
            if node.op_type == "Range":
                out = indexing.row_range(node, self.tokens, self.k)
            elif node.op_type in _INDEX_OPS:
                ins = [None if v is None or is_const(v) else self.describe(v, depth + 1)
                       for v in node.inputs]  # fmt: skip
                if ins and ins[0] is not None:
                    try:
                        outs = transfer(node, ins, self.ctx)
                        out = outs[value.index()] if outs else None  # type: ignore[index]
                    except Departure:
                        out = None
        self.memo[id(value)] = out
        return out


#: Index element types (None: a model without value_info, typed by the ops that read it).
_INT_TYPES = (ir.DataType.INT64, ir.DataType.INT32, None)

#: Ops that read only a value's shape: not part of the layer's data flow.
_SHAPE_READS = ("Shape", "Size")

_INDEX_OPS = ("Div", "Mod", "Mul", "Reshape", "Unsqueeze", "Squeeze", "Expand", "Tile", "Cast",
              "Flatten", "Transpose", "Identity")  # fmt: skip


def _input_meaning(
    result: Interpretation, value: ir.Value | None, ranges: _Ranges
) -> Meaning | None:
    if value is None:
        return None
    m = result.meaning(value)
    if m is None and not is_const(value) and value.dtype in _INT_TYPES:
        m = ranges.describe(value)
    return m


def transfer(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> list[Meaning | None]:
    """The meanings of ``node``'s outputs from its inputs' (``Departure`` when it has none)."""
    op = node.op_type
    if op in _SHAPE_READS:
        return [None] * len(node.outputs)
    if node.domain not in ("", "ai.onnx"):
        raise Departure(f"a {node.domain} op")
    first = ins[0] if ins else None
    if op in _LAYOUT and first is None:
        raise Departure(f"a {op} of a value this analysis does not describe")
    if op in _LAYOUT:
        return [_layout(node, first)]  # type: ignore[arg-type]
    described = [m for m in ins if m is not None]
    if op not in ("Equal", "GatherElements", "Gather", "GatherND", "ScatterND", "ScatterElements"):
        if described and all(isinstance(m.term, Weights | Routing) for m in described):
            return [arith.routing_value(node, described, ctx.k)] + [None] * (len(node.outputs) - 1)
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
    if op in arith.ELEMENTWISE:
        if all(m is None for m in ins):
            raise Departure(f"a {op} of values this analysis does not describe")
        return [arith.elementwise(node, ins, ctx.k)] + [None] * (len(node.outputs) - 1)
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
        return [indexing.nonzero(node, first)]
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
        return [weights if weights is not None else indexing.scatter(node, ins, ctx)]
    if described and all(isinstance(m.term, Weights | Routing) for m in described):
        return [arith.routing_value(node, described, ctx.k)] + [None] * (len(node.outputs) - 1)
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


def describe(term: Term) -> str:
    """A term's text (for reports)."""
    return term.text()


__all__ += ["EXPECTED", "describe", "transfer"]
_ = (Param, RowIndex, Weighted, Tokens, Ids)
