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
    index_arith,
    indexing,
    layout,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import ONE, Departure
from onnx_moe_fuse.rewrites.canonical.experts.meaning.rounds import round_weights
from onnx_moe_fuse.rewrites.canonical.experts.meaning.router_path import router_path
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
    axis_size,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.transfer import transfer
from onnx_moe_fuse.rewrites.canonical.experts.meaning.undescribed import decisive_operand
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import (
    is_const,
    small_const,
    value_dims,
)
from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import label

__all__ = [
    "TOKEN_LAYOUTS",
    "DepartureAt",
    "Interpretation",
    "interpret_layer",
    "router_rows",
    "twins",
]

#: What the layer needs next after a value of each progress (the near miss's "expected").
EXPECTED = {
    -1: (
        "a top-k selection of experts: a TopK along the router scores' last axis, or in rounds, "
        "round j the top-1 of the router logits with the experts of rounds 0..j-1 scattered to "
        "-inf (column j of TopK(logits, k))"
    ),
    0: "the tokens gathered per slot, projected by each slot's expert (FC1)",
    1: "the tokens projected by the expert weights gathered at the ids (FC1)",
    2: "an elementwise activation of FC1's outputs, then FC2 by the same ids",
    3: "the activations projected by each slot's expert (FC2)",
    4: "FC2's outputs times the routing weights w[t, j]",
    5: "the weighted outputs summed over the slots j per token",
    6: "the rest of the slots added",
}

#: The token axes a layer's output may have: ``[T]``, or ``[B, S]`` (a unit B or S is no index).
TOKEN_LAYOUTS = ([["t"]], [["t.hi"], ["t.lo"]], [["t"], []], [[], ["t"]])

_TOKEN_LAYOUT = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")


@dataclass(frozen=True)
class DepartureAt:
    """A node that could not be described: what it read and why."""

    node: ir.Node
    reason: str
    progress: int
    read: tuple[str, ...]
    #: the part, where an operand the walk never reached decides it (:mod:`.undescribed`)
    part: str | None = None

    @property
    def expected(self) -> str:
        """What the layer needed at this point."""
        if self.part == "routing":  # the router read other rows than the experts
            return "the experts projecting the token rows the router projects"
        if self.part == "weights":
            return "constant expert weights (initializers, or a DequantizeLinear of them)"
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
        """The departure furthest along the layer (the earliest among equals).

        A decisive one (its part named: the router reads other rows than the experts, the
        weights are not constant) comes first: no later node can make that layer the op's.
        """
        if not self.departures:
            return None
        decisive = [d for d in self.departures if d.part is not None]
        if decisive:
            return decisive[0]
        best = max(d.progress for d in self.departures)
        return next(d for d in self.departures if d.progress == best)


def router_rows(topk: ir.Node) -> ir.Value | None:
    """The token rows the router projects: ``MatMul(rows, W)`` / ``Gemm`` behind the scores."""
    found = router_path(topk)
    return found[0] if found is not None else None


def _router_nodes(topk: ir.Node) -> set[int]:
    """The nodes from the router rows to the TopK's scores (the projection, maps and masks)."""
    found = router_path(topk)
    return {id(n) for n in found[1]} if found is not None else set()


def _router_values(topk: ir.Node) -> frozenset[int]:
    """The values the router computes from its projection to the TopK's scores."""
    found = router_path(topk)
    return (
        frozenset(id(o) for n in found[1] for o in n.outputs) if found is not None else frozenset()
    )


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


def _token_axes(row_dims: list[Dim]) -> tuple[tuple[Factor, ...], ...]:
    """The token axes of router rows: ``t`` of ``[T, H]``, or ``t.hi, t.lo`` of ``[B, S, H]``.

    ``t = b * S + s``, row-major, as a Reshape to ``[T, H]`` flattens them.
    """
    if len(row_dims) == 2:
        return ((Factor("t", row_dims[0]),),)
    return _split_tokens(row_dims, row_dims[0] * row_dims[1])


