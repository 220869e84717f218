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
    indexing,
    layout,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import Departure
from onnx_moe_fuse.rewrites.canonical.experts.meaning.sorted_combine import PlusBase
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    ExpertSum,
    Factor,
    Ids,
    Meaning,
    SlotSum,
    Term,
    Tokens,
    Weighted,
    Weights,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.transfer import transfer
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import (
    const_shape,
    is_const,
    small_const,
    value_dims,
)
from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import label

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
    if isinstance(term, PlusBase):  # the layer scatter-added into a base: the layer, plus it
        term = term.inner
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


def describe(term: Term) -> str:
    """A term's text (for reports)."""
    return term.text()


__all__ += ["EXPECTED", "describe"]
