"""Tokens that chose an expert, and per-expert weights read from router scores over every expert.

makeMoE's ``SparseMoE`` (and any loop written the same way) selects expert ``e``'s tokens with
``(indices == e).any(-1)`` and weighs them by ``gating[mask, e]``, a column of a ``[T, E]``
routing value (the top-k logits scattered into ``-inf`` and softmaxed). What each step holds:

* a ReduceSum or ReduceMax over the slot axis of expert ``e``'s mask ``[idx[t, j] == e]``, or a
  Gather of the choices ``[e in idx[t, :]]`` at the constant ``e``, is :class:`~.terms.Chosen`
  ``(e)``: ``[e in idx[t, :]]``, one value per token. It is 0 or 1 because a row's TopK ids are
  distinct (a sum over ``j`` meets ``e`` at most once). A comparison or Cast of it with a
  constant is evaluated on those two values: 0 -> 0, 1 -> 1 keeps it; anything else (every
  token, no token, the tokens that did not choose ``e``) departs;
* the NonZero of ``Chosen(e)`` enumerates the tokens that chose ``e`` in token order. Token
  ``t`` chose ``e`` at exactly one slot, so these are the (token, slot) pairs ``@e`` of the mask
  ``idx == e`` in the same (row-major) order: the rows ``@e`` with index tuples of the token only;
* a ScatterElements at the ids along the last axis, a ``Where`` of the choices (or of their
  Not, ``masked_fill(logits, ~topk_mask, fill)``), or an
  element-wise map (Softmax, ...) of such a value is :class:`ExpertScores`: ``S[t, e]``, a routing
  value over every expert whose last axis is the expert ``e`` (whatever it holds elsewhere);
* a Gather of ``S`` (or of the dense weights ``c[t, e] = sum_j w[t, j] [idx[t, j] == e]``,
  which read at ``@e`` are ``w[t, j]`` themselves) at the constant column ``e`` is
  :class:`ScoreColumn` ``S[t, e]``; read at the rows ``@e`` (token ``t`` with ``idx[t, j] == e``) it is ``S[t, idx[t, j]]``: per-slot weights,
  :class:`ScoreWeights`, the same value for every expert's branch. The emitter writes them as
  ``GatherElements(S, idx, axis=-1)``, so the fused node is fed exactly the values the model
  multiplies, whatever the fill of the unselected columns (``-inf``, ``-1e4``) or the map.
  Read at another expert's rows it departs (a weight of another expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import Departure, normalise
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    Axis,
    Chosen,
    Coords,
    Counts,
    DenseWeights,
    Factor,
    Ids,
    Mask,
    Meaning,
    Routing,
    RowIndex,
    Term,
    Weights,
    filtered_expert,
    filtered_var,
    is_row_var,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import (
    is_const,
    is_zeros,
    small_const,
    value_dims,
)
from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import attr_int, node_axes, normalize_axes

__all__ = [
    "ExpertScores",
    "ScoreColumn",
    "ScoreWeights",
    "Unchosen",
    "chosen_transfer",
    "read_at_rows",
    "token_vars",
]

#: Comparisons and maps of a 0/1 value evaluated on its two values.
_COMPARE = {
    "Greater": np.greater,
    "GreaterOrEqual": np.greater_equal,
    "Less": np.less,
    "LessOrEqual": np.less_equal,
    "Equal": np.equal,
}
#: Maps of scores over every expert that keep them a value of the router per (token, expert).
_SCORE_MAPS = (
    "Softmax", "LogSoftmax", "Exp", "Sigmoid", "Cast", "Identity", "Add", "Sub", "Mul", "Div",
    "Neg", "Relu", "Max", "Min", "Clip", "Tanh", "Softplus",
)  # fmt: skip


@dataclass(frozen=True, eq=False)
class ExpertScores(Term):
    """``S[t, e]``: a routing value over every expert (``source``, laid out as the ids' tokens)."""

    source: ir.Value

    progress = 1

    def text(self) -> str:
        """``S[t, e]``."""
        return f"router values S[t, e] over every expert ('{self.source.name}')"


@dataclass(frozen=True, eq=False)
class ScoreColumn(Term):
    """``S[t, expert]``: one expert's column of scores ``of`` over every expert.

    ``weights``: what the column holds at the rows ``@expert``, per (token, slot) pair.
    """

    of: Term
    expert: int
    weights: Weights

    progress = 1

    def text(self) -> str:
        """``S[t, e]`` at a constant ``e``."""
        return f"column {self.expert} of {self.of.text()}"


@dataclass(frozen=True, eq=False)
class ScoreWeights(Weights):
    """``w[t, j] = S[t, idx[t, j]]`` (``source`` is ``S``): each pair's weight read from ``S``."""

    def text(self) -> str:
        """The weights read at the ids."""
        return f"the routing weights S[t, idx[t, j]] ('{self.source.name}')"


@dataclass(frozen=True)
class Unchosen(Term):
    """``[e not in idx[t, :]]`` over an ``e`` axis: the Not of the choices (``~topk_mask``)."""

    progress = 1

    def text(self) -> str:
        """The negated choices."""
        return "the 0/1 non-choices [e not in idx[t, :]]"


def token_vars(axes: tuple[Axis, ...]) -> list[str] | None:
    """The vars of a layout of the tokens alone (``t``, or ``t.hi, t.lo``), else None."""
    names = [f.var for a in axes for f in a]
    return names if names in (["t"], ["t.hi", "t.lo"]) else None


def chosen_transfer(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> list | None:
    """The output's meaning where ``node`` is one of the module's steps (else None)."""
    op = node.op_type
    described = [m for m in ins if m is not None]
    first = ins[0] if ins else None
    if not described:
        return None
    if op == "NonZero" and first is not None and isinstance(first.term, Chosen):
        return [_chosen_rows(first)] if first.term.expert is not None else None
    if op == "Slice" and first is not None and isinstance(first.term, RowIndex):
        experts = sorted({filtered_expert(f.var) for f in first.factors()} - {None})  # type: ignore[type-var]
        if experts:  # any other Slice of a row index departs too (it is no FC1 column pick)
            raise Departure(
                f"a Slice of the rows that chose expert {experts[0]} ({first.term.text()}): a cut "
                "of an expert's rows, such as a capacity limit, drops the rows past it"
            )
    if op in ("ReduceSum", "ReduceMax") and first is not None:
        found = _any_slot(node, first, ctx) or _chosen_count(node, first)
        return None if found is None else [found]
    if op == "Not" and first is not None and isinstance(first.term, Chosen | Unchosen):
        if isinstance(first.term, Unchosen):
            return [Meaning(first.axes, Chosen())]
        if first.term.expert is None:
            return [Meaning(first.axes, Unchosen())]
    if first is not None and isinstance(first.term, Chosen) and first.term.expert is not None:
        if op in _COMPARE or op in ("Cast", "Not"):
            return [_compared(node, first)]
    if op == "Gather" and first is not None:
        found = _column(node, first)
        return None if found is None else [found]
    if op == "ScatterElements" and len(ins) >= 3:
        found = _scattered_scores(node, ins, ctx)
        return None if found is None else [found]
    if op == "Where" and len(ins) == 3:
        found = _masked_scores(node, ins, ctx)
        return None if found is None else [found]
    if op in _SCORE_MAPS and any(isinstance(m.term, ExpertScores) for m in described):
        return [_score_map(node, ins, ctx)]
    return None


def read_at_rows(out: Meaning) -> Meaning:
    """A gathered :class:`ScoreColumn` at rows ``@e``: that expert's per-slot weights."""
    term = out.term
    if not isinstance(term, ScoreColumn):
        return out
    experts = {filtered_expert(f.var) for f in out.factors()} - {None}
    if not experts:
        return out
    if experts != {term.expert}:
        rows = ", ".join(str(e) for e in sorted(experts))  # type: ignore[arg-type]
        raise Departure(
            f"a read of {term.text()} at the rows of expert {rows} (the weight of another "
            "expert than the one that chose the rows)"
        )
    return Meaning(out.axes, term.weights)


def _chosen_rows(mask: Meaning) -> Meaning:
    """``NonZero`` of ``Chosen(e)``: the rows ``@e``, each with its token's index tuple."""
    term = mask.term
    assert isinstance(term, Chosen) and term.expert is not None
    names = [[f.var for f in a] for a in mask.axes]
    if names not in ([["t"]], [["t.hi"], ["t.lo"]]):
        raise Departure(f"a NonZero of {term.text()} laid out {mask.layout()}")
    rows = Factor(filtered_var(term.expert), Dim.sym(f"R{term.expert}"))
    order = tuple(n[0] for n in names)
    if order == ("t",):  # one coordinate: the token's row index itself
        return Meaning(((), (rows,)), RowIndex((("t", 1),)))
    return Meaning(((Factor("c", Dim.of(len(order))),), (rows,)), Coords(order))


def _any_slot(node: ir.Node, m: Meaning, ctx: Context) -> Meaning | None:
    """``ReduceSum``/``ReduceMax`` of expert ``e``'s mask over the slot axis: ``Chosen(e)``."""
    if not isinstance(m.term, Mask) or m.term.expert is None or ctx.k == 1:
        return None
    rank = len(m.axes)
    axes = node_axes(node, 1)
    axes = normalize_axes(axes, rank) if axes else None
    if axes is None or len(axes) != 1 or [f.var for f in m.axes[axes[0]]] != ["j"]:
        return None
    keep = attr_int(node, "keepdims", 1)
    out = tuple(() if i == axes[0] else a for i, a in enumerate(m.axes) if keep or i != axes[0])
    if token_vars(out) is None:
        return None
    return Meaning(out, Chosen(m.term.expert))


def _chosen_count(node: ir.Node, m: Meaning) -> Meaning | None:
    """``ReduceSum`` of ``Chosen(e)`` over every token: the count of expert ``e``'s rows."""
    term = m.term
    if node.op_type != "ReduceSum" or not isinstance(term, Chosen) or term.expert is None:
        return None
    axes = node_axes(node, 1)
    rank = len(m.axes)
    if axes is None or (axes and sorted(a % rank for a in axes) != list(range(rank))):
        return None
    if not axes and attr_int(node, "noop_with_empty_axes", 0):
        return None
    return Meaning(((),), Counts((term.expert,)))


def _compared(node: ir.Node, m: Meaning) -> Meaning:
    """A comparison, Not or Cast of ``Chosen(e)``, evaluated on its two values 0 and 1."""
    term = m.term
    assert isinstance(term, Chosen)
    two = np.array([0.0, 1.0])
    op = node.op_type
    if op == "Cast":
        return m  # 0 and 1 in any type are 0 and 1
    if op == "Not":
        got = np.logical_not(two)
    else:
        at = 1 if node.inputs[0] is not None and is_const(node.inputs[0]) else 0  # the choices'
        other = node.inputs[1 - at] if len(node.inputs) == 2 else None
        c = small_const(other) if other is not None else None
        if c is None or c.size != 1:
            raise Departure(
                f"a {op} of the tokens that chose expert {term.expert} with other than a constant"
            )
        value = float(c.reshape(-1)[0])
        got = _COMPARE[op](two, value) if at == 0 else _COMPARE[op](value, two)
    table = [int(bool(x)) for x in got]
    if table == [0, 1]:
        return Meaning(m.axes, term)
    what = {(1, 0): "the tokens that did not choose", (1, 1): "every token, whether it chose",
            (0, 0): "no token, whatever it chose"}[tuple(table)]  # type: ignore[index]  # fmt: skip
    raise Departure(
        f"{'an' if op[0] in 'AEIOU' else 'a'} {op} of [{term.expert} in idx[t, :]] that selects "
        f"{what} expert {term.expert}"
    )


def _column(node: ir.Node, m: Meaning) -> Meaning | None:
    """A Gather at a constant expert along the ``e`` axis: ``Chosen(e)``, or a score column."""
    term = m.term
    if isinstance(term, DenseWeights) and not term.summed:
        return None
    if not isinstance(term, Chosen | ExpertScores | DenseWeights) or (
        isinstance(term, Chosen) and term.expert is not None
    ):
        return None
    picked = small_const(node.inputs[1]) if len(node.inputs) > 1 else None
    axis = attr_int(node, "axis", 0) or 0
    axis = axis + len(m.axes) if axis < 0 else axis
    if picked is None or picked.dtype.kind not in "iu":
        return None
    if not 0 <= axis < len(m.axes) or [f.var for f in m.axes[axis]] != ["e"]:
        raise Departure(f"a Gather of {term.text()} along other than the expert axis")
    if picked.ndim != 0:
        raise Departure(f"a Gather of {term.text()} at several experts at once")
    e = int(picked)
    experts = m.axes[axis][0].size
    if experts.syms or not 0 <= e < experts.coef:
        raise Departure(f"a Gather of {term.text()} at {e}, not an expert")
    axes = (*m.axes[:axis], *m.axes[axis + 1 :])
    if isinstance(term, Chosen):
        return Meaning(axes, Chosen(e))
    if isinstance(term, DenseWeights):  # sum_j w[t, j] [idx[t, j] == e]: w itself at @e
        return Meaning(axes, ScoreColumn(term, e, term.weights))
    return Meaning(axes, ScoreColumn(term, e, ScoreWeights(term.source)))


def _scores(node: ir.Node, token_axes: tuple[Axis, ...], ctx: Context) -> Meaning:
    """``node``'s output as :class:`ExpertScores` laid out ``[token axes..., e]``."""
    if token_vars(token_axes) is None:
        raise Departure(f"a {node.op_type} of router values over other than the token rows")
    dims = value_dims(node.outputs[0])
    if dims is None or not dims or dims[-1] != Dim.of(ctx.experts):
        raise Departure(f"a {node.op_type} of router values whose last axis is not the experts")
    return Meaning(
        normalise((*token_axes, (Factor("e", dims[-1]),))), ExpertScores(node.outputs[0])
    )


def _router_or_const(v: ir.Value | None, ctx: Context) -> bool:
    return v is None or is_const(v) or id(v) in ctx.router or _is_fill(v)


def _is_fill(v: ir.Value) -> bool:
    """A constant broadcast to a shape (``full_like``: Expand or ConstantOfShape of a scalar)."""
    node = v.producer()
    if node is None:
        return False
    if node.op_type == "ConstantOfShape":
        return True
    return node.op_type == "Expand" and is_const(node.inputs[0])


def _scattered_scores(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> Meaning | None:
    """``ScatterElements(fill or scores [T, E], ids, routing values, axis=-1)``: scores."""
    data, index, updates = ins[:3]
    if index is None or not isinstance(index.term, Ids) or updates is None:
        return None
    if not isinstance(updates.term, Weights | Routing) or data is not None:
        return None
    if not _router_or_const(node.inputs[0], ctx) or is_zeros(node.inputs[0]):
        return None  # into zeros: the dense weights (:mod:`.dense`)
    if attr_int(node, "axis", 0) not in (-1, len(index.axes) - 1) or index.axes != updates.axes:
        raise Departure("a ScatterElements of router values along other than the expert axis")
    return _scores(node, index.axes[:-1], ctx)


def _masked_scores(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> Meaning | None:
    """``Where(chosen [T, E], router values, fill)`` (``masked_fill``): scores."""
    cond = ins[0]
    if cond is None or not isinstance(cond.term, Chosen | Unchosen):
        return None
    if isinstance(cond.term, Chosen) and cond.term.expert is not None:
        return None
    if any(m is not None for m in ins[1:]):
        return None
    if not all(_router_or_const(v, ctx) for v in node.inputs[1:]):
        return None
    return _scores(node, cond.axes[:-1], ctx)


def _score_map(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> Meaning:
    """An element-wise map (or Softmax) of scores with constants: scores again."""
    scores = [m for m in ins if m is not None]
    if len(scores) != 1:
        raise Departure(f"a {node.op_type} of router scores with other described values")
    for v, m in zip(node.inputs, ins, strict=False):
        if m is None and not _router_or_const(v, ctx):
            raise Departure(f"a {node.op_type} of router scores and '{v.name}'")
    m = scores[0]
    if (
        not m.axes
        or [f.var for f in m.axes[-1]] != ["e"]
        or not all(all(is_row_var(f.var) for f in a) for a in m.axes[:-1])
    ):
        raise Departure(f"a {node.op_type} of router scores laid out {m.layout()}")
    return _scores(node, m.axes[:-1], ctx)
