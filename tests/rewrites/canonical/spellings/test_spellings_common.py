"""The spelling pass as a whole, and the helpers the per-family spelling tests share.

Helpers: build a model from ONNX text (``helpers.parse``), run :class:`NormalizeSpellingsPass` on a clone of its IR,
count ops, and compare the model before and after in ONNX Runtime CPU (graph optimisations off)
on fresh random inputs. Tests here: the fixpoint (a rewrite that enables another), names (kept
for every value that stays, fresh for new ones), the shared tensors of a clone left alone, and
an untouched model coming out byte-identical.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
from helpers import parse, random_feeds, session

from onnx_moe_fuse.pipeline.splice import ORIGIN_KEY, tag_origin
from onnx_moe_fuse.rewrites.canonical.spellings.normalize_spellings import NormalizeSpellingsPass


def normalise(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """The model after the pass on a clone of its IR, and whether the pass changed it."""
    ir_model = ir.from_proto(model).clone()
    result = NormalizeSpellingsPass()(ir_model)
    return ir.to_proto(result.model), result.modified


def ops(model: onnx.ModelProto) -> collections.Counter:
    """The op histogram of the main graph."""
    return collections.Counter(node.op_type for node in model.graph.node)


def assert_same(
    before: onnx.ModelProto,
    after: onnx.ModelProto,
    rng: np.random.Generator,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    feeds: dict | None = None,
    dims: dict | None = None,
) -> None:
    """Both models compute the same outputs (to ``rtol``/``atol``; exact by default)."""
    s_before, s_after = session(before), session(after)
    feeds = feeds if feeds is not None else random_feeds(s_before, rng, dims)
    expected = s_before.run(None, feeds)
    got = s_after.run(None, feeds)
    names = [o.name for o in s_before.get_outputs()]
    assert names == [o.name for o in s_after.get_outputs()]
    for name, e, g in zip(names, expected, got, strict=True):
        assert e.shape == g.shape and e.dtype == g.dtype, name
        if rtol == 0.0 and atol == 0.0:
            np.testing.assert_array_equal(g, e, err_msg=name)
        else:
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=name)


def assert_untouched(model: onnx.ModelProto) -> None:
    """The pass reports no change and the model serialises exactly as before."""
    ir_model = ir.from_proto(model)
    reference = ir.to_proto(ir_model.clone()).SerializeToString()
    result = NormalizeSpellingsPass()(ir_model.clone())
    assert not result.modified
    assert ir.to_proto(result.model).SerializeToString() == reference


def producer(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    """The node of the main graph that outputs ``name``."""
    for node in model.graph.node:
        if name in node.output:
            return node
    raise KeyError(name)


def constant_names(model: onnx.ModelProto) -> set[str]:
    """The names of the main graph's initializers and Constant outputs."""
    names = {t.name for t in model.graph.initializer}
    names.update(n.output[0] for n in model.graph.node if n.op_type == "Constant")
    return names


def value_names(model: onnx.ModelProto) -> set[str]:
    """Every value name of the main graph."""
    g = model.graph
    names = {v.name for v in [*g.input, *g.output]} | {t.name for t in g.initializer}
    for node in g.node:
        names.update(n for n in [*node.input, *node.output] if n)
    return names


# -- tests of the pass as a whole ------------------------------------------------------------------

_CHAIN = """<ir_version: 10, opset_import: ["" : 24]>
g (float[N, 8] x) => (float[N, 6] y) <float[6, 8] w = {%s}, float[6] b = {%s}> {
  h = Gemm <transB = 1, alpha = 0.5> (x, w, b)
  two = Constant <value = float {2.0}> ()
  s = Mul(two, h)
  y = Swish <alpha = 0.25> (s)
}"""


def _floats(rng: np.random.Generator, n: int) -> str:
    return ", ".join(f"{v:.6f}" for v in rng.standard_normal(n))


def test_fixpoint_and_names(rng):
    model = parse(_CHAIN % (_floats(rng, 48), _floats(rng, 6)))
    after, modified = normalise(model)
    assert modified
    hist = ops(after)
    assert "Gemm" not in hist and "Swish" not in hist
    assert hist["MatMul"] == 1 and hist["Transpose"] == 1 and hist["Sigmoid"] == 1
    # the Gemm's alpha Mul and the commuted Mul(two, h) both end up constant-second
    constants = constant_names(after)
    for node in after.graph.node:
        if node.op_type == "Mul":
            assert node.input[0] not in constants, node
    assert producer(after, "s").input == ["h", "two"]
    before_names, after_names = value_names(model), value_names(after)
    # every value that stays keeps its name; the replaced outputs h, s, y keep theirs too
    assert {"x", "y", "w", "b", "h", "s"} <= after_names
    fresh = after_names - before_names
    assert len(fresh) == len(set(fresh)) and all("__canon" in n for n in fresh)
    assert_same(model, after, rng, rtol=1e-5, atol=1e-6, dims={"N": 5})