def _seed_tokens(result: Interpretation, rows: ir.Value, tokens: Dim) -> list[ir.Value]:
    """The router rows, and the ``[B, S, H]`` value that ``[T, H]`` rows are reshaped from."""
    dims = value_dims(rows)
    if dims is None or len(dims) not in (2, 3):
        return []
    h = Factor("h", dims[-1])
    _seed(result, rows, Meaning((*_token_axes(dims), (h,)), Tokens()))
    seeded = [rows]
    if len(dims) == 3:
        return seeded
    node = rows.producer()
    if node is not None and node.op_type in _TOKEN_LAYOUT and node.inputs:
        source = node.inputs[0]
        sdims = value_dims(source)
        if sdims is not None and len(sdims) == 3 and sdims[2] == dims[1]:
            if sdims[0] * sdims[1] == tokens:
                _seed(result, source, Meaning((*_split_tokens(sdims, tokens), (h,)), Tokens()))
                seeded.append(source)
    return seeded


def twins(topk: ir.Node) -> list[ir.Node]:
    """Other TopKs of the same scores with the same k and attributes: the same outputs.

    A Switch-style router takes the expert from an ArgMax and its weight from a ReduceMax of
    the same probabilities, which the spelling pass writes as two TopK(1): one op on one input,
    so element for element the same ids and values.
    """
    scores = topk.inputs[0]
    k = small_const(topk.inputs[1]) if len(topk.inputs) > 1 else None
    if scores is None or k is None:
        return []
    attrs = {name: a.value for name, a in topk.attributes.items()}
    twins = []
    for user, _ in scores.uses():
        if user is topk or user.op_type != "TopK" or user.domain not in ("", "ai.onnx"):
            continue
        if len(user.inputs) < 2 or user.inputs[0] is not scores or len(user.outputs) < 2:
            continue
        other_k = small_const(user.inputs[1])
        user_attrs = {name: a.value for name, a in user.attributes.items()}
        if other_k is not None and other_k.tolist() == k.tolist() and user_attrs == attrs:
            twins.append(user)
    return twins


def _split_tokens(sdims: list[Dim], tokens: Dim) -> tuple[tuple[Factor, ...], ...]:
    """The ``[B, S]`` axes of ``T = B * S`` tokens: ``t.hi, t.lo``, or ``t`` beside a unit axis.

    A unit batch (or sequence) is no index at all, so the other axis is ``t`` itself: a
    Reshape to ``[T, H]`` then reads ``t``, not a lone half that never merges back.
    """
    if sdims[1] == ONE:
        return ((Factor("t", tokens),), ())
    if sdims[0] == ONE:
        return ((), (Factor("t", tokens),))
    return ((Factor("t.hi", sdims[0]),), (Factor("t.lo", sdims[1]),))


