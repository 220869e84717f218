"""A value of the tokens added inside the weighted combine: ``sum_j w (FC2 + S[t])``.

mistral-inference's ``MoeLayer`` loop, written with a shared expert inside the weighted sum,
computes per expert ``results[t_e] += w[t_e, j_e] * (expert_e(x[t_e]) + S[t_e])`` with ``S``
``[T, O]`` computed before the loop (the shared expert of the same tokens). Summed over every
(token, slot) pair that is::

    out[t] = sum_j w[t, j] * FC2_{idx[t, j]}(...)[t]  +  (sum_j w[t, j]) * S[t]

the layer's contract plus a separate term: the fused node computes the first, and the second
is written after it from the model's own ``S`` and weights (:func:`shared_value` gives the
contract ``S``). Read here:

* ``Gather`` / ``GatherND`` of a ``[T, O]`` value this analysis does not describe (nor a
  constant), at an index holding each row's own token (the gather's rule proves that): the
  rows ``S[t(r)]``, a :class:`SharedRows`. ``S`` must not be computed from the TopK's outputs
  (then it would be part of the layer the rewrite removes);
* ``Add(FC2, S rows)`` over the same rows: :class:`PlusShared`; the weights times it, or
  ``w * FC2 + w * S rows``: :class:`WeightedPlus`, the weighted outputs with ``S`` beside them,
  which the combine's sums (scatters, slot sums) carry as weighted outputs.

Exact in real arithmetic; the sums are grouped differently (rounding only).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning import indexing
from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import (
    Departure,
    broadcast_axes,
    normalise,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    Factor,
    Meaning,
    Proj,
    RowIndex,
    Term,
    Weighted,
    Weights,
    axis_size,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import (
    is_const,
    is_zeros,
    value_dims,
)

__all__ = [
    "PlusShared",
    "SharedRows",
    "WeightedPlus",
    "routing_nodes",
    "shared_transfer",
    "shared_value",
]

#: The most nodes a router may have between its token rows and the weights.
_ROUTER_NODES = 64


def routing_nodes(weights: ir.Value, rows: ir.Value) -> list[ir.Node]:
    """The nodes computing ``weights`` from ``rows`` and constants, inputs before users.

    Raises :class:`Departure` where ``weights`` reads another value (a graph input, a value
    of another path) or the router has more than :data:`_ROUTER_NODES` nodes.
    """
    ordered: list[ir.Node] = []
    state: dict[int, bool] = {}  # node -> finished (False while its inputs are walked)
    stack: list[tuple[ir.Node, bool]] = []

    def visit(v: ir.Value | None) -> None:
        if v is None or v is rows or is_const(v):
            return
        node = v.producer()
        if node is None:
            raise Departure(f"routing weights computed from '{v.name}', not the router's rows")
        if id(node) not in state:
            stack.append((node, False))

    visit(weights)
    while stack:
        node, expanded = stack.pop()
        if expanded:
            state[id(node)] = True
            ordered.append(node)
            continue
        if id(node) in state:
            continue
        state[id(node)] = False
        if len(state) > _ROUTER_NODES:
            raise Departure("routing weights behind more nodes than a router has")
        stack.append((node, True))
        for v in node.inputs:
            visit(v)
    return ordered


#: How many producers up :func:`_reads_selection` looks before giving up (refusing).
_ANCESTORS = 400


@dataclass(frozen=True, eq=False)
class SharedRows(Term):
    """``S[t, o]``: rows of a ``[T, O]`` value the layer adds (laid out as it is read)."""

    value: ir.Value

    def text(self) -> str:
        """The shared rows."""
        return f"the rows of '{self.value.name}', a [T, O] value of the tokens"


@dataclass(frozen=True, eq=False)
class PlusShared(Term):
    """``FC2[r, o] + S[t(r), o]``: an expert's outputs plus the shared rows of its tokens."""

    proj: Proj
    value: ir.Value

    progress = 4

    def text(self) -> str:
        """FC2 plus the shared rows."""
        return f"FC2's outputs plus the rows of '{self.value.name}'"


@dataclass(frozen=True, eq=False)
class WeightedShared(Term):
    """``w[r] * S[t(r), o]``: the shared rows weighted (the other half of ``w*FC2 + w*S``)."""

    weights: Weights
    value: ir.Value

    progress = 4

    def text(self) -> str:
        """The weighted shared rows."""
        return f"w[t, j] times the rows of '{self.value.name}'"


@dataclass(frozen=True, eq=False)
class WeightedPlus(Weighted):
    """``w[t, j] * (FC2[t, j, o] + S[t, o])``: weighted outputs with the shared term beside."""

    shared: ir.Value | None = None

    def text(self) -> str:
        """The weighted outputs plus the shared rows."""
        name = self.shared.name if self.shared is not None else None
        return f"w[t, j] * (FC2[t, j, o] + '{name}'[t, o]), per slot"


