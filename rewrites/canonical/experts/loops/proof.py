"""Proof that a loop over all experts computes the MoE layer of its routing TopK.

optimum-onnx's patched MoE forwards loop over every expert ``e = 0..E-1`` (traced, the loop is
unrolled): the slot and token ids ``s_e, t_e`` of the tokens routed to ``e`` come from
``NonZero`` of the expert's slice of a one-hot mask of the TopK ids, the expert's MLP runs on the
rows ``x[t_e]``, its outputs are weighted by ``w[t_e, s_e]`` and scatter-added into a ``[T, H]``
accumulator at rows ``t_e``. Since each (token t, slot s) pair is routed to exactly one expert
(``ids[t, s]``), the sum over the experts is ``out[t] = sum_s w[t, s] * f_{ids[t, s]}(x[t])``,
the per-slot layer :mod:`.expert_loop` writes.

:func:`analyse_loop` proves it structurally, raising a
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` with the reason otherwise:

* the mask is the one-hot of THIS TopK's ids with depth the router's expert count E, as
  ``[E, k, T]`` (:func:`.values.read_mask`), read only by one slice per expert, every
  ``e`` in ``0..E-1`` exactly once;
* each slice's NonZero coordinates give ``s_e`` (column 0, the slot) and ``t_e`` (column 1, the
  token) pair by pair (:func:`.values.read_coords`);
* the expert reads the rows ``x[t_e]`` of one ``[T, H]`` tokens value shared by all experts,
  with ``T`` the TopK's rows (:func:`.gathers.read_rows`), and is weighted by
  ``w[t_e, s_e]`` of one ``[T, k]`` value computed from this TopK's values
  (:func:`.gathers.read_weight`);
* every expert's MLP has the same structure (op types, attributes, activation constants,
  weight shapes), only the weights differ, and no two experts share a weight
  (:mod:`.mlp`); the experts' rows, weights and scatters use one spelling;
* the scatter-adds form one chain over all experts from zeros shaped like the tokens, every
  Expand / Reshape on the way keeps the shape (:mod:`.steps`);
* nothing computed from the mask escapes the loop except the last accumulator (a value read
  only by ``Shape`` nodes is not an escape: the data is not read).

Only reads the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.loops.gathers import read_rows, read_weight
from onnx_moe_fuse.rewrites.canonical.experts.loops.mlp import ExpertMLP, read_expert_mlp
from onnx_moe_fuse.rewrites.canonical.experts.loops.steps import Step, chain, read_step
from onnx_moe_fuse.rewrites.canonical.experts.loops.values import (
    Coords,
    Mask,
    is_zeros_like,
    read_coords,
    read_mask,
    topk_values_of,
)
from onnx_moe_fuse.rewrites.canonical.experts.value_proofs import producer_op, uses
from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_ints, label, static_last_dim
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.graph.symbolic_dims import value_dims

__all__ = ["ExpertLoop", "loop_candidates", "analyse_loop"]

_STD = ("", "ai.onnx")


@dataclass
class ExpertLoop:
    """A proved loop: the values the per-slot layer is built from, and its MLPs in expert order."""

    topk: ir.Node
    tokens: ir.Value  # x [T, H]
    ids: ir.Value  # [T, k]
    weights: ir.Value  # w [T, k]
    k: int
    mlps: list[ExpertMLP]
    layer_out: ir.Value  # the last accumulator [T, H]
    hidden: int


def _is_projection(value: ir.Value) -> bool:
    """A MatMul's output, or ``Add(MatMul(.), bias)`` (a Linear with bias): FC2's output."""
    if producer_op(value, "MatMul") is not None:
        return True
    add = producer_op(value, "Add")
    return add is not None and any(producer_op(v, "MatMul") is not None for v in add.inputs)


def loop_candidates(graph: ir.Graph) -> list[tuple[ir.Node, Mask]]:
    """``(TopK, mask)`` for every TopK whose ids build an ``[E, k, T]`` mask read by Gathers."""
    found = []
    for node in graph:
        if node.op_type != "TopK" or node.domain not in _STD or len(node.outputs) < 2:
            continue
        mask = read_mask(node)
        if mask is None:
            continue
        readers = uses(mask.value)
        if readers and any(n.op_type == "Gather" for n in readers):
            found.append((node, mask))
    return found


def _routing(topk: ir.Node, mask: Mask) -> int:
    """``k``, after checking the TopK selects along the last axis of ``E`` router scores."""
    k = const_ints(topk.inputs[1]) if len(topk.inputs) > 1 else None
    if k is None or len(k) != 1:
        raise Refusal(f"routing: {label(topk)} has no constant k")
    if attr_int(topk, "axis", -1) != -1 or attr_int(topk, "largest", 1) != 1:
        raise Refusal(f"routing: {label(topk)} does not select the largest scores (axis -1)")
    scored = static_last_dim(topk.inputs[0])
    if scored != mask.experts:
        raise Refusal(
            f"mask: the one-hot has {mask.experts} experts, but {label(topk)} selects among "
            f"{scored if scored is not None else 'an unknown number of'} router scores"
        )
    return k[0]


def _slices(mask: Mask) -> list[Coords]:
    coords: dict[int, Coords] = {}
    for reader in uses(mask.value):
        if reader.op_type != "Gather":
            raise Refusal(
                f"mask: {label(reader)} ({reader.op_type}) reads the mask, which is not one "
                "expert's slice"
            )
        c = read_coords(reader, mask)
        if c.expert in coords:
            raise Refusal(f"mask: expert {c.expert}'s slice of the mask is taken twice")
        coords[c.expert] = c
    missing = [e for e in range(mask.experts) if e not in coords]
    if missing:
        raise Refusal(
            f"mask: experts {missing} have no slice of the mask: the loop does not run all "
            f"{mask.experts} experts (a trace of a loop over the experts one input hit?)"
        )
    return [coords[e] for e in range(mask.experts)]


def _scatter_input(c: Coords) -> ir.Value:
    """The weighted rows ``v_e`` that expert ``c.expert``'s scatter adds at its token ids."""
    for user in uses(c.tokens):
        if user.op_type == "Unsqueeze":
            for nxt in uses(user.outputs[0]):
                if nxt.op_type == "ScatterND" and nxt.inputs[1] is user.outputs[0]:
                    return nxt.inputs[2]
                if nxt.op_type == "Expand":
                    for scatter in uses(nxt.outputs[0]):
                        if scatter.op_type == "ScatterElements":
                            upd = scatter.inputs[2]
                            expand = producer_op(upd, "Expand")
                            return expand.inputs[0] if expand is not None else upd
    raise Refusal(
        f"expert {c.expert}: no scatter into the accumulator at its token ids {c.tokens.name!r}"
    )


