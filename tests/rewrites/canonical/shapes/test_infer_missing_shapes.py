"""Undeclared values get ONNX's inferred shapes; declared ones, and complete models, are kept."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.shapes.infer_missing_shapes import InferMissingShapesPass

_TEXT = """<ir_version: 10, opset_import: ["" : 18, "com.microsoft" : 1]>
g (float[T, 8] x, float[8, 4] w) => (float[T, 4] y) {
  l = MatMul(x, w)
  s = Sigmoid(l)
  v, i = TopK(s, k)
  z = com.microsoft.Gelu(s)
  y = Add(z, l)
}"""


def _model(declared: bool) -> ir.Model:
    text = _TEXT.replace("TopK(s, k)", "TopK(s, kk)").replace(
        "{\n  l", "<int64[1] kk = {2}> {\n  l"
    )
    proto = onnx.parser.parse_model(text)
    if declared:
        proto = onnx.shape_inference.infer_shapes(proto)
    return ir.from_proto(proto)


def _shapes(model: ir.Model) -> dict:
    return {v.name: v.shape for n in model.graph for v in n.outputs}


def test_undeclared_values_get_inferred_shapes():
    model = _model(declared=False)
    assert _shapes(model)["s"] is None
    assert InferMissingShapesPass()(model).modified
    shapes = _shapes(model)
    assert shapes["l"].rank() == 2 and shapes["s"][1] == 4 and shapes["i"][1] == 2
    assert shapes["s"][0] is None or not isinstance(shapes["s"][0], int)  # T: left unknown
    # the contrib op is unknown to ONNX's inference: skipped, not an error
    assert shapes["y"] is not None  # a graph output: declared


def test_declared_shapes_are_kept_and_a_complete_model_is_untouched():
    model = _model(declared=False)
    declared = ir.Shape(["T", 4])
    model.graph.node(1).outputs[0].shape = declared  # s: declared by the model, kept as is
    InferMissingShapesPass()(model)
    assert _shapes(model)["s"] is declared
    complete = _model(declared=True)
    for node in complete.graph:  # the contrib op's output too: nothing left undeclared
        for v in node.outputs:
            v.shape = v.shape or ir.Shape(["T", 4])
    before = {k: str(v) for k, v in _shapes(complete).items()}
    assert not InferMissingShapesPass()(complete).modified
    assert {k: str(v) for k, v in _shapes(complete).items()} == before
