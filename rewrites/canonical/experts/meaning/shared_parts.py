"""Write the separate term of a layer with a value of the tokens inside its combine.

:mod:`.shared` reads ``sum_j w (FC2 + S)`` as the layer plus ``(sum_j w[t, j]) * S[t]``; the
emitter writes the layer's per-slot form (the fused node, once the rules take it) and then this
term, ``Add(layer, Mul(ReduceSum(w, -1), S))``, from the model's own ``S``.

The weights ``w`` are the TopK's (through the routing ops after it), which the fused node
replaces: the splice removes every node of the layer, so the term cannot read them. It reads
a copy of the routing instead: the nodes from the router's token rows to ``w`` (the router
projection, its maps, the TopK and what follows), copied as they are, so that the copy computes
the same ``w`` from the same rows (a second, small router; the expert work is in the fused node).
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.contract import LayerParts
from onnx_moe_fuse.rewrites.canonical.experts.meaning.shared import routing_nodes
from onnx_moe_fuse.rewrites.canonical.experts.writer import GraphWriter

__all__ = ["add_shared_term"]


def _copied(writer: GraphWriter, weights: ir.Value, rows: ir.Value) -> ir.Value:
    """``weights`` recomputed by copies of its routing nodes (see the module)."""
    mapping: dict[int, ir.Value] = {}
    for old in routing_nodes(weights, rows):
        inputs = [None if v is None else mapping.get(id(v), v) for v in old.inputs]
        attrs = dict(old.attributes.items())
        base = f"shared_router_{old.op_type.lower()}"
        new = writer.node(old.op_type, inputs, base, len(old.outputs), old.domain, **attrs)
        for o_old, o_new in zip(old.outputs, new.outputs, strict=True):
            mapping[id(o_old)] = o_new
            o_new.dtype, o_new.shape = o_old.dtype, o_old.shape
    return mapping.get(id(weights), weights)


def add_shared_term(
    writer: GraphWriter, parts: LayerParts, weights: ir.Value, rows: ir.Value, result: ir.Value
) -> ir.Value:
    """``result + ReduceSum(w, [-1], keepdims=1) * S``, ``w`` from a copy of the router.

    ``rows``: the router's token rows (the contract checked :func:`routing_nodes` on them).
    """
    assert parts.shared is not None
    w = _copied(writer, weights, rows)
    axes = writer.ints("shared_gate_axes", [-1])
    gate = writer.node("ReduceSum", [w, axes], "shared_gate", keepdims=1).outputs[0]
    term = writer.node("Mul", [gate, parts.shared], "shared_term").outputs[0]
    return writer.node("Add", [result, term], "plus_shared").outputs[0]