def interpret_layer(topk: ir.Node, order: dict[int, int], experts: int) -> Interpretation:
    """Describe the values around ``topk`` (a TopK over ``experts`` scores); see the module."""
    k_arr = small_const(topk.inputs[1]) if len(topk.inputs) > 1 else None
    k = int(k_arr.reshape(-1)[0]) if k_arr is not None and k_arr.size == 1 else 0
    rows = router_rows(topk)
    result = Interpretation(topk, rows, k, experts)
    ids, values = topk.outputs[1], topk.outputs[0]
    row_dims = value_dims(rows) if rows is not None else None
    if k <= 0 or row_dims is None or len(row_dims) not in (2, 3):
        return result
    token_axes = _token_axes(row_dims)
    tokens = axis_size(tuple(f for a in token_axes for f in a))
    tj = layout.normalise((*token_axes, (Factor("j", Dim.of(k)),)))
    _seed(result, ids, Meaning(tj, Ids()))
    _seed(result, values, Meaning(tj, Weights(values)))
    rounds = round_weights(topk, k)  # a selection in top-1 rounds: its weights, per slot
    for w in rounds:
        _seed(result, w, Meaning(tj, Weights(w)))
    walk = _Walk(topk, order)
    result.token_values = _seed_tokens(result, rows, tokens)
    for v in (ids, values, *rounds, *result.token_values):
        walk.push_users(v)
    for twin in twins(topk):  # the same selection computed twice (ArgMax and ReduceMax)
        _seed(result, twin.outputs[1], Meaning(tj, Ids()))
        _seed(result, twin.outputs[0], Meaning(tj, Weights(twin.outputs[0])))
        walk.push_users(twin.outputs[0])
        walk.push_users(twin.outputs[1])
    router = _router_nodes(topk)  # the router itself is no departure from the layer
    ctx = Context(
        tokens,
        k,
        experts,
        router=_router_values(topk),
        order=order,
        topk_at=order.get(id(topk), -1),
        token_axes=token_axes,
        meanings=result.meanings,
        slots=tuple(tuple(f.var for f in a) for a in tj),
    )
    ranges = _Ranges(ctx)
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
            decisive = decisive_operand(node, ins, rows) if root is None else None
            if decisive is not None:  # an operand the walk never reached says why
                here = DepartureAt(node, decisive.reason, progress, read, decisive.part)
            if root is not None:  # an input departed earlier: that node is where it began
                here = DepartureAt(
                    root.node, root.reason, max(progress, root.progress), root.read, root.part
                )
            departed[id(node)] = here
            result.departures.append(here)
            continue
        for out, m in zip(node.outputs, outs, strict=False):
            if m is None:
                continue
            _seed(result, out, m)
            if _complete(m.term, k, experts) and _token_layout(m, result):
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


def _token_layout(m: Meaning, result: Interpretation) -> bool:
    """Laid out ``[tokens, features]``: ``[T, O]``, or ``[B, S, O]`` as the model's tokens are."""
    names = [[f.var for f in a] for a in m.axes]
    if len(names[-1:]) != 1 or len(names[-1]) != 1:
        return False
    if names[:-1] in (TOKEN_LAYOUTS[0], TOKEN_LAYOUTS[1]):
        return True
    if result.tokens is not None and value_dims(result.tokens) is not None:
        if value_dims(result.tokens)[0] == ONE and names[:-1] == [[]]:
            return True  # one token (static): its index is no factor
    # a unit batch or sequence axis only where the model's own tokens have it
    return names[:-1] in TOKEN_LAYOUTS and any(
        (mv := result.meaning(v)) is not None
        and [[f.var for f in a] for a in mv.axes][:2] == names[:2]
        for v in result.token_values
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
                if ins and ins[0] is None and node.op_type in _LAYOUT_OPS:
                    ins[0] = self.constant(node.inputs[0])
                if ins and ins[0] is not None:
                    try:
                        outs = transfer(node, ins, self.ctx)
                        out = outs[value.index()] if outs else None  # type: ignore[index]
                    except Departure:
                        out = None
        self.memo[id(value)] = out
        return out

    def constant(self, value: ir.Value | None) -> Meaning | None:
        """A constant row index (``[R]`` or ``[R, 1]``), as constant folding leaves one."""
        c = small_const(value) if value is not None and is_const(value) else None
        if c is None or c.ndim not in (1, 2) or (c.ndim == 2 and c.shape[1] != 1):
            return None
        rows = index_arith.constant_rows(c.reshape(-1), self.tokens, self.k)
        if rows is None or c.ndim == 1:
            return rows
        return Meaning((*rows.axes, ()), rows.term)


#: Index element types (None: a model without value_info, typed by the ops that read it).
_INT_TYPES = (ir.DataType.INT64, ir.DataType.INT32, None)


#: The index ops that move a (constant) row index without computing on it.
_LAYOUT_OPS = ("Reshape", "Unsqueeze", "Squeeze", "Expand", "Tile", "Flatten", "Transpose",
               "Identity")  # fmt: skip

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
