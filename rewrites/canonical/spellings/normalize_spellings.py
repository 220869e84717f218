"""Canonicalisation pass H2: rewrite other op spellings into the ones the layer rules match.

The layer rules (:mod:`onnx_moe_fuse.rewrites.moe.rule_base`) match one spelling of each part of a
MoE layer: SiLU as ``Mul(h, Sigmoid(h))``, SwiGLU with ``Mul(gate, alpha)`` and ``Clip`` limits,
renormalisation as ``Div(v, ReduceSum(v))``, routers and experts as ``MatMul``. Exporters write
the same arithmetic in other ops; :class:`NormalizeSpellingsPass` rewrites those into the
matched forms on the working copy (never the original: the fused regions are spliced back by
value name), one family of small rules per module:

* :mod:`.activation`: ``Swish``, ``QuickGelu`` -> ``Mul(x, Sigmoid(Mul(x, alpha)))``;
* :mod:`.arith`: ``Gemm`` -> ``MatMul`` (+ ``Transpose``, ``Mul``, ``Add``);
  ``Mul(v, Reciprocal(s))`` -> ``Div(v, s)`` (a last-bit difference, see there); the constant
  operand of ``Mul``/``Add`` second;
* :mod:`.clamp`: ``Min``/``Max`` with scalar constants, nested one-sided ``Clip``s and
  attribute ``Clip`` (opset < 11) -> ``Clip(x, lo, hi)`` with inputs;
* :mod:`.cast`: ``Cast`` chains that keep precision -> one ``Cast`` or none;
* :mod:`.tile`: ``Tile`` that repeats only unit axes -> ``Expand``;
* :mod:`.split_rows`: Reshapes that split token rows around a combine's ``Mul`` and
  ``ReduceSum`` moved below them; a ``Tile`` of rows regrouped by copy -> ``Expand``;
* :mod:`.selection`: ``ArgMax`` (first maximum) and the ``ReduceMax`` of the same row ->
  ``TopK(k=1)`` indices and values;
* :mod:`.squeeze`: ``Unsqueeze(Squeeze(x, a), a)`` -> ``x``;
* :mod:`.einsum`: two-operand ``Einsum`` -> ``MatMul``/``Transpose``/``Unsqueeze``/
  ``Squeeze`` (``Mul``/``ReduceSum`` when nothing is contracted).

The rules are applied to a fixpoint (one rewrite may enable another, e.g. a ``Gemm`` with
``alpha`` yields a ``Mul`` whose constant the commute rule then puts second); each application
replaces at least one node by forms no rule turns back, so the loop ends, and it is bounded by
:data:`MAX_ROUNDS` all the same. A model the rules do not touch is left exactly as it was.

Names and tags: a replacement value takes the replaced one's name (the rewriter does it) and its
``meta`` (this pass does it, so the splice's origin tags survive: the splice stops at a tagged
value and finds it in the original by name); new intermediate values get fresh ``__canon``
names; Constants this pass made and a later rule left unread are removed (the model's own dead
nodes are not: clean-up is a later stage's, on the original).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.rewrites.canonical.spellings.activation import activation_rules
from onnx_moe_fuse.rewrites.canonical.spellings.arith import arith_rules
from onnx_moe_fuse.rewrites.canonical.spellings.cast import cast_rules, eliminate_identity_casts
from onnx_moe_fuse.rewrites.canonical.spellings.clamp import clamp_rules
from onnx_moe_fuse.rewrites.canonical.spellings.common import FreshNames
from onnx_moe_fuse.rewrites.canonical.spellings.einsum import einsum_rules
from onnx_moe_fuse.rewrites.canonical.spellings.selection import selection_rules
from onnx_moe_fuse.rewrites.canonical.spellings.split_rows import split_rows_rules
from onnx_moe_fuse.rewrites.canonical.spellings.squeeze import squeeze_rules
from onnx_moe_fuse.rewrites.canonical.spellings.tile import tile_rules

__all__ = ["MAX_ROUNDS", "NormalizeSpellingsPass", "spelling_rules"]

#: Upper bound on rounds of the whole rule set (each round rewrites every match it finds).
MAX_ROUNDS = 16
#: The default opset assumed for a model that imports none (ONNX's own rule: opset 1).
_NO_OPSET = 1


def spelling_rules(names: FreshNames, opset: int) -> list[pattern.RewriteRule]:
    """Every spelling rule, for a model of ``""`` opset ``opset`` naming values by ``names``."""
    return [
        *activation_rules(names, opset),
        *arith_rules(names, opset),
        *clamp_rules(names, opset),
        *cast_rules(names, opset),
        *tile_rules(names, opset),
        *einsum_rules(names, opset),
        *split_rows_rules(names, opset),
        *selection_rules(names, opset),
        *squeeze_rules(names, opset),
    ]


class NormalizeSpellingsPass(ir.passes.InPlacePass):
    """Rewrite op spellings into the forms the layer rules match, to a fixpoint."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Apply the spelling rules and the identity-Cast removal until nothing changes."""
        opset = model.opset_imports.get("", _NO_OPSET)
        names = FreshNames(model)
        rule_set = pattern.RewriteRuleSet(spelling_rules(names, opset))
        recorded = _constant_output_types(model)
        metadata = _value_metadata(model)
        modified = False
        for _ in range(MAX_ROUNDS):
            changes = rule_set.apply_to_model(model)
            changes += eliminate_identity_casts(model)
            if not changes:
                break
            modified = True
        if modified:
            _bypass_created_identities(model, names.created)
            _remove_dead_created(model, names.created)
            _carry_metadata(model, metadata)
        else:
            # the rewriter types every Constant's output as it looks for matches; undo that so
            # that a model no rule touched serialises exactly as it came in
            for value, (type_, shape) in recorded.items():
                value.type, value.shape = type_, shape
        return ir.passes.PassResult(model, modified)


