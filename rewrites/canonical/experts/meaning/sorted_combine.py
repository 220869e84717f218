"""The sorted forms' remaining ops: rows by GatherElements, scaled weights and tokens, a base.

torchtitan's and torchtune's ``MoE`` and Megablocks' ``dMoE`` sort the (token, slot) rows by
expert, as :mod:`.sorted_rows` reads, and around that:

* gather the token rows with ``GatherElements(x [T, H], Expand(t(s)[:, None], [R, H]), 0)``:
  at an index holding each row's token, repeated over the features, that is the rows ``x[t(s)]``
  (:func:`gather_rows`);
* scale the weights gathered at the sorted rows by a constant (``route_scale``):
  :class:`ScaledWeights`, the model's ``[T, k]`` weights with the same scalar ops replayed on
  them by the emitter (the same ops on the same values);
* torchtune's ``scale_before_experts``: the sorted token rows times their own weight, at
  ``k = 1``: :class:`ScaledTokens` ``X[t, h] * w[t, 0]``; the layer is then the per-slot
  layer over the scaled tokens with the weight 1 (``Softmax`` of the TopK's one value), as
  Llama 4's dense form is. At ``k > 1`` a token enters k experts at k scales, which one input
  row per token cannot carry: a departure, naming the product;
* scatter-add the weighted rows into the shared expert's output instead of zeros:
  ``ScatterElements(base, t, y, add) = base + ScatterElements(zeros, t, y, add)``, the layer
  plus the base (:class:`PlusBase`; the emitter adds the base after the per-slot form). The sums
  are grouped differently (``(b + y1) + y2`` against ``b + (y1 + y2)``): equal up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning import id_tables, indexing, scatters
from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import Departure, broadcast_axes
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    Act,
    ExpertSum,
    Factor,
    Meaning,
    Proj,
    RowIndex,
    SlotSum,
    Term,
    Tokens,
    Weighted,
    Weights,
    axis_size,
    is_repeat,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import (
    is_zeros,
    small_const,
    value_dims,
)
from onnx_moe_fuse.rewrites.graph.facts import attr_int, attr_str

__all__ = [
    "PlusBase",
    "ScaledTokens",
    "ScaledWeights",
    "UnitWeights",
    "extra_transfer",
    "prescale_of",
]


@dataclass(frozen=True, eq=False)
class ScaledWeights(Weights):
    """``source``'s weights with ``post`` applied: ``(node, input index of the weights)``."""

    post: tuple[tuple[ir.Node, int], ...] = ()

    def text(self) -> str:
        """The scaled weights."""
        ops = ", ".join(n.op_type for n, _ in self.post)
        return f"the routing weights w[t, j] ('{self.source.name}') through {ops}"


@dataclass(frozen=True, eq=False)
class UnitWeights(Weights):
    """The weight 1 of the one slot (``k = 1``, the tokens scaled before the experts)."""

    def text(self) -> str:
        """The unit weight."""
        return "the weight 1 of the one slot (the tokens were scaled)"


@dataclass(frozen=True, eq=False)
class ScaledTokens(Tokens):
    """``X[t, h] * w[t, 0]``: the token rows times their one routing weight (``k = 1``)."""

    weights: Weights | None = None

    def text(self) -> str:
        """The scaled tokens."""
        return "the tokens X[t, h] times their routing weight w[t, 0]"


@dataclass(frozen=True, eq=False)
class PlusBase(Term):
    """``base[t, o] + inner``: the layer scatter-added into a value that is not zeros."""

    inner: SlotSum
    base: ir.Value

    progress = 6

    def text(self) -> str:
        """The layer plus the base."""
        return f"'{self.base.name}' plus {self.inner.text()}"


