"""Canonicalise DeepSpeed's top-2 capacity dispatch without drops into the dense all-experts form.

DeepSpeed's ``MOELayer`` + ``top2gating`` (``deepspeed/moe/sharded_moe.py``) picks two experts
in argmax rounds, numbers each token's place in its expert's capacity buffer by a cumulative
sum, dispatches the rows into ``[E, C, M]`` by an einsum, runs each expert on its chunk and
combines by another einsum. :class:`CanonicalCapacityDispatchPass` proves (:mod:`.gate`: the
rounds are the columns of ``TopK(P, 2)``, the weights are those two probabilities renormalised,
the locations are distinct and below C so no token is dropped; :mod:`.dispatch`: the buffer
holds the router's rows, each expert is row-wise, the combine reads the slots back) that the
layer equals::

    v, idx = TopK(P, 2);  w = v / ReduceSum(v, [-1], keepdims=1)
    out    = sum_e ReduceSum(Cast(Equal(idx, e)) * w, [-1], keepdims=1) * expert_e(x)

and writes that (every expert on every row, weighted by its dense column: the form
:mod:`~onnx_moe_fuse.rewrites.canonical.experts.dense.dense_experts` proves again and turns into
the per-slot layer). A layer whose gate reads as DeepSpeed's but fails a proof (a capacity that
drops tokens, ``drop_tokens=True``'s ``mask * (locations < C)``, a capacity fixed at export
below a dynamic token count) stays byte-identical and the pass records why (a
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` of stage ``capacity-dispatch`` naming the
part and node) for the near miss.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.capacity.dispatch import (
    CapacityDispatch,
    read_dispatch,
)
from onnx_moe_fuse.rewrites.canonical.experts.capacity.gate import (
    Top2Gate,
    first_round,
    read_gate,
)
from onnx_moe_fuse.rewrites.canonical.experts.writer import GraphWriter
from onnx_moe_fuse.rewrites.graph.refusals import CAPACITY_DISPATCH, Refusal

__all__ = ["CanonicalCapacityDispatchPass"]


def _analyse(round0: ir.Node, logits: ir.Value) -> tuple[Top2Gate, CapacityDispatch]:
    gate = read_gate(round0, logits)
    return gate, read_dispatch(gate.combine, gate.logits, gate.experts)


def _recognised(round0: ir.Node) -> bool:
    """Round 0's mask is read by a masked_fill of the logits: a top-2 gate in rounds."""
    return any(
        n.op_type == "Where" for v in round0.outputs for u in v.uses() for n in _near(u.node)
    )


def _near(node: ir.Node, depth: int = 3) -> list[ir.Node]:
    out = [node]
    if depth:
        for o in node.outputs:
            for u in o.uses():
                out += _near(u.node, depth - 1)
    return out


def _rewrite(graph: ir.Graph, gate: Top2Gate, layer: CapacityDispatch) -> None:
    """Write the dense all-experts form over ``layer``'s experts; drop the gate and buffer."""
    old_out = layer.output
    anchor = old_out.producer()
    writer = GraphWriter(graph, gate.rounds[0].name or "deepspeed_top2")
    k = writer.ints("k", [2])
    topk = writer.node(
        "TopK", [gate.probs, k], "top2", output_count=2, axis=-1, largest=1, sorted=1
    )
    values, ids = topk.outputs
    last = writer.ints("last_axis", [-1])
    total = writer.node("ReduceSum", [values, last], "weights_sum", keepdims=1).outputs[0]
    weights = writer.node("Div", [values, total], "weights").outputs[0]
    dtype = gate.probs.type.dtype if gate.probs.type is not None else ir.DataType.FLOAT
    rows = layer.tokens.shape[0] if layer.tokens.shape is not None else None
    summed = None
    for e, (chunk, nodes, y) in enumerate(
        zip(layer.chunks, layer.pipelines, layer.outputs, strict=True)
    ):
        expert = writer.ints(f"expert_{e}", [e])
        hit = writer.node("Equal", [ids, expert], f"expert_{e}_chosen").outputs[0]
        hit_f = writer.node("Cast", [hit], f"expert_{e}_mask", to=dtype).outputs[0]
        picked = writer.node("Mul", [hit_f, weights], f"expert_{e}_weights").outputs[0]
        column = writer.node("ReduceSum", [picked, last], f"expert_{e}_column", keepdims=1).outputs[
            0
        ]
        for node in nodes:  # the expert now reads every row: [T, N] values, not [1, C, N]
            for i, v in enumerate(node.inputs):
                if v is chunk:
                    node.replace_input_with(i, layer.tokens)
            for o in node.outputs:
                if o.shape is not None and rows is not None:
                    o.shape = ir.Shape([rows, o.shape[-1]])
        term = writer.node("Mul", [y, column], f"expert_{e}_weighted").outputs[0]
        summed = (
            term
            if summed is None
            else writer.node("Add", [summed, term], f"experts_sum_{e}").outputs[0]
        )
    assert summed is not None and anchor is not None
    graph.insert_before(anchor, writer.new_nodes)
    writer.take_over(old_out, summed)
    writer.remove_dead([old_out, layer.buffer, *layer.chunks, gate.combine])
    for node in gate.rounds:  # the rounds' other outputs (values) read by nothing now
        if node.graph is not None:
            writer.remove_dead(list(node.outputs))


class CanonicalCapacityDispatchPass(ir.passes.InPlacePass):
    """Rewrite every proved DeepSpeed top-2 capacity dispatch into the dense all-experts form.

    ``refusals`` receives the refusal of each gate it recognised (round 0's one-hot masks the
    logits of a second round) and left as it is, recorded as :data:`CAPACITY_DISPATCH`'s.
    """

    def __init__(self, refusals: list[Refusal] | None = None) -> None:
        """Record refusals into ``refusals`` (a new list by default)."""
        super().__init__()
        self.refusals: list[Refusal] = [] if refusals is None else refusals

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Rewrite the main graph's proved layers; the others stay as they are."""
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.graph is None or node.op_type != "TopK":
                continue
            logits = first_round(node)
            if logits is None:
                continue
            try:
                gate, layer = _analyse(node, logits)
            except Refusal as refusal:
                if _recognised(node):
                    self.refusals.append(refusal.recorded_by(CAPACITY_DISPATCH, node))
                continue
            except Exception:  # noqa: BLE001 - a graph the readers cannot read: no rewrite
                continue  # (they only read, so nothing is half-done; the layer stays as it is)
            _rewrite(graph, gate, layer)
            modified = True
        return ir.passes.PassResult(model, modified)
