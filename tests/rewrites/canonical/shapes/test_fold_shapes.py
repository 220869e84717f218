"""FoldShapesPass alone: shape arithmetic folded, symbolic shapes simplified, GroupedMatMul bodies.

Each test builds a small model, runs the pass on a clone of its onnx-ir form, checks the
canonical form (op histogram, the constants the shape inputs became) and that ONNX Runtime CPU
(graph optimisations off) computes the same as before on fresh random inputs; the negative tests
check that what the pass must leave alone comes out with the same nodes. The last tests write an
MoE layer from the GroupedMatMul function body (ONNX opset 29) at opset 21 and show that
``onnx_moe_fuse.fuse`` fuses it once the pass has run, and not before.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

from onnx_moe_fuse import fuse
from onnx_moe_fuse.rewrites.canonical.shapes.fold_shapes import FoldShapesPass
from onnx_moe_fuse.samples import all_samples
from onnx_moe_fuse.samples.handwritten import HANDWRITTEN

SHAPE_OPS = {"Shape", "Gather", "Concat", "Slice", "Mul", "Div", "Squeeze", "Unsqueeze"}


# -- helpers -----------------------------------------------------------------------------------


def run_pass(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """The model after the pass (run on a clone of its onnx-ir form) and whether it changed."""
    original = ir.from_proto(model)
    work = original.clone()
    result = FoldShapesPass()(work)
    return ir.to_proto(result.model), result.modified


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), so, ["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict) -> None:
    """Bit-exact: the pass only moves shapes around, the arithmetic is the same."""
    for want, got in zip(ort_run(before, feeds), ort_run(after, feeds), strict=True):
        assert want.shape == got.shape
        np.testing.assert_array_equal(got, want)


def histogram(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)


def node_of(model: onnx.ModelProto, output: str) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if output in n.output]
    return node


def const_input(model: onnx.ModelProto, node: onnx.NodeProto, index: int) -> list[int]:
    """The constant (initializer or Constant node) feeding input ``index`` of ``node``."""
    name = node.input[index]
    for init in model.graph.initializer:
        if init.name == name:
            return nh.to_array(init).reshape(-1).tolist()
    producer = node_of(model, name)
    assert producer.op_type == "Constant", f"{name} comes from {producer.op_type}"
    return nh.to_array(producer.attribute[0].t).reshape(-1).tolist()


def parse(text: str, **inits: np.ndarray) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend(nh.from_array(v, k) for k, v in inits.items())
    onnx.checker.check_model(model)
    return model


HEADER = '<ir_version: 10, opset_import: ["" : 21]>'


# -- folding to constants ----------------------------------------------------------------------


def test_static_shape_chain_becomes_a_constant_target(rng):
    model = parse(
        HEADER
        + """
        g (float[4, 6, 8] x) => (float[4, 48] y) {
            s = Shape(x)
            i0 = Constant <value = int64[1] {0}> ()
            i1 = Constant <value = int64[1] {1}> ()
            i2 = Constant <value = int64[1] {2}> ()
            d0 = Gather <axis = 0> (s, i0)
            d1 = Gather <axis = 0> (s, i1)
            d2 = Gather <axis = 0> (s, i2)
            d12 = Mul(d1, d2)
            target = Concat <axis = 0> (d0, d12)
            y = Reshape(x, target)
        }"""
    )
    after, modified = run_pass(model)
    assert modified
    assert histogram(after) & collections.Counter(SHAPE_OPS) == collections.Counter()
    assert const_input(after, node_of(after, "y"), 1) == [4, 48]
    assert_same_outputs(model, after, {"x": rng.standard_normal((4, 6, 8)).astype(np.float32)})


def test_shape_of_an_undeclared_intermediate_folds_through_its_producer(rng):
    """No value_info on ``u``: its shape comes from the Unsqueeze of a static input."""
    model = parse(
        HEADER
        + """
        g (float[3, 5] x) => (float[15] y) {
            ax = Constant <value = int64[1] {0}> ()
            u = Unsqueeze(x, ax)
            s = Shape <start = 1> (u)
            n = ReduceProd <keepdims = 1> (s)
            y = Reshape(x, n)
        }"""
    )
    after, _ = run_pass(model)
    assert const_input(after, node_of(after, "y"), 1) == [15]
    assert "Shape" not in histogram(after)
    assert_same_outputs(model, after, {"x": rng.standard_normal((3, 5)).astype(np.float32)})


def test_exact_division_of_symbolic_products_folds(rng):
    """``Div(T*4, T)`` is 4 for every T: Range, ConstantOfShape and Split read constants."""
    model = parse(
        HEADER
        + """
        g (float[T, 8] x) => (float[T, 4] a, float[T, 4] b, int64[4] r, float[4] z) {
            s = Shape(x)
            i0 = Constant <value = int64[1] {0}> ()
            i1 = Constant <value = int64[1] {1}> ()
            four = Constant <value = int64[1] {4}> ()
            two = Constant <value = int64[1] {2}> ()
            t = Gather <axis = 0> (s, i0)
            h = Gather <axis = 0> (s, i1)
            t4 = Mul(t, four)
            q = Div(t4, t)
            half = Div(h, two)
            sizes = Concat <axis = 0> (half, half)
            a, b = Split <axis = 1> (x, sizes)
            zero = Constant <value = int64 {0}> ()
            one = Constant <value = int64 {1}> ()
            limit = Squeeze(q)
            r = Range(zero, limit, one)
            z = ConstantOfShape <value = float[1] {0.5}> (q)
        }"""
    )
    after, _ = run_pass(model)
    hist = histogram(after)
    assert hist["Shape"] == hist["Div"] == hist["Mul"] == 0
    assert const_input(after, node_of(after, "a"), 1) == [4, 4]
    assert const_input(after, node_of(after, "z"), 0) == [4]
    assert const_input(after, node_of(after, "r"), 1) == [4]
    for t in (1, 5):
        assert_same_outputs(model, after, {"x": rng.standard_normal((t, 8)).astype(np.float32)})


# -- symbolic targets --------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(
    dims=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    symbolic=st.lists(st.booleans(), min_size=4, max_size=4),
    split=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_symbolic_reshape_targets_become_copies_and_one_inferred_dim(dims, symbolic, split, seed):
    """Keep dims ``< split`` (-> 0 copies), merge the rest by Mul (-> -1 or a number)."""
    rank = len(dims)
    split = min(split, rank - 1)
    names = [f"D{i}" if symbolic[i] else d for i, d in enumerate(dims)]
    nodes = [oh.make_node("Shape", ["x"], ["s"])]
    inits = []
    for i in range(rank):
        inits.append(nh.from_array(np.array([i], np.int64), f"i{i}"))
        nodes.append(oh.make_node("Gather", ["s", f"i{i}"], [f"d{i}"], axis=0))
    merged = f"d{split}"
    for i in range(split + 1, rank):
        nodes.append(oh.make_node("Mul", [merged, f"d{i}"], [f"m{i}"]))
        merged = f"m{i}"
    parts = [f"d{i}" for i in range(split)] + [merged]
    nodes.append(oh.make_node("Concat", parts, ["target"], axis=0))
    nodes.append(oh.make_node("Reshape", ["x", "target"], ["y"]))
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, names)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)
    after, _ = run_pass(model)
    assert "Shape" not in histogram(after)
    reshape = node_of(after, "y")
    if reshape.op_type == "Identity":  # onnxscript's folder: a Reshape to the input's own shape
        assert split == rank - 1
    else:
        target = const_input(after, reshape, 1)
        for i in range(split):
            assert target[i] == (0 if symbolic[i] else dims[i])
        rest_is_ones = not any(symbolic[split + 1 : rank]) and all(
            d == 1 for d in dims[split + 1 :]
        )
        if symbolic[split] and rest_is_ones:  # the merged dim is the input's own: a copy
            assert target[split] == 0
        elif any(symbolic[split:rank]):
            assert target[split] == -1
        else:
            assert target[split] == int(np.prod(dims[split:]))
    rng = np.random.default_rng(seed)
    actual = [int(rng.integers(1, 5)) if symbolic[i] else d for i, d in enumerate(dims)]
    feeds = {"x": rng.standard_normal(actual).astype(np.float32)}
    assert_same_outputs(model, after, feeds)


def test_expand_shape_keeps_the_inputs_own_dims_as_ones(rng):
    model = parse(
        HEADER
        + """
        g (float[T, 16] x) => (float[T, 3, 16] y) {
            ax = Constant <value = int64[1] {1}> ()
            u = Unsqueeze(x, ax)
            s = Shape(x)
            c0 = Constant <value = int64[1] {0}> ()
            c1 = Constant <value = int64[1] {1}> ()
            c2 = Constant <value = int64[1] {2}> ()
            t = Slice(s, c0, c1)
            h = Slice(s, c1, c2)
            k = Constant <value = int64[1] {3}> ()
            shape = Concat <axis = 0> (t, k, h)
            y = Expand(u, shape)
        }"""
    )
    after, _ = run_pass(model)
    assert const_input(after, node_of(after, "y"), 1) == [1, 3, 16]  # T -> 1, H is a number
    assert "Shape" not in histogram(after)
    assert_same_outputs(model, after, {"x": rng.standard_normal((5, 16)).astype(np.float32)})


def test_reshape_that_keeps_the_shape_is_dropped(rng):
    model = parse(
        HEADER
        + """
        g (float[T, 16] x) => (float[T, 16] y) {
            s = Shape(x)
            c0 = Constant <value = int64[1] {0}> ()
            c16 = Constant <value = int64[1] {16}> ()
            t = Gather <axis = 0> (s, c0)
            target = Concat <axis = 0> (t, c16)
            same = Reshape(x, target)
            y = Relu(same)
        }"""
    )
    after, _ = run_pass(model)
    assert histogram(after) == collections.Counter({"Relu": 1})
    assert node_of(after, "y").input[0] == "x"
    assert_same_outputs(model, after, {"x": rng.standard_normal((3, 16)).astype(np.float32)})


# -- left alone --------------------------------------------------------------------------------


def node_bytes(model: onnx.ModelProto) -> list[bytes]:
    """The serialized nodes, as onnx-ir writes them (the pass's output is written by onnx-ir)."""
    model = ir.to_proto(ir.from_proto(model))
    return [n.SerializeToString() for n in model.graph.node]


@pytest.mark.parametrize(
    "body",
    [
        # data-dependent: the target is a graph input
        "g (float[T, 16] x, int64[2] target) => (float[A, B] y) { y = Reshape(x, target) }",
        # two unknown entries that are not the input's dims at their places
        """g (float[T, 16] x, float[P, Q] w) => (float[A, B] y) {
            s = Shape(w)
            c0 = Constant <value = int64[1] {0}> ()
            c1 = Constant <value = int64[1] {1}> ()
            q = Gather <axis = 0> (s, c1)
            p = Gather <axis = 0> (s, c0)
            target = Concat <axis = 0> (q, p)
            y = Reshape(x, target)
        }""",
        # an Expand dim tied to another tensor's dim, not the input's
        """g (float[T, 1] x, float[P] w) => (float[A, B] y) {
            s = Shape(w)
            c1 = Constant <value = int64[1] {1}> ()
            shape = Concat <axis = 0> (s, c1)
            y = Expand(x, shape)
        }""",
        # the Shape of a data-dependent tensor (NonZero: its dims depend on the values)
        """g (float[T, 4] x, float[P] v) => (float[A, B] y) {
            nz = NonZero(x)
            s = Shape(nz)
            y = Reshape(v, s)
        }""",
    ],
)
def test_unprovable_shapes_are_left_alone(body):
    model = parse(HEADER + body)
    after, modified = run_pass(model)
    assert not modified
    assert node_bytes(after) == node_bytes(model)


def test_weights_behind_layout_ops_are_not_folded(rng):
    """Only integer shape arithmetic is folded: a Transpose / DequantizeLinear of a weight stays."""
    w = rng.integers(-8, 8, (4, 6)).astype(np.int8)
    scale = np.float32(0.25)
    model = parse(
        HEADER
        + """
        g (float[T, 4] x) => (float[T, 6] y) {
            wf = DequantizeLinear(w, scale)
            y = MatMul(x, wf)
        }""",
        w=w,
        scale=np.array(scale),
    )
    after, modified = run_pass(model)
    assert not modified
    assert node_bytes(after) == node_bytes(model)


def test_values_keep_their_names_and_new_ones_are_fresh(rng):
    model = grouped_matmul_layer(rng, bias=True)
    before = {v for n in model.graph.node for v in n.output}
    after, _ = run_pass(model)
    outputs = [v for n in after.graph.node for v in n.output]
    assert len(outputs) == len(set(outputs))  # no collision among the new names
    kept = {"y", "topk_indices", "topk_values", "routing_weights", "swiglu", "fc2_out"}
    assert kept <= before and kept <= set(outputs)
    assert [o.name for o in after.graph.output] == ["y"]


# -- the GroupedMatMul function body -----------------------------------------------------------


class Writer:
    """Writes nodes and initializers with unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        name = f"{name}_{len(self.inits)}"
        self.inits.append(nh.from_array(np.asarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], out: str, **attrs) -> str:
        self.nodes.append(oh.make_node(op, inputs, [out], name=f"node_{out}", **attrs))
        return out

    def grouped_matmul(self, tag: str, x: str, w: str, idx: str, bias: str | None = None) -> str:
        """The GroupedMatMul function body of onnx (opset 29), node for node, at opset 21."""
        zero, one, two = (self.const(f"{tag}_index", np.array([i], np.int64)) for i in (0, 1, 2))
        x_shape = self.node("Shape", [x], f"{tag}_input_shape")
        w_shape = self.node("Shape", [w], f"{tag}_weights_shape")
        i_shape = self.node("Shape", [idx], f"{tag}_indices_shape")
        m = self.node("Gather", [x_shape, zero], f"{tag}_M", axis=0)
        k = self.node("Gather", [x_shape, one], f"{tag}_K", axis=0)
        n = self.node("Gather", [w_shape, two], f"{tag}_N", axis=0)
        s = self.node("Gather", [i_shape, one], f"{tag}_S", axis=0)
        ms = self.node("Mul", [m, s], f"{tag}_MS")
        flat = self.node("Reshape", [idx, ms], f"{tag}_indices_flat", allowzero=1)
        selected = self.node("Gather", [w, flat], f"{tag}_selected_weights", axis=0)
        unsq = self.node("Unsqueeze", [x, one], f"{tag}_input_unsqueezed")
        expanded_shape = self.node("Concat", [m, s, k], f"{tag}_expanded_shape", axis=0)
        expanded = self.node("Expand", [unsq, expanded_shape], f"{tag}_input_expanded")
        rows_shape = self.node("Concat", [ms, one, k], f"{tag}_matmul_input_shape", axis=0)
        rows = self.node("Reshape", [expanded, rows_shape], f"{tag}_matmul_input", allowzero=1)
        product = self.node("MatMul", [rows, selected], f"{tag}_matmul_result")
        out_shape = self.node("Concat", [m, s, n], f"{tag}_output_shape", axis=0)
        result = self.node("Reshape", [product, out_shape], f"{tag}_result", allowzero=1)
        if bias is None:
            return self.node("Identity", [result], f"{tag}_output")
        sel_bias = self.node("Gather", [bias, flat], f"{tag}_selected_bias", axis=0)
        bias_3d = self.node("Reshape", [sel_bias, out_shape], f"{tag}_reshaped_bias", allowzero=1)
        return self.node("Add", [result, bias_3d], f"{tag}_output")


def grouped_matmul_layer(
    rng: np.random.Generator, *, bias: bool = False, hidden: int = 16, inter: int = 8, k: int = 2
) -> onnx.ModelProto:
    """A Mixtral-like MoE layer whose three projections are GroupedMatMul function bodies.

    FC1 (gate, up) on the tokens ``[T, H]`` with the ``[T, k]`` top-k ids; FC2 on the
    activation flattened to ``[T*k, I]`` rows with ``[T*k, 1]`` ids, reshaped back to
    ``[T, k, H]`` (how the GroupedMatMul sample spelling writes FC2). ``bias``: the gate and
    the down projection have per-expert biases (the body's fourth input).
    """
    experts = 4
    g = Writer()

    def weight(name: str, *shape: int) -> str:
        return g.const(name, (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32))

    logits = g.node("MatMul", ["x", weight("router", hidden, experts)], "router_logits")
    probs = g.node("Softmax", [logits], "router_probs", axis=-1)
    g.nodes.append(
        oh.make_node(
            "TopK", [probs, g.const("k", np.array([k], np.int64))], ["topk_values", "topk_indices"]
        )
    )
    total = g.node(
        "ReduceSum", ["topk_values", g.const("ax", np.array([-1], np.int64))], "topk_sum"
    )
    routing = g.node("Div", ["topk_values", total], "routing_weights")
    gate_bias = down_bias = None
    if bias:
        gate_bias = g.const("gate_bias", (0.1 * rng.standard_normal((experts, inter))).astype("f4"))
        down_bias = g.const(
            "down_bias", (0.1 * rng.standard_normal((experts, hidden))).astype("f4")
        )
    gate = g.grouped_matmul(
        "gate", "x", weight("gate", experts, hidden, inter), "topk_indices", gate_bias
    )
    up = g.grouped_matmul("up", "x", weight("up", experts, hidden, inter), "topk_indices")
    silu = g.node("Mul", [gate, g.node("Sigmoid", [gate], "gate_sigmoid")], "gate_silu")
    act = g.node("Mul", [silu, up], "swiglu")
    rows = g.node("Reshape", [act, g.const("rows", np.array([-1, inter], np.int64))], "fc2_rows")
    row_ids = g.node(
        "Reshape", ["topk_indices", g.const("ids", np.array([-1, 1], np.int64))], "fc2_row_ids"
    )
    down_weight = weight("down", experts, inter, hidden)
    down = g.grouped_matmul("down", rows, down_weight, row_ids, down_bias)
    per_slot = g.node(
        "Reshape", [down, g.const("slots", np.array([-1, k, hidden], np.int64))], "fc2_out"
    )
    w3 = g.node("Unsqueeze", [routing, g.const("ax", np.array([-1], np.int64))], "routing_3d")
    weighted = g.node("Mul", [per_slot, w3], "weighted")
    g.node("ReduceSum", [weighted, g.const("ax", np.array([1], np.int64))], "y", keepdims=0)
    graph = oh.make_graph(
        g.nodes,
        "grouped_matmul_body_layer",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["T", hidden])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["T", hidden])],
        g.inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_matmul_body_becomes_the_per_slot_form(rng, bias):
    model = grouped_matmul_layer(rng, bias=bias)
    after, modified = run_pass(model)
    assert modified
    hist = histogram(after)
    assert hist["Shape"] == hist["Concat"] == hist["Expand"] == hist["Identity"] == 0
    assert hist["Gather"] == 3 + 2 * bias and hist["MatMul"] == 4  # router + 3 experts
    fc2 = node_of(after, "fc2_out")
    if bias:  # Add(Reshape(product), Gather(bias, ids)), as the per-slot rule reads it
        assert fc2.op_type == "Add"
        fc2, bias_rows = (node_of(after, v) for v in fc2.input)
        assert bias_rows.op_type == "Gather" and bias_rows.input[1] == "topk_indices"
    assert fc2.op_type == "Reshape" and const_input(after, fc2, 1) == [-1, 2, 16]
    matmul = node_of(after, fc2.input[0])
    lhs, selected = (node_of(after, v) for v in matmul.input)
    assert (lhs.op_type, selected.op_type) == ("Unsqueeze", "Gather")
    assert lhs.input[0] == "swiglu" and selected.input[1] == "topk_indices"
    for t in (1, 6):
        feeds = {"x": rng.standard_normal((t, 16)).astype(np.float32)}
        assert_same_outputs(model, after, feeds)


@pytest.mark.parametrize(("bias", "k"), [(False, 2), (True, 2), (False, 1)])
def test_grouped_matmul_body_layer_fuses_after_the_pass(rng, bias, k, monkeypatch):
    """Top-2 with and without biases, and top-1 (S = 1: the body's Expand is a no-op)."""
    model = grouped_matmul_layer(rng, bias=bias, k=k)
    with monkeypatch.context() as m:  # the rules alone: the shape arithmetic hides the layer
        m.setattr(
            "onnx_moe_fuse.pipeline.canonicalise.canonicalisation_passes", lambda refusals=None: []
        )
        assert not fuse(model).report.fusions
    canonical, _ = run_pass(model)
    result = fuse(canonical)
    assert len(result.report.fusions) == 1, result.report.near_misses
    fused = result.model
    assert [n.op_type for n in fused.graph.node if n.domain == "com.microsoft"] == ["MoE"]
    for t in (1, 7):
        feeds = {"x": rng.standard_normal((t, 16)).astype(np.float32)}
        (want,), (got,) = ort_run(model, feeds), ort_run(fused, feeds)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))


# -- every sample ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sample", [s for s in all_samples() if s.opset <= 23], ids=lambda s: s.name
)
def test_samples_compute_the_same_and_fuse_the_same(sample, rng):
    """On a layer already in a rule's form, the pass changes nothing the rules or ORT see."""
    after, _ = run_pass(sample.model)
    dims = sample.dim_values or {}
    feeds = {}
    for value in sample.model.graph.input:
        shape = [dims.get(d.dim_param, d.dim_value) for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    assert_same_outputs(sample.model, after, feeds)
    assert len(fuse(after).report.fusions) == len(fuse(sample.model).report.fusions)


EXPORTED = sorted(
    (Path(__file__).resolve().parents[4] / "sample_models" / "exported").glob("*.onnx")
)


def _feeds(model: onnx.ModelProto, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {}
    for value in model.graph.input:
        shape = [
            d.dim_value if d.HasField("dim_value") else 3 for d in value.type.tensor_type.shape.dim
        ]
        dtype = oh.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


@pytest.mark.parametrize("name", [p.stem for p in EXPORTED] + sorted(HANDWRITTEN), ids=lambda n: n)
def test_exports_and_handwritten_layers_compute_the_same_and_lose_no_fusion(name, rng):
    """The committed exports and the hand-written layers: exact outputs, no fusion lost."""
    path = next((p for p in EXPORTED if p.stem == name), None)
    model = onnx.load(path) if path is not None else HANDWRITTEN[name]()[0]
    original = ir.from_proto(model)
    before = ir.to_proto(original).SerializeToString()
    result = FoldShapesPass()(original.clone())
    assert ir.to_proto(original).SerializeToString() == before  # the clone shares the tensors
    after = ir.to_proto(result.model)
    feeds = _feeds(model, rng)
    if path is not None and path.with_suffix(".npz").exists():
        # an export's own reference input: the traced eager loop (mixtral_eager_torchscript)
        # only runs on inputs that hit every expert its example hit, and that one does
        reference = np.load(path.with_suffix(".npz"))
        feeds = {k: reference[k] for k in feeds if k in reference} or feeds
    assert_same_outputs(model, after, feeds)
    assert len(fuse(after).report.fusions) >= len(fuse(model).report.fusions)


@settings(max_examples=15, deadline=None)
@given(
    m=st.integers(1, 5),
    k=st.integers(1, 6),
    n=st.integers(1, 6),
    groups=st.integers(1, 4),
    slots=st.integers(1, 3),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_one_grouped_matmul_body_becomes_per_slot_and_stays_exact(
    m, k, n, groups, slots, bias, seed
):
    """Any sizes: the body on ``[M, K]`` tokens and ``[M, S]`` indices -> Gather(W, idx) form."""
    rng = np.random.default_rng(seed)
    g = Writer()
    w = g.const("w", rng.standard_normal((groups, k, n)).astype(np.float32))
    b = g.const("b", rng.standard_normal((groups, n)).astype(np.float32)) if bias else None
    g.nodes.append(oh.make_node("Identity", [g.grouped_matmul("fc", "x", w, "idx", b)], ["y"]))
    graph = oh.make_graph(
        g.nodes,
        "body",
        [
            oh.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k]),
            oh.make_tensor_value_info("idx", TensorProto.INT64, ["M", slots]),
        ],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["M", slots, n])],
        g.inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)
    after, _ = run_pass(model)
    hist = histogram(after)
    assert hist["Shape"] == hist["Concat"] == hist["Expand"] == 0
    assert hist["Gather"] == 1 + bias and hist["MatMul"] == 1
    assert all(node.input[1] == "idx" for node in after.graph.node if node.op_type == "Gather")
    feeds = {
        "x": rng.standard_normal((m, k)).astype(np.float32),
        "idx": rng.integers(0, groups, (m, slots)).astype(np.int64),
    }
    assert_same_outputs(model, after, feeds)