def test_replacements_carry_the_origin_tag(rng):
    ir_model = ir.from_proto(parse(_CHAIN % (_floats(rng, 48), _floats(rng, 6)))).clone()
    tag_origin(ir_model.graph)
    NormalizeSpellingsPass()(ir_model)
    tagged = {n.outputs[0].name: n.outputs[0].meta.get(ORIGIN_KEY) for n in ir_model.graph}
    # h (Gemm), s (commuted Mul) and y (Swish) are new values under the old names: tagged;
    # the intermediates the pass made are not in the original: untagged
    assert tagged["h"] and tagged["s"] and tagged["y"]
    assert not any(tag for name, tag in tagged.items() if "__canon" in name)


def test_clone_shares_tensors_untouched(rng):
    model = parse(_CHAIN % (_floats(rng, 48), _floats(rng, 6)))
    original = ir.from_proto(model)
    snapshot = {
        name: v.const_value.numpy().copy() for name, v in original.graph.initializers.items()
    }
    NormalizeSpellingsPass()(original.clone())
    for name, value in original.graph.initializers.items():
        np.testing.assert_array_equal(value.const_value.numpy(), snapshot[name])
    assert (
        ir.to_proto(original).SerializeToString()
        == ir.to_proto(ir.from_proto(model)).SerializeToString()
    )


def test_untouched_model_is_byte_identical():
    model = parse("""<ir_version: 10, opset_import: ["" : 24]>
    g (float[N, 8] x, float[8, 4] w) => (float[N, 4] y) {
      h = MatMul(x, w)
      s = Sigmoid(h)
      t = Mul(h, s)
      y = HardSwish(t)
    }""")
    assert_untouched(model)


def test_function_attribute_references_are_left_alone():
    # alpha is the function's attribute: its value is not known inside the body
    model = parse("""<ir_version: 10, opset_import: ["" : 24, "local" : 1]>
    g (float[4, 8] x, float[8, 8] w) => (float[4, 8] y) {
      y = local.f <a = 0.5> (x, w)
    }
    <domain: "local", opset_import: ["" : 24]>
    f <a> (x, w) => (y) {
      h = Gemm <alpha: float = @a> (x, w)
      y = Swish <alpha: float = @a> (h)
    }""")
    assert_untouched(model)


def test_subgraphs_are_normalised(rng):
    # a branch's Constant has no const_value from the rewriter: the rules read its node
    then_branch = onnx.parser.parse_graph("""then_b () => (float[4, 8] t) {
      c = Constant <value = float {3.0}> ()
      m = Mul(c, x)
      t = Swish <alpha = 0.5> (m)
    }""")
    else_branch = onnx.parser.parse_graph("""else_b () => (float[4, 8] e) {
      e = Einsum <equation = "ij,jk->ik"> (x, w)
    }""")
    node = onnx.helper.make_node(
        "If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch
    )
    info = onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(
        [node],
        "g",
        [
            info("cond", onnx.TensorProto.BOOL, []),
            info("x", onnx.TensorProto.FLOAT, [4, 8]),
            info("w", onnx.TensorProto.FLOAT, [8, 8]),
        ],
        [info("y", onnx.TensorProto.FLOAT, [4, 8])],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 24)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    after, modified = normalise(model)
    assert modified
    branches = {a.name: a.g for a in after.graph.node[0].attribute}
    then_nodes = {n.output[0]: n for n in branches["then_branch"].node}
    assert [n.op_type for n in branches["else_branch"].node] == ["MatMul"]
    assert "Swish" not in {n.op_type for n in then_nodes.values()}
    assert list(then_nodes["m"].input) == ["x", "c"]
    for cond in (True, False):
        feeds = {
            "cond": np.array(cond),
            "x": rng.standard_normal((4, 8)).astype(np.float32),
            "w": rng.standard_normal((8, 8)).astype(np.float32),
        }
        assert_same(model, after, rng, rtol=1e-5, atol=1e-5, feeds=feeds)
