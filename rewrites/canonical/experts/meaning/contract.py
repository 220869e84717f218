"""Whether an interpreted layer is what one fused MoE node computes, and its parts if so.

The contract of ``com.microsoft.MoE``/``QMoE`` as an indexed expression::

    out[t, o] = sum_j w[t, j] * FC2_{idx[t, j]}( act( FC1_{idx[t, j]}(X[t, :]) ) )[o]

with ``FC_e(v) = v @ W[e] (+ b[e])`` for constant weights. The layer's output holds it as a
:class:`~.terms.SlotSum` over every slot (the per-slot forms: weights gathered at the ids), or as
an :class:`~.terms.ExpertSum` over every expert (a loop over the experts, each branch its
expert's own weights over the rows that chose it, all branches alike). :func:`layer_parts`
reads the structure off the output and returns the :class:`LayerParts` the emitter writes, or
raises :class:`~.layout.Departure` naming what differs. What ``w`` is (a softmax, renormalised
top-k values, ...), which activation ``act`` is and which target takes the node are the layer
rules' to prove on the per-slot form written from these parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.chosen_rows import ScoreWeights
from onnx_moe_fuse.rewrites.canonical.experts.meaning.interpret import TOKEN_LAYOUTS, Interpretation
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import Departure
from onnx_moe_fuse.rewrites.canonical.experts.meaning.shared import routing_nodes, shared_value
from onnx_moe_fuse.rewrites.canonical.experts.meaning.sorted_combine import (
    PlusBase,
    ScaledWeights,
    UnitWeights,
    prescale_of,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.sorted_rows import SegmentsProj
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    Act,
    ExpertSum,
    Meaning,
    Param,
    Proj,
    SlotSum,
    Tokens,
    Weighted,
    Weights,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import (
    const_shape,
    small_const,
    value_dims,
)
from onnx_moe_fuse.rewrites.graph.dims import Dim

__all__ = ["LayerParts", "Projection", "layer_parts", "stack_shape"]


@dataclass(frozen=True, eq=False)
class Projection:
    """One FC as the emitter writes it: its weights, stacked or one per expert (in order).

    ``k_major``: the weights' contracted axis comes first (``[E, K, N]`` / ``[K, N]``);
    ``term``: the projection the activation reads (branch 0's in a loop).
    """

    weights: tuple[Param, ...]
    biases: tuple[Param, ...] | None
    k_major: bool
    term: Proj


@dataclass(frozen=True, eq=False)
class LayerParts:
    """A layer proved to be the contract: what the per-slot form is written from.

    ``fc1``: FC1's projections in the order the activation reads them (one, or gate and up);
    ``act_nodes``: the activation's nodes in graph order (empty for an identity);
    ``fc2_input``: the term FC2 reads (an :class:`~.terms.Act` or FC1's projection);
    ``split_tokens``: the ``[B, S, H]`` tokens the output is laid out like, or None for ``[T, H]``
    (``tokens`` themselves may be ``[B, S, H]``: a router on them as they are).
    """

    topk: ir.Node
    tokens: ir.Value
    weights: ir.Value
    fc1: tuple[Projection, ...]
    act_nodes: tuple[ir.Node, ...]
    fc2_input: Act | Proj
    fc2: Projection
    output: ir.Value
    split_tokens: ir.Value | None
    widths: tuple[int, int]  # FC2's input and output widths
    # the sorted forms' extras (:mod:`.sorted_combine`): scalar ops on the weights to replay,
    # the weights the tokens are scaled by before FC1 (k = 1; the weight is then 1), and a
    # value the layer was scatter-added into (added after it)
    weight_post: tuple[tuple[ir.Node, int], ...] = ()
    prescale: Weights | None = None
    base: ir.Value | None = None
    # a [T, O] value of the tokens every expert's output added before the weighting
    # (:mod:`.shared`): the layer plus (sum_j w) * shared
    shared: ir.Value | None = None
    # ``weights`` is ``S [.., E]`` over every expert: the per-slot weights are ``S[t, idx[t, j]]``
    # (:mod:`.chosen_rows`), written as a GatherElements at the ids
    weights_at_ids: bool = False


def stack_shape(p: Param) -> tuple[int, ...] | None:
    """The shape of a weight's source (a DequantizeLinear's: its codes')."""
    if p.experts:  # the experts' own weights, stacked
        first = stack_shape(p.experts[0])
        return None if first is None else (len(p.experts), *first)
    source = p.source
    value = source.value if source.dq is None else source.inputs[0]
    shape = const_shape(value)
    producer = value.producer() if value is not None else None
    if shape is None and producer is not None and producer.op_type == "DequantizeLinear":
        shape = const_shape(producer.inputs[0])
    return shape


def _check_param(p: Param, what: str, feats: int) -> tuple[int, ...]:
    shape = stack_shape(p)
    wide = None if shape is None else [d for d in shape[(0 if p.single else 1) :] if d != 1]
    if len(p.feats) != feats or wide is None or len(wide) != feats:
        raise Departure(f"{what} {p.text()} is not a constant per-expert weight")
    if feats == 2 and len(shape) != (2 if p.single else 3):  # type: ignore[arg-type]
        raise Departure(f"{what} {p.text()} is not a constant [E, K, N] stack")
    return shape  # type: ignore[return-value]


@dataclass(frozen=True, eq=False)
class _Branch:
    """One expert's MLP as the output holds it (per-slot layers have one, for every expert)."""

    weighted: Weighted
    leaves: tuple[Proj, ...]
    act_nodes: tuple[ir.Node, ...]


def _branch(weighted: Weighted, order: dict[int, int]) -> _Branch:
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
    if len(leaves) > 2:
        raise Departure(f"the activation reads {len(leaves)} projections of the tokens")
    for p in leaves:
        if p.stage != 1 or not isinstance(p.input, Tokens):
            raise Departure(f"the activation reads {p.text()}, not a projection of the tokens")
        _check_param(p.weight, "FC1's weight", 2)
        if p.bias is not None:
            _check_param(p.bias, "FC1's bias", 1)
    ordered = tuple(sorted(set(nodes), key=lambda n: order.get(id(n), 0)))
    return _Branch(weighted, tuple(leaves), ordered)


def _signature(branch: _Branch, found: Interpretation) -> tuple:
    """What must be equal between two experts' branches for one stacked MLP to compute both."""

    def projection(p: Proj) -> tuple:
        return (stack_shape(p.weight), p.contracted == p.weight.feats[0], p.bias is not None)

    nodes = []
    for n in branch.act_nodes:
        inputs = []
        for v in n.inputs:
            m = found.meaning(v)
            if m is not None:
                inputs.append(
                    ("leaf", branch.leaves.index(m.term)) if m.term in branch.leaves else "act"
                )
            else:
                arr = small_const(v)
                inputs.append(None if arr is None else (arr.dtype.str, arr.shape, arr.tobytes()))
        attrs = tuple(sorted((k, repr(a.value)) for k, a in n.attributes.items()))
        nodes.append((n.op_type, n.domain, attrs, tuple(inputs)))
    fc2 = branch.weighted.expert
    return (tuple(projection(p) for p in branch.leaves), projection(fc2), tuple(nodes))


def layer_parts(found: Interpretation, order: dict[int, int]) -> LayerParts:
    """The parts of the layer ``found`` describes (``Departure`` when it is not the contract)."""
    out = found.output
    m = found.meaning(out)
    if out is None or m is None or found.tokens is None:
        raise Departure("no value holds the sum over every slot of the weighted expert outputs")
    base = None
    if isinstance(m.term, PlusBase):
        base = m.term.base
        m = Meaning(m.axes, m.term.inner)
    if isinstance(m.term, SlotSum | Weighted):  # Weighted: k = 1, the one slot
        weighted = m.term.inner if isinstance(m.term, SlotSum) else m.term
        fc2 = weighted.expert
        shared = shared_value([weighted])
        if isinstance(fc2, SegmentsProj) and shared is not None:
            raise Departure("sorted expert segments with a value of the tokens added inside")
        if isinstance(fc2, SegmentsProj):  # sorted rows, each expert's whole MLP on its segment
            segments = [Weighted(weighted.weights, s) for s in fc2.segments]
            branches = [_branch(w, order) for w in segments]
        else:
            branches = [_branch(weighted, order)]
    elif isinstance(m.term, ExpertSum):
        by_expert = dict(m.term.branches)  # past E: rows no token has (ids < E), dropped
        kept = [by_expert[e] for e in sorted(by_expert) if e < found.experts]
        shared = shared_value(kept)
        branches = [_branch(w, order) for w in kept]
    else:
        raise Departure(f"the output holds {m.term.text()}")
    if len(branches) > 1:
        first = _signature(branches[0], found)
        for e, b in enumerate(branches[1:], start=1):
            if _signature(b, found) != first:
                raise Departure(f"expert {e}'s MLP differs in structure from expert 0's")
            w, w0 = b.weighted.weights, branches[0].weighted.weights
            if w.source is not w0.source or getattr(w, "post", ()) != getattr(w0, "post", ()):
                raise Departure(f"expert {e}'s rows are weighted by other routing weights")
    head = branches[0]

    def projection(terms: list[Proj]) -> Projection:
        p = terms[0]
        weights = tuple(w for t in terms for w in (t.weight.experts or (t.weight,)))
        biases = None
        if p.bias is not None:
            biases = tuple(b for t in terms for b in (t.bias.experts or (t.bias,)))  # type: ignore[union-attr]
        return Projection(weights, biases, p.contracted == p.weight.feats[0], p)

    scales = {id(prescale_of(p.input)): prescale_of(p.input) for b in branches for p in b.leaves}
    if len(scales) != 1:
        raise Departure("FC1's projections read tokens scaled differently")
    prescale = next(iter(scales.values()))
    tokens = _expert_tokens(found)
    if prescale is not None and len(value_dims(tokens) or ()) == 3:
        raise Departure(
            "the [B, S, H] tokens scaled by their weight (written for [T, H] rows only)"
        )
    weights = head.weighted.weights
    if isinstance(weights, UnitWeights) != (prescale is not None):
        raise Departure("the tokens are scaled by their weight, and weighted again")
    if shared is not None and (prescale is not None or base is not None):
        raise Departure("a value of the tokens added inside a combine of scaled or based rows")
    if shared is not None and isinstance(weights, ScoreWeights):
        raise Departure("a value of the tokens added inside a combine weighted by a score column")
    if shared is not None:  # its gate is written from a copy of the router (``shared_parts``)
        routing_nodes(head.weighted.weights.source, found.tokens)
        if len(value_dims(_expert_tokens(found)) or ()) != 2:
            raise Departure("a value of the tokens added inside a combine over [B, S] tokens")
    post = weights.post if isinstance(weights, ScaledWeights) else ()
    fc1 = tuple(projection([b.leaves[i] for b in branches]) for i in range(len(head.leaves)))
    fc2 = projection([b.weighted.expert for b in branches])
    shape = stack_shape(fc2.term.weight)
    assert shape is not None
    k_in, n_out = shape[-2:] if fc2.k_major else shape[-2:][::-1]
    return LayerParts(
        found.topk,
        tokens,
        head.weighted.weights.source,
        fc1,
        head.act_nodes,
        head.weighted.expert.input,  # type: ignore[arg-type]
        fc2,
        out,
        _output_layout(found, m.axes),
        (int(k_in), int(n_out)),
        post,
        prescale,
        base,
        shared,
        isinstance(weights, ScoreWeights),
    )


def _expert_tokens(found: Interpretation) -> ir.Value:
    """The ``[T, H]`` token rows the fused node takes.

    The router's, or where only the router reads those, another value described as exactly ``X[t, h]`` that the layer reads (a second
    ``view`` of the same ``[B, S, H]`` input, as static exports write): the same values, and
    the splice's region then stops at it instead of reaching the graph input behind both.
    """
    rows = found.tokens
    assert rows is not None
    if len(value_dims(rows) or ()) == 3:
        return rows  # routed as they are: ids [B, S, k] go with the [B, S, H] rows, not a view
    readers = [u for u, _ in rows.uses() if u.op_type not in ("Shape", "Size")]
    if any(u.op_type not in ("MatMul", "Gemm") for u in readers):
        return rows  # the layer reads them too
    for value, m in found.meanings.values():
        if value is rows or type(m.term) is not Tokens:
            continue
        if [[f.var for f in a] for a in m.axes] != [["t"], ["h"]]:
            continue
        if any(u.op_type not in ("Shape", "Size") for u, _ in value.uses()):
            return value
    return rows


def _output_layout(found: Interpretation, axes) -> ir.Value | None:  # noqa: ANN001
    """None for ``[t, o]``; the ``[B, S, H]`` tokens for ``[t.hi, t.lo, o]``."""
    names = [[f.var for f in a] for a in axes]
    one_token = found.tokens is not None and (value_dims(found.tokens) or [None])[0] == Dim.of(1)
    if len(names) == 2 and names[0] == ([] if one_token else ["t"]) and len(names[1]) == 1:
        return None
    if len(names) == 3 and names[:2] in TOKEN_LAYOUTS[1:] and len(names[2]) == 1:
        for v in found.token_values:
            mv = found.meaning(v)
            if mv is not None and [[f.var for f in a] for a in mv.axes][:2] == names[:2]:
                if mv.axes[2][0].size == axes[2][0].size:
                    return v
    raise Departure(f"the layer's output is laid out {names}, not [tokens, features]")


_ = np
