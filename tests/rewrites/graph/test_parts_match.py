"""Pins the onnxscript private API that ``rewrites/graph/match.py`` relies on (0.7.x).

The part recognisers match small patterns at a given node, which onnxscript offers only
through ``_pattern_ir._to_graph_pattern`` and ``SimplePatternMatcher.match``. If an onnxscript
upgrade changes either, this test says so before any recogniser silently stops matching.
"""

from __future__ import annotations

import inspect

import onnx_ir as ir
from onnx import TensorProto, helper
from onnxscript.rewriter import _pattern_ir, pattern

from onnx_moe_fuse.rewrites.graph.match import PartPattern, first_match


def _graph() -> ir.Model:
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"], name="sig"),
        helper.make_node("Mul", ["x", "s"], ["y"], name="mul"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))


def test_private_api_is_as_pinned() -> None:
    assert callable(_pattern_ir._to_graph_pattern)
    params = inspect.signature(pattern.SimplePatternMatcher.match).parameters
    assert list(params)[:4] == ["self", "model", "graph_or_function", "node"]
    assert "remove_nodes" in params


def test_part_pattern_matches_at_the_node_and_binds() -> None:
    model = _graph()
    mul = model.graph.node("mul")
    silu = PartPattern("silu", lambda op: op.Mul(pattern.Var("h"), op.Sigmoid(pattern.Var("h"))))
    found = silu.match(mul)
    assert found is not None
    assert found.bindings["h"] is model.graph.inputs[0]
    assert set(found.nodes) == {mul, model.graph.node("sig")}
    assert silu.match(model.graph.node("sig")) is None  # a Sigmoid is no Mul


def test_first_match_tries_in_order() -> None:
    model = _graph()
    relu = PartPattern("relu", lambda op: op.Relu(pattern.Var("h")))
    mul = PartPattern("mul", lambda op: op.Mul(pattern.Var("a"), pattern.Var("b")))
    tag, found = first_match([("relu", relu), ("mul", mul)], model.graph.node("mul"))
    assert tag == "mul" and found.bindings["b"].name == "s"
    assert first_match([("relu", relu)], model.graph.node("mul")) is None