@dataclass
class _Expert:
    coords: Coords
    mlp: ExpertMLP
    tokens: ir.Value
    weights: ir.Value
    step: Step
    spelling: tuple
    nodes: list[ir.Node]


_LAYER_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _expert(c: Coords, k: int, topk: ir.Node, hidden_of) -> _Expert:
    e = c.expert
    v = _scatter_input(c)
    nodes: list[ir.Node] = []
    cast = producer_op(v, "Cast")
    inner = v
    if cast is not None and attr_int(cast, "to", None) == ir.DataType.FLOAT:
        nodes.append(cast)
        inner = cast.inputs[0]
    mul = producer_op(inner, "Mul")
    if mul is None:
        raise Refusal(f"expert {e}: {v.name!r} is not the expert's output times its weight")
    nodes.append(mul)
    a, b = mul.inputs
    y, g = (a, b) if _is_projection(a) else (b, a)
    mlp = read_expert_mlp(y, e)
    x, rows_spelling, rows_nodes = read_rows(mlp.rows, e, c.tokens, c.slots)

    def weights_of(value: ir.Value) -> ir.Value | None:
        source = topk_values_of(value)
        if source is not None and source is not topk:
            raise Refusal(
                f"expert {e}: the routing weights {value.name!r} come from {label(source)}, not "
                f"from {label(topk)} whose ids build the mask"
            )
        return value if source is topk else None

    w, weight_spelling, weight_nodes = read_weight(g, e, c.slots, c.tokens, k, weights_of)
    step = read_step(v, c.tokens, e, hidden_of(mlp))
    spelling = (rows_spelling, weight_spelling, step.spelling, bool(cast))
    nodes += c.nodes + mlp.nodes + rows_nodes + weight_nodes + step.nodes
    return _Expert(c, mlp, x, w, step, spelling, nodes)


def _same_dim(a, b) -> bool:
    return a is not None and b is not None and a == b


