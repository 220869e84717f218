"""Canonicalisation: give the values a model left undeclared their inferred shapes and types.

torch.onnx writes ``value_info`` for every intermediate value, but a model that went through
another tool (a quantiser that rebuilds the graph, ``onnx.utils.extract_model``, a hand edit)
may carry none. The layer proofs then cannot tell a router's ``[T, E]`` scores from anything
else ("the rank of ... is unknown"). :class:`InferMissingShapesPass` runs ONNX's shape
inference (``onnx_ir.passes.common.ShapeInferencePass``, not strict: an op it does not know,
com.microsoft's included, is skipped; large initializers are not serialised) on a clone and
copies onto the working copy the rank, the int dims and the type of each value that had
none (symbolic dims stay unknown, for :mod:`onnx_moe_fuse.rewrites.graph.symbolic_dims` to
tie to their producers as it does for undeclared values). Values that
have them keep them, so a model with complete ``value_info`` is left exactly as it is (and
inference does not even run). Inference is sound: it states what ONNX's op definitions fix.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

__all__ = ["InferMissingShapesPass"]


def _undeclared(graph: ir.Graph) -> list[ir.Value]:
    """Node outputs of the main graph with no shape (Constants excepted: they have tensors)."""
    return [
        v
        for node in graph
        if node.op_type != "Constant"
        for v in node.outputs
        if v.shape is None and v.name
    ]


def _facts_only(shape: ir.Shape) -> ir.Shape:
    """The rank and the int dims; symbolic dims (``unk__0``, a graph input's name) unknown.

    Inference names unknown sizes (``unk__0``) and reuses the inputs' names, which the proofs
    must not read as equalities they did not derive (``graph.symbolic_dims`` ties dims itself).
    """
    return ir.Shape([d if isinstance(d, int) else None for d in shape])


class InferMissingShapesPass(ir.passes.InPlacePass):
    """Fill in the shapes and types of undeclared values from ONNX shape inference."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Infer on a clone; copy only what the working copy lacks."""
        missing = _undeclared(model.graph)
        if not missing:
            return ir.passes.PassResult(model, False)
        inferred = ShapeInferencePass(strict_mode=False)(model.clone()).model
        found = {v.name: v for node in inferred.graph for v in node.outputs if v.name}
        modified = False
        for value in missing:
            twin = found.get(value.name)
            if twin is None or twin.shape is None:
                continue
            value.shape = _facts_only(twin.shape)
            if value.type is None and twin.type is not None:
                value.type = twin.type
            modified = True
        return ir.passes.PassResult(model, modified)