def shared_value(weighted: list[Weighted]) -> ir.Value | None:
    """The ``S`` every branch of the layer adds (None: none adds one); else a Departure."""
    values = {id(getattr(w, "shared", None)): getattr(w, "shared", None) for w in weighted}
    if len(values) != 1:
        raise Departure(
            "experts' weighted outputs that add different values of the tokens (or only some "
            "experts add one): not one routed sum plus one separate term"
        )
    return next(iter(values.values()))


def shared_transfer(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> list | None:
    """The outputs' meanings where ``node`` reads or builds the terms above (else None)."""
    op = node.op_type
    if op in ("Gather", "GatherND") and len(ins) > 1 and ins[0] is None:
        rows = _shared_data(node.inputs[0], ins[1], ctx)
        if rows is None:
            return None
        if op == "Gather":
            return [indexing.gather(node, rows, ins[1], ctx)]
        return [indexing.gather_nd(node, rows, ins[1], ctx)]
    if len(ins) != 2 or any(m is None for m in ins):
        return None
    a, b = ins  # type: ignore[misc]
    kinds = {type(a.term), type(b.term)}
    if op == "Add" and SharedRows in kinds and any(_fc2(m.term) for m in (a, b)):
        return [_plus_shared(a, b)]
    if op == "Mul" and any(isinstance(m.term, Weights) for m in (a, b)):
        other = b if isinstance(a.term, Weights) else a
        w = a if other is b else b
        if isinstance(other.term, PlusShared):
            axes = normalise(broadcast_axes(w.axes, other.axes))
            if axes != normalise(other.axes):
                raise Departure("the weights times FC2 plus the shared rows over other rows")
            p = other.term
            return [Meaning(axes, WeightedPlus(w.term, p.proj, shared=p.value))]  # type: ignore[arg-type]
        if isinstance(other.term, SharedRows):
            axes = normalise(broadcast_axes(w.axes, other.axes))
            if axes != normalise(other.axes):
                raise Departure("the weights times the shared rows over other rows")
            return [Meaning(axes, WeightedShared(w.term, other.term.value))]  # type: ignore[arg-type]
    if op == "Add" and WeightedShared in kinds:
        return [_weighted_plus(a, b)]
    return None


def _fc2(term: Term) -> bool:
    return isinstance(term, Proj) and term.stage == 2


def _same_rows(a: Meaning, b: Meaning, what: str) -> tuple:
    """``a``'s layout, where ``b`` holds the same rows and as many features."""
    if not a.axes or not b.axes or axis_size(a.axes[-1]) != axis_size(b.axes[-1]):
        raise Departure(f"{what} of other widths")
    if any(f.var == "e" for ax in a.axes for f in ax):
        raise Departure(f"{what} of every expert (a dense form)")
    axes = normalise(broadcast_axes(a.axes, (*b.axes[:-1], a.axes[-1])))
    if axes != normalise(a.axes):
        raise Departure(f"{what} over other rows")
    return axes


def _plus_shared(a: Meaning, b: Meaning) -> Meaning:
    y, s = (a, b) if _fc2(a.term) else (b, a)
    axes = _same_rows(y, s, "FC2's outputs plus the rows of a value of the tokens")
    return Meaning(axes, PlusShared(y.term, s.term.value))  # type: ignore[arg-type,attr-defined]


def _weighted_plus(a: Meaning, b: Meaning) -> Meaning:
    ws, y = (a, b) if isinstance(a.term, WeightedShared) else (b, a)
    if type(y.term) is not Weighted or y.term.dense:
        raise Departure(f"the weighted shared rows added to {y.term.text()}")
    if y.term.weights is not ws.term.weights:  # type: ignore[attr-defined]
        raise Departure("the shared rows and FC2's outputs weighted by different weights")
    axes = _same_rows(y, ws, "the weighted outputs plus the weighted shared rows")
    return Meaning(axes, WeightedPlus(y.term.weights, y.term.expert, shared=ws.term.value))  # type: ignore[attr-defined]


def _shared_data(value: ir.Value | None, index: Meaning | None, ctx: Context) -> Meaning | None:
    """``value`` as ``S[t, o]`` where it may be the layer's shared term, else None."""
    if value is None or index is None or not isinstance(index.term, RowIndex):
        return None
    if is_const(value) or is_zeros(value):
        return None
    dims = value_dims(value)
    if dims is None or len(dims) != 2 or dims[0] != ctx.tokens:
        return None
    if _reads_selection(value, ctx):
        return None
    axes = ((Factor("t", ctx.tokens),), (Factor(f"{value.name}#o", dims[1]),))
    return Meaning(normalise(axes), SharedRows(value))


def _reads_selection(value: ir.Value, ctx: Context) -> bool:
    """Whether ``value`` may be computed from the layer's TopK (True when not proved apart).

    The graph is in topological order: a node placed before the TopK cannot read it, so the
    walk up stops there (and stays within the layer, whatever came before it in the model).
    """
    if ctx.topk_at < 0:
        return True
    todo, seen = [value], set()
    while todo:
        node = todo.pop().producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        at = ctx.order.get(id(node))
        if at is None or at == ctx.topk_at or len(seen) > _ANCESTORS:
            return True
        if at > ctx.topk_at:
            todo.extend(i for i in node.inputs if i is not None)
    return False