def _check_experts(experts: list[_Expert], ids: ir.Value) -> None:
    first = experts[0]
    for ex in experts[1:]:
        e = ex.coords.expert
        if ex.tokens is not first.tokens:
            raise Refusal(
                f"expert {e} reads the rows of {ex.tokens.name!r}, expert 0 those of "
                f"{first.tokens.name!r}"
            )
        if ex.weights is not first.weights:
            raise Refusal(
                f"expert {e} is weighted by {ex.weights.name!r}, expert 0 by {first.weights.name!r}"
            )
        if ex.mlp.signature != first.mlp.signature:
            raise Refusal(f"expert {e}'s MLP differs in structure from expert 0's")
        if ex.spelling != first.spelling:
            raise Refusal(f"expert {e}'s gathers or scatter differ in spelling from expert 0's")
    projections = len(first.mlp.fc1) + 1
    for j in range(projections):
        seen: dict[tuple, int] = {}
        for ex in experts:
            ref = [*ex.mlp.fc1, ex.mlp.fc2][j].weight
            if ref.key in seen:
                raise Refusal(
                    f"experts {seen[ref.key]} and {ex.coords.expert} share the weight "
                    f"{ref.source.name!r}"
                    + (f" entry {ref.index}" if ref.index is not None else "")
                    + ": each expert of the loop must have its own"
                )
            seen[ref.key] = ex.coords.expert
    tokens_dims, ids_dims = value_dims(first.tokens), value_dims(ids)
    if (
        tokens_dims is None
        or ids_dims is None
        or len(tokens_dims) != 2
        or not _same_dim(tokens_dims[0], ids_dims[0])
    ):
        raise Refusal(
            f"the tokens {first.tokens.name!r} and the ids {ids.name!r} are not proved to have "
            "the same number of rows"
        )


def _check_escapes(mask: Mask, nodes: set[int], layer_out: ir.Value) -> None:
    """Everything computed from the mask stays in the loop, up to the last accumulator."""
    frontier, seen = [mask.value], {id(mask.value)}
    while frontier:
        value = frontier.pop()
        if value is layer_out:
            continue
        if value.is_graph_output():
            raise Refusal(f"region: the loop's intermediate {value.name!r} is a graph output")
        for user in uses(value):
            if user.op_type in ("Shape", "Size"):
                continue
            if id(user) not in nodes:
                raise Refusal(
                    f"region: {label(user)} ({user.op_type}) outside the loop reads its "
                    f"intermediate {value.name!r}"
                )
            for out in user.outputs:
                if id(out) not in seen:
                    seen.add(id(out))
                    frontier.append(out)


def analyse_loop(topk: ir.Node, mask: Mask) -> ExpertLoop:
    """Prove the loop over the experts masked by ``topk``'s ids; raise a ``Refusal`` otherwise."""
    k = _routing(topk, mask)

    def hidden_of(mlp: ExpertMLP) -> int:
        return mlp.fc2.weight.dims[1]

    experts = [_expert(c, k, topk, hidden_of) for c in _slices(mask)]
    _check_experts(experts, topk.outputs[1])
    first = experts[0]
    hidden = hidden_of(first.mlp)
    tokens = first.tokens
    if first.mlp.fc2.weight.dtype not in _LAYER_FLOATS:
        raise Refusal(
            f"the experts compute in {first.mlp.fc2.weight.dtype}; the layer rules fuse float32, "
            "float16 and bfloat16 experts"
        )
    dims = value_dims(tokens)
    if dims[1].syms or dims[1].coef != hidden or first.mlp.fc1[0].weight.dims[0] != hidden:
        raise Refusal(
            f"the expert weights do not map the tokens' {dims[1]} features back to {hidden}"
        )
    start, accs = chain([ex.step for ex in experts])
    if not is_zeros_like(start, tokens):
        raise Refusal(
            f"accumulation: the first expert adds into {start.name!r}, which is not proved to be "
            f"zeros shaped like the tokens {tokens.name!r}"
        )
    valid_shapes = {id(start), *(id(a) for a in accs)}
    for ex in experts:
        for value in ex.step.shape_of:
            if id(value) not in valid_shapes:
                raise Refusal(
                    f"expert {ex.coords.expert}: its rows are broadcast to the shape of "
                    f"{value.name!r}, which is not the accumulator"
                )
    layer_out = accs[-1]
    nodes = {id(n) for ex in experts for n in ex.nodes} | {id(n) for n in mask.nodes}
    _check_escapes(mask, nodes, layer_out)
    if not layer_out.is_graph_output() and not layer_out.uses():
        raise Refusal(f"the layer output {layer_out.name!r} is not used")
    return ExpertLoop(
        topk,
        tokens,
        topk.outputs[1],
        first.weights,
        k,
        [ex.mlp for ex in experts],
        layer_out,
        hidden,
    )
