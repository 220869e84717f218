"""Whether an interpreted layer is what one fused MoE node computes, and its parts if so.

The contract of ``com.microsoft.MoE``/``QMoE`` as an indexed expression::

    out[t, o] = sum_j w[t, j] * FC2_{idx[t, j]}( act( FC1_{idx[t, j]}(X[t, :]) ) )[o]

with ``FC_e(v) = v @ W[e] (+ b[e])`` for constant stacks ``W [E, K, N]``. :func:`layer_parts`
reads that structure off the output's :class:`~.terms.SlotSum` and returns the
:class:`LayerParts` the emitter writes (or raises :class:`~.layout.Departure` naming what
differs). What ``w`` is (a softmax, renormalised top-k values, ...), which activation ``act`` is
and which target takes the node are the layer rules' to prove on the per-slot form written from
these parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.interpret import Interpretation
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import Departure
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    Act,
    Param,
    Proj,
    SlotSum,
    Tokens,
)

__all__ = ["LayerParts", "layer_parts"]


@dataclass(frozen=True, eq=False)
class LayerParts:
    """A layer proved to be the contract: what the per-slot form is written from.

    ``fc1``: FC1's projections in the order the activation reads them (one, or gate and up);
    ``act_nodes``: the activation's nodes in graph order (empty for an identity);
    ``fc2_input``: the term FC2 reads (an :class:`~.terms.Act` or FC1's projection);
    ``split_tokens``: the ``[B, S, H]`` tokens the output is laid out like, or None for ``[T, H]``.
    """

    topk: ir.Node
    tokens: ir.Value
    weights: ir.Value
    fc1: tuple[Proj, ...]
    act_nodes: tuple[ir.Node, ...]
    fc2_input: Act | Proj
    fc2: Proj
    output: ir.Value
    split_tokens: ir.Value | None


def _check_param(p: Param, what: str, feats: int) -> None:
    if not p.selected or len(p.feats) != feats:
        raise Departure(f"{what} {p.text()} is not a constant stack of [E, K, N] expert weights")


def layer_parts(found: Interpretation, order: dict[int, int]) -> LayerParts:
    """The parts of the layer ``found`` describes (``Departure`` when it is not the contract)."""
    out = found.output
    m = found.meaning(out)
    if out is None or m is None or not isinstance(m.term, SlotSum) or found.tokens is None:
        raise Departure("no value holds the sum over every slot of the weighted expert outputs")
    weighted = m.term.inner
    fc2 = weighted.expert
    if fc2.stage != 2:
        raise Departure("the weighted outputs are not FC2's")
    _check_param(fc2.weight, "FC2's weight", 2)
    if fc2.bias is not None:
        _check_param(fc2.bias, "FC2's bias", 1)
    act = fc2.input
    if isinstance(act, Act):
        leaves, nodes = act.leaves, act.nodes
    elif isinstance(act, Proj) and act.stage == 1:
        leaves, nodes = (act,), ()
    else:
        raise Departure(f"FC2 reads {act.text()}, not an activation of FC1")
    for p in leaves:
        if p.stage != 1 or not isinstance(p.input, Tokens):
            raise Departure(f"the activation reads {p.text()}, not a projection of the tokens")
        _check_param(p.weight, "FC1's weight", 2)
        if p.bias is not None:
            _check_param(p.bias, "FC1's bias", 1)
    if len(leaves) > 2:
        raise Departure(f"the activation reads {len(leaves)} projections of the tokens")
    split = _output_layout(found, m.axes)
    ordered = tuple(sorted(set(nodes), key=lambda n: order.get(id(n), 0)))
    return LayerParts(
        found.topk,
        found.tokens,
        weighted.weights.source,
        tuple(leaves),
        ordered,
        act,
        fc2,
        out,
        split,
    )


def _output_layout(found: Interpretation, axes) -> ir.Value | None:
    """None for ``[t, o]``; the ``[B, S, H]`` tokens for ``[t.hi, t.lo, o]``."""
    names = [[f.var for f in a] for a in axes]
    if len(names) == 2 and names[0] == ["t"] and len(names[1]) == 1:
        return None
    if len(names) == 3 and names[:2] == [["t.hi"], ["t.lo"]] and len(names[2]) == 1:
        for v in found.token_values:
            mv = found.meaning(v)
            if mv is not None and [[f.var for f in a] for a in mv.axes][:2] == names[:2]:
                if mv.axes[2][0].size == axes[2][0].size:
                    return v
    raise Departure(f"the layer's output is laid out {names}, not [tokens, features]")