def _bypass_created_identities(model: ir.Model, created: set[str]) -> None:
    """Read past each ``Identity`` of a value this pass made (``Unsqueeze(Squeeze(x))`` -> x).

    A rule returns ``Identity(x)`` so that the replaced value keeps its name; the passes after
    this one follow values, not names, and some look for ``x``'s users directly (the dense
    pass reads the one-hot of a TopK's indices). Graph outputs keep their Identity.
    """
    for node in list(model.graph):
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
            continue
        src, out = node.inputs[0], node.outputs[0]
        if src is None or src.name not in created or out.is_graph_output():
            continue
        ir.convenience.replace_all_uses_with(out, src)
        model.graph.remove(node, safe=True)


def _remove_dead_created(model: ir.Model, created: set[str]) -> None:
    """Remove the nodes this pass created whose outputs nothing reads any more.

    A later rule can consume what an earlier one emitted (two one-sided Clips merge, and the
    first one's infinite bound Constant is left unread); nodes of the model itself are not
    swept, dead or not: that is the clean-up stage's business, on the original.
    """
    graphs = [model.graph, *model.functions.values()]
    changed = True
    while changed:
        changed = False
        for graph in graphs:
            for node in reversed(list(ir.traversal.RecursiveGraphIterator(graph))):
                outs = node.outputs
                if outs and all(
                    v.name in created and not v.uses() and not v.is_graph_output() for v in outs
                ):
                    node.graph.remove(node, safe=True)
                    changed = True


def _all_values(model: ir.Model):
    """Every value of the model: graph inputs, initializers, node outputs (subgraphs too)."""
    for graph in [model.graph, *model.functions.values()]:
        yield from graph.inputs
        if isinstance(graph, ir.Graph):
            yield from graph.initializers.values()
        for node in ir.traversal.RecursiveGraphIterator(graph):
            yield from node.outputs


def _value_metadata(model: ir.Model) -> dict[str, dict]:
    """The ``meta`` entries of every named value that has some, by name."""
    return {v.name: dict(v.meta) for v in _all_values(model) if v.name and v.meta}


def _carry_metadata(model: ir.Model, metadata: dict[str, dict]) -> None:
    """Give a replacement value the ``meta`` of the value it replaced (it took its name).

    The pipeline tags the values of the working copy that exist in the original
    (``onnx_moe_fuse.pipeline.splice.ORIGIN_KEY``); the splice stops at tagged values and finds them in the
    original by name. A replacement computes the same function under the same name, so it is
    that value: without the tag the splice would copy the canonical nodes computing it into the
    original and widen the region past it.
    """
    for value in _all_values(model):
        for key, entry in metadata.get(value.name or "", {}).items():
            if key not in value.meta:
                value.meta[key] = entry


def _constant_output_types(model: ir.Model) -> dict[ir.Value, tuple]:
    """The type and shape recorded for each Constant node's output, in every graph."""
    recorded = {}
    for graph in [model.graph, *model.functions.values()]:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                for value in node.outputs:
                    recorded[value] = (value.type, value.shape)
    return recorded