def extra_transfer(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> list | None:
    """The outputs' meanings where ``node`` is one of the ops above (else None)."""
    found = id_tables.id_transfer(node, ins, ctx)
    if found is not None:
        return found
    op = node.op_type
    if op == "GatherElements" and len(ins) > 1 and ins[1] is not None:
        if isinstance(ins[1].term, RowIndex):
            return [gather_rows(node, ins[0], ins[1])]
        return None
    described = [m for m in ins if m is not None]
    if op in ("Mul", "Div") and len(described) == 1 and isinstance(described[0].term, Weights):
        return _scaled_weights(node, ins, ctx)
    if op == "Mul" and len(described) == 2:
        kinds = [type(m.term) for m in described]
        if Tokens in kinds and any(isinstance(m.term, Weights) for m in described):
            return [_scaled_tokens(node, described, ctx)]
    if op in ("ScatterElements", "ScatterND") and len(ins) >= 3:
        return _scatter(node, ins, ctx)
    return None


def gather_rows(node: ir.Node, data: Meaning | None, index: Meaning) -> Meaning:
    """``GatherElements(data, index, axis)`` at an index holding the axis' own index, repeated."""
    if data is None:
        raise Departure("a GatherElements of a value this analysis does not describe")
    rank = len(data.axes)
    axis = attr_int(node, "axis", 0) or 0
    axis = axis + rank if axis < 0 else axis
    if len(index.axes) != rank or not 0 <= axis < rank:
        raise Departure("a GatherElements whose index is not of the data's rank")
    for i, (a, b) in enumerate(zip(data.axes, index.axes, strict=True)):
        if i == axis:
            continue
        full = axis_size(a) == axis_size(b)
        if not full or (b and not all(is_repeat(f.var) for f in b)):
            raise Departure(
                "a GatherElements at an index that is not the same row index across every "
                "other axis of the data"
            )
    trimmed = Meaning((index.axes[axis],), index.term)
    return indexing._rows_at(data, trimmed, axis)  # noqa: SLF001 - the gather's own rule


def _scaled_weights(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> list | None:
    """Weights laid out other than ``[t, j]`` (sorted rows) times or over a scalar constant."""
    at = next(i for i, m in enumerate(ins) if m is not None)
    m = ins[at]
    assert m is not None and isinstance(m.term, Weights)
    if [[f.var for f in a] for a in m.axes] in ([["t"], ["j"]], [["t"], []]):
        return None  # [T, k] itself: the node's output is the weights (routing_value)
    others = [v for i, v in enumerate(node.inputs) if i != at]
    arr = small_const(others[0]) if len(others) == 1 else None
    if (
        arr is None
        or arr.size != 1
        or arr.ndim > len(m.axes)
        or (node.op_type == "Div" and at != 0)
    ):
        return None
    if isinstance(m.term, UnitWeights):
        raise Departure("a scale of the unit weight")
    post = m.term.post if isinstance(m.term, ScaledWeights) else ()
    scaled = ScaledWeights(m.term.source, (*post, (node, at)))
    return [Meaning(m.axes, scaled)]


def _scaled_tokens(node: ir.Node, described: list[Meaning], ctx: Context) -> Meaning:
    """Token rows times their own routing weight: the scaled tokens, at ``k = 1`` only."""
    x = next(m for m in described if type(m.term) is Tokens)
    w = next(m for m in described if isinstance(m.term, Weights))
    if ctx.k != 1:
        raise Departure(
            f"the token rows scaled by the routing weights of each of k = {ctx.k} slots "
            "(one input row per token cannot carry k scales)"
        )
    if isinstance(w.term, UnitWeights) or (w.axes and w.axes[-1]):
        raise Departure("the token rows times weights that are not one per row")
    axes = broadcast_axes(x.axes, w.axes)
    if axes != x.axes:
        raise Departure("the token rows times weights laid out over other rows")
    return Meaning(axes, ScaledTokens(weights=w.term))  # type: ignore[arg-type]


def prescale_of(term: Term) -> Weights | None:
    """The weights the tokens an FC1 projection reads were scaled by (None: plain tokens)."""
    return term.weights if isinstance(term, ScaledTokens) else None


def _leaves(term: Term) -> tuple[Proj, ...]:
    if isinstance(term, Act):
        return term.leaves
    return (term,) if isinstance(term, Proj) else ()


def _unit_weighted(updates: Meaning | None, ctx: Context) -> Meaning | None:
    """FC2's outputs of scaled tokens at ``k = 1``: weighted by the unit weight."""
    if updates is None or ctx.k != 1 or not isinstance(updates.term, Proj):
        return None
    fc2 = updates.term
    scales = [prescale_of(p.input) for p in _leaves(fc2.input)] if fc2.stage == 2 else []
    if not scales or any(s is None for s in scales):
        return None
    return Meaning(updates.axes, Weighted(UnitWeights(scales[0].source), fc2))  # type: ignore[union-attr]


def _scatter(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> list | None:
    """The combine's scatter of unit-weighted rows, or into a base that is not zeros."""
    data, index, updates = ins[:3]
    unit = _unit_weighted(updates, ctx)
    if unit is not None:
        updates = unit
    base = node.inputs[0]
    into_base = (
        data is None
        and base is not None
        and not is_zeros(base)
        and attr_str(node, "reduction", "none") == "add"
        and updates is not None
        and isinstance(updates.term, Weighted)
    )
    if not into_base:
        if unit is None:
            return None
        return [scatters.scatter(node, [data, index, updates], ctx)]
    dims = value_dims(base)
    if dims is None or len(dims) != 2 or dims[0] != ctx.tokens:
        raise Departure(f"a {node.op_type} of the weighted outputs into '{base.name}', not [T, O]")
    acc = Meaning(((Factor("t", ctx.tokens),), (Factor("o", dims[1]),)), ExpertSum(()))
    summed = scatters.scatter(node, [acc, index, updates], ctx)
    if not isinstance(summed.term, SlotSum):
        raise Departure(
            f"a {node.op_type} of one expert's rows into '{base.name}', a value other than zeros"
        )
    return [Meaning(summed.axes, PlusBase(summed.term, base))]
