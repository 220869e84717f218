"""Dense all-experts forms: every expert on every token, weighted by the weights scattered to E.

The identity these transfers rest on: ``sum_e c[t, e] * FC2_e(..)[t] = sum_j w[t, j] *
FC2_{idx[t, j]}(..)[t]`` for ``c[t, e] = sum_j w[t, j] * [idx[t, j] == e]`` (a row's TopK
indices are distinct), so a dense layer is the contract and fusing it drops E/k of its work.

* ``MatMul`` of the tokens (or of a dense activation) by a whole ``[E, K, N]`` stack, the expert
  axis ``e`` a batch axis of the output: a dense projection (every row ``(e, t)`` meets its
  token and expert ``e``).
* ``Mul`` of the one-hot masks ``[idx[t, j] == e]`` by the weights, summed over the slots, or a
  ``ScatterElements`` of the weights into zeros ``[T, E]`` at the ids: the dense weights ``c``.
* ``Mul`` of ``c`` and FC2's dense outputs, summed over ``e`` (ReduceSum, or a MatMul
  contracting ``e``): the combine.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import (
    Departure,
    broadcast_axes,
    normalise,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    DenseWeights,
    Factor,
    Ids,
    Mask,
    Meaning,
    Proj,
    SlotSum,
    Weighted,
    Weights,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import value_dims
from onnx_moe_fuse.rewrites.graph.facts import attr_int

__all__ = ["dense_product", "is_dense", "scattered_weights", "summed_over_experts"]


def is_dense(m: Meaning) -> bool:
    """A value with an expert axis ``e`` (every expert's output)."""
    return any(f.var == "e" for f in m.factors())


def dense_product(described: list[Meaning]) -> Meaning | None:
    """``Mul`` of masks and weights, or of dense weights and FC2's dense outputs; else None."""
    if len(described) != 2:
        return None
    terms = [m.term for m in described]
    mask = next((m for m in described if isinstance(m.term, Mask) and m.term.expert is None), None)
    w = next((m for m in described if isinstance(m.term, Weights)), None)
    if mask is not None and w is not None:
        axes = broadcast_axes(mask.axes, w.axes)
        return Meaning(normalise(axes), DenseWeights(w.term, summed=False))  # type: ignore[arg-type]
    c = next((m for m in described if isinstance(m.term, DenseWeights)), None)
    y = next((m for m in described if isinstance(m.term, Proj) and m.term.stage == 2), None)
    if c is not None and y is not None and is_dense(y):
        if not c.term.summed:  # type: ignore[attr-defined]
            raise Departure("FC2's dense outputs times per-slot masked weights (not summed over j)")
        axes = broadcast_axes(c.axes, y.axes)
        term = Weighted(c.term.weights, y.term, dense=True)  # type: ignore[attr-defined,arg-type]
        return Meaning(normalise(axes), term)
    if any(isinstance(t, DenseWeights) for t in terms):
        kinds = " and ".join(t.text() for t in terms)
        raise Departure(f"a product of {kinds} (expected the dense weights times FC2's outputs)")
    return None


def summed_over_experts(m: Meaning, summed: list[tuple], out: list, k: int) -> Meaning | None:
    """A ReduceSum over ``j`` of masked weights, or over ``e`` of dense weighted outputs."""
    names = [[f.var for f in a] for a in summed]
    term = m.term
    if isinstance(term, DenseWeights) and not term.summed and names == [["j"]]:
        return Meaning(normalise(out), DenseWeights(term.weights, summed=True))
    if isinstance(term, Weighted) and term.dense:
        if names != [["e"]]:
            raise Departure(
                f"a ReduceSum of the dense weighted outputs over {names}, not the experts"
            )
        return Meaning(
            normalise(out), SlotSum(Weighted(term.weights, term.expert), frozenset(range(k)))
        )
    return None


def scattered_weights(node: ir.Node, ins: list[Meaning | None], zeros_ok: bool) -> Meaning | None:
    """``ScatterElements(zeros [T, E], ids, w, axis=-1)``: the dense weights; else None."""
    if node.op_type != "ScatterElements" or len(ins) < 3:
        return None
    _, index, updates = ins[:3]
    if index is None or updates is None or not isinstance(index.term, Ids):
        return None
    if not isinstance(updates.term, Weights) or not zeros_ok:
        return None
    if attr_int(node, "axis", 0) not in (1, -1) or index.axes != updates.axes:
        raise Departure("a ScatterElements of the weights along other than the expert axis")
    if [[f.var for f in a] for a in index.axes] != [["t"], ["j"]]:
        raise Departure("a ScatterElements of the weights at ids laid out other than [t, j]")
    return Meaning(index.axes[:1] + (((_expert_factor(node)),),), DenseWeights(updates.term, True))


def _expert_factor(node: ir.Node) -> Factor:
    dims = value_dims(node.inputs[0])
    if dims is None or len(dims) != 2:
        raise Departure("a ScatterElements into values that are not [T, E]")
    return Factor("e", dims[1])
