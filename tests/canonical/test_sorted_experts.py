"""Tests of ``CanonicalSortedExpertsPass``: grouped_mm (sorted rows) experts -> GroupedMatMul.

On the exported ``mixtral_grouped_mm`` sample: the pass writes the per-slot form, keeps the
boundary names, leaves the original model's bytes alone, keeps the numbers (ORT CPU, with
GroupedMatMul decomposed into the Gather/MatMul form ORT runs), and ``fuse`` then fuses one MoE
matching the stored PyTorch output. Negative tests break one link of the proof in the sample
(an un-sort by another permutation, bin edges, expert order, a non-row-wise activation) and
check the block comes out byte-identical with a reason. The causal-LM exports in
``sample_models/exported/causal_lm`` (whole models, several families) fuse every layer their
metadata expects. A hypothesis property builds random hand-written blocks (sizes, activation,
biases, weight layout, floor-divide, weighting and un-sort spellings) and checks the numbers.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import onnx_moe_fuse
from onnx_moe_fuse.rewrites.canonical.sorted_experts import (
    CanonicalSortedExpertsPass,
    sorted_experts_refusals,
)

SAMPLE = Path(__file__).resolve().parents[2] / "sample_models" / "exported" / "mixtral_grouped_mm"
BOUNDARY = ("hidden_states", "view", "linear", "sum_2", "output")


# -- helpers -----------------------------------------------------------------------------------


def _sample() -> ir.Model:
    return ir.load(f"{SAMPLE}.onnx")


def _bytes(model: ir.Model) -> bytes:
    return ir.serde.serialize_model(model).SerializeToString()


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph)


def _run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3  # unused initializers of the rewritten block are not news
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _decomposed(model: ir.Model, opset: int) -> onnx.ModelProto:
    """A copy with each GroupedMatMul as Gather/Unsqueeze/MatMul/Squeeze (+ bias), at ``opset``."""
    work = model.clone()
    graph = work.graph
    for node in [n for n in graph if n.op_type == "GroupedMatMul"]:
        x, w, idx = node.inputs[:3]
        axes12 = ir.Value(name=f"{node.name}_a12", const_value=ir.tensor(np.array([1, 2])))
        axes2 = ir.Value(name=f"{node.name}_a2", const_value=ir.tensor(np.array([2])))
        graph.register_initializer(axes12)
        graph.register_initializer(axes2)
        sel = ir.node("Gather", [w, idx], {"axis": 0})  # [M, S, K, N]
        lhs = ir.node("Unsqueeze", [x, axes12])  # [M, 1, 1, K]
        mm = ir.node("MatMul", [lhs.outputs[0], sel.outputs[0]])  # [M, S, 1, N]
        out = ir.node("Squeeze", [mm.outputs[0], axes2])
        new = [sel, lhs, mm, out]
        if len(node.inputs) > 3 and node.inputs[3] is not None:  # + bias[idx]
            bias = ir.node("Gather", [node.inputs[3], idx], {"axis": 0})
            out = ir.node("Add", [out.outputs[0], bias.outputs[0]])
            new += [bias, out]
        ir.convenience.replace_nodes_and_values(graph, node, [node], new, node.outputs, out.outputs)
    work.opset_imports[""] = opset
    work.graph.opset_imports[""] = opset
    return ir.serde.serialize_model(work)


def _canonical(model: ir.Model) -> tuple[ir.Model, CanonicalSortedExpertsPass, bool]:
    work = model.clone()
    pss = CanonicalSortedExpertsPass()
    return work, pss, pss(work).modified


def _assert_refused(model: ir.Model, *words: str) -> None:
    """The pass leaves ``model`` byte-identical and gives a reason containing ``words``."""
    before = _bytes(model)
    work = model.clone()
    pss = CanonicalSortedExpertsPass()
    assert not pss(work).modified
    assert _bytes(work) == before
    assert len(pss.refusals) == 1, pss.refusals
    reason = pss.refusals[0][1]
    assert all(w in reason for w in words), reason
    assert sorted_experts_refusals(model) == pss.refusals


def _node_by_output(model: ir.Model, name: str) -> ir.Node:
    return next(n for n in model.graph if any(o.name == name for o in n.outputs))


# -- the exported sample -----------------------------------------------------------------------


def test_sample_becomes_per_slot_grouped_matmul():
    original = _sample()
    before = _bytes(original)
    work, pss, modified = _canonical(original)
    assert modified and pss.refusals == [] and sorted_experts_refusals(original) == []
    ops = _ops(work)
    assert ops["GroupedMatMul"] == 2
    for gone in ("ScatterND", "GatherND", "CumSum", "Range", "Less", "Squeeze"):
        assert ops[gone] == 0, gone
    assert [n.op_type for n in work.graph if n.op_type == "TopK"] == ["TopK"]  # the router's
    assert work.opset_imports[""] == 29
    names = {v.name for n in work.graph for v in [*n.inputs, *n.outputs] if v is not None}
    assert set(BOUNDARY) <= names
    # The per-slot FC1 reads the tokens and the router's ids, FC2 the stacked weights unchanged.
    fc1, fc2 = (n for n in work.graph if n.op_type == "GroupedMatMul")
    assert [v.name for v in fc1.inputs] == ["view", "transpose", "getitem_1"]
    assert fc2.inputs[1].name == "transpose_1"
    assert _node_by_output(work, "sum_2").op_type == "ReduceSum"
    assert _bytes(original) == before  # the pass ran on a clone and shares tensors only


def test_sample_pass_alone_keeps_the_numbers():
    original = _sample()
    work, _, _ = _canonical(original)
    src = ir.serde.serialize_model(original)
    canon = _decomposed(work, 20)
    rng = np.random.default_rng(7)
    for shape in [(1, 1), (1, 7), (3, 5), (4, 33)]:
        x = rng.standard_normal((*shape, 64), dtype=np.float32)
        (want,) = _run_ort(src, {"hidden_states": x})
        (got,) = _run_ort(canon, {"hidden_states": x})
        # Same products, summed by one batched MatMul instead of per-expert MatMuls.
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_sample_fuses_one_moe_that_matches_pytorch():
    work, _, _ = _canonical(_sample())
    result = onnx_moe_fuse.fuse(work)
    assert [f["op"] for f in result.report.fusions] == ["MoE"]
    ref = np.load(f"{SAMPLE}.npz")
    (got,) = _run_ort(result.model, {"hidden_states": ref["hidden_states"]})
    np.testing.assert_allclose(
        got, ref["output"], rtol=1e-4, atol=1e-4 * np.abs(ref["output"]).max()
    )


def test_sample_unsort_by_another_permutation_is_refused():
    model = _sample()
    graph = model.graph
    flat = next(v for n in graph for v in n.outputs if v.name == "view_3")
    k_all = next(v for n in graph for v in n.outputs if v.name == "val_19")
    # The argsort of other ids (the negated ones): a permutation, but not the block's.
    neg = ir.node("Neg", [flat])
    other = ir.node(
        "TopK", [neg.outputs[0], k_all], {"largest": 0, "sorted": 1, "axis": -1}, num_outputs=2
    )
    axes = next(v for n in graph for v in n.inputs if v is not None and v.name == "val_14")
    unsq = ir.node("Unsqueeze", [other.outputs[1], axes])
    scatter = _node_by_output(model, "val_164")
    graph.insert_before(scatter, [neg, other, unsq])
    scatter.replace_input_with(1, unsq.outputs[0])
    _assert_refused(model, "un-sort")
    # The broken model is valid and computes something else: fusing it would be wrong.
    x = np.random.default_rng(3).standard_normal((2, 5, 64), dtype=np.float32)
    (broken,) = _run_ort(ir.serde.serialize_model(model), {"hidden_states": x})
    (intact,) = _run_ort(ir.serde.serialize_model(_sample()), {"hidden_states": x})
    assert not np.allclose(broken, intact, rtol=1e-3, atol=1e-3)


def test_sample_bin_edges_that_miscount_are_refused():
    model = _sample()
    edges = model.graph.initializers["val_63"]
    shifted = edges.const_value.numpy() + np.float32(0.8)  # id 1 now lands in bin 0
    edges.const_value = ir.tensor(shifted, name="val_63")
    _assert_refused(model, "histogram")


def test_sample_swapped_expert_weights_are_refused():
    model = _sample()
    first, second = _node_by_output(model, "val_88"), _node_by_output(model, "val_94")
    a, b = first.inputs[0], second.inputs[0]
    first.replace_input_with(0, b)
    second.replace_input_with(0, a)
    _assert_refused(model, "FC1", "slice e")


def test_sample_swapped_fc2_segments_are_refused():
    model = _sample()
    concat = _node_by_output(model, "grouped_mm_fallback_1")
    a, b = concat.inputs[0], concat.inputs[1]
    concat.replace_input_with(0, b)
    concat.replace_input_with(1, a)
    _assert_refused(model, "FC2", "input 0")


def test_sample_activation_mixing_rows_is_refused():
    model = _sample()
    sigmoid = _node_by_output(model, "val_110")
    softmax = ir.node("Softmax", [sigmoid.inputs[0]], {"axis": 0})
    model.graph.insert_before(sigmoid, [softmax])
    sigmoid.replace_input_with(0, softmax.outputs[0])
    _assert_refused(model, "activation", "Softmax")


def test_sample_descending_sort_is_refused():
    model = _sample()
    sort = _node_by_output(model, "getitem_3")
    sort.attributes["largest"] = ir.AttrInt64("largest", 1)
    _assert_refused(model, "ascending")


def test_sample_token_rows_by_another_k_are_refused():
    model = _sample()
    div = _node_by_output(model, "val_29")
    three = ir.Value(name="three", const_value=ir.tensor(np.array(3, dtype=np.int64)))
    model.graph.register_initializer(three)
    div.replace_input_with(1, three)
    _assert_refused(model, "token rows")


def test_sample_escaping_sorted_activation_is_refused():
    model = _sample()
    silu = next(v for n in model.graph for v in n.outputs if v.name == "silu")
    model.graph.outputs.append(silu)
    _assert_refused(model, "activation", "graph output")


def test_sample_pass_reads_no_expert_weights():
    model = _sample()
    loads = collections.Counter()
    for name in ("transpose", "transpose_1", "gate.weight"):
        value = model.graph.initializers[name]
        tensor = value.const_value

        def load(tensor=tensor, name=name):
            loads[name] += 1
            return tensor

        value.const_value = ir.LazyTensor(load, dtype=tensor.dtype, shape=tensor.shape, name=name)
    work, _, modified = _canonical(model)
    assert modified and not loads  # K-major weights are reused, not read


def test_models_without_the_block_are_left_byte_identical():
    model = ir.load(str(SAMPLE.with_name("mixtral_batched_mm.onnx")))
    before = _bytes(model)
    work, pss, modified = _canonical(model)
    assert not modified and pss.refusals == [] and _bytes(work) == before


WHOLE_MODELS = sorted(SAMPLE.parent.glob("causal_lm/*grouped_mm*.onnx"))


@pytest.mark.parametrize("path", WHOLE_MODELS, ids=[p.stem for p in WHOLE_MODELS])
def test_whole_model_exports(path: Path):
    """Causal-LM exports (another helper writes them): what should fuse fuses, numbers kept.

    Where the export's metadata expects MoE layers, every layer is canonicalised and fused and
    the fused model matches PyTorch; where it expects none (routers MoE cannot express), the
    working copy, run with GroupedMatMul decomposed, still matches PyTorch.
    """
    meta = json.loads(path.with_suffix(".json").read_text())
    original = ir.load(str(path))
    work, pss, modified = _canonical(original)
    ref = np.load(path.with_suffix(".npz"))
    feeds = {"input_ids": ref["input_ids"]}
    scale = np.abs(ref["logits"]).max()
    if meta["expected"]:
        assert modified and pss.refusals == []
        result = onnx_moe_fuse.fuse(work)
        fused = collections.Counter(f["op"] for f in result.report.fusions)
        assert sorted(fused.items()) == sorted((op, n) for op, n in meta["expected"])
        (got,) = _run_ort(result.model, feeds)
    else:
        (got,) = _run_ort(_decomposed(work, original.opset_imports[""]), feeds)
    np.testing.assert_allclose(got, ref["logits"], rtol=1e-4, atol=1e-4 * scale)


# -- hand-written blocks -----------------------------------------------------------------------


@dataclass(frozen=True)
class BlockSpec:
    """One hand-written grouped_mm block; every random tensor comes from ``seed``."""

    experts: int = 4
    k: int = 2
    hidden: int = 8
    inner: int = 6
    activation: str = "swiglu"  # swiglu (Split of FC1), relu, gelu_tanh, bias_relu
    transposed: bool = False  # stacked weights [E, N, K], each used through Transpose
    floor_div: str = "torch"  # torch's Div/Mod/And spelling, or a plain integer Div
    unsort: str = "gathernd"  # gathernd / gather (ScatterElements inverse) / scatter_rows
    weight_first: bool = True  # routing weights applied before the un-sort
    bias: bool = False  # per-expert biases, added as Gather(bias, sorted ids)
    seed: int = 0


class _Graph:
    """Nodes and initializers of a hand-written graph, with generated value names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def const(self, array) -> str:
        self.count += 1
        name = f"c{self.count}"
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int = 1, **attrs) -> list[str]:
        self.count += 1
        names = [f"{op_type.lower()}{self.count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, **attrs))
        return names

    def one(self, op_type: str, inputs: list[str], **attrs) -> str:
        return self.op(op_type, inputs, **attrs)[0]


def _unsqueeze_last(g: _Graph, v: str) -> str:
    return g.one("Unsqueeze", [v, g.const(np.array([-1]))])


def build_block(spec: BlockSpec) -> onnx.ModelProto:
    """``y = x + moe(x)`` with the experts in the grouped_mm (sorted rows) form."""
    rng = np.random.default_rng(spec.seed)
    e, k, h, i = spec.experts, spec.k, spec.hidden, spec.inner
    n1 = 2 * i if spec.activation == "swiglu" else i
    g = _Graph()
    logits = g.one("MatMul", ["x", g.const(rng.standard_normal((h, e), dtype=np.float32))])
    probs = g.one("Softmax", [logits], axis=-1)
    vals, ids = g.op("TopK", [probs, g.const(np.array([k]))], 2, axis=-1)
    weights = g.one("Div", [vals, g.one("ReduceSum", [vals, g.const(np.array([-1]))])])
    flat = g.one("Reshape", [ids, g.const(np.array([-1]))])
    n = g.one(
        "Reshape",
        [g.one("Gather", [g.one("Shape", [flat]), g.const(np.array(-1))]), g.const(np.array([1]))],
    )
    sorted_ids, perm = g.op("TopK", [flat, n], 2, axis=-1, largest=0, sorted=1)
    kc = g.const(np.array(k))
    quotient = g.one("Div", [perm, kc])
    if spec.floor_div == "torch":
        negative = g.one(
            "Equal", [g.one("Less", [perm, g.const(np.array(0))]), g.const(np.array(True))]
        )
        inexact = g.one("Cast", [g.one("Mod", [perm, kc], fmod=0)], to=TensorProto.BOOL)
        fix = g.one("Cast", [g.one("And", [negative, inexact])], to=TensorProto.INT64)
        quotient = g.one("Sub", [quotient, fix])
    rows = g.one("GatherND", ["x", _unsqueeze_last(g, quotient)])
    # torch.histc(ids, bins=E, min=0, max=E-1) as the exporter writes it.
    f = g.one("Cast", [sorted_ids], to=TensorProto.FLOAT)
    ok = g.one(
        "And",
        [
            g.one("GreaterOrEqual", [f, g.const(np.float32(0))]),
            g.one("LessOrEqual", [f, g.const(np.float32(e - 1))]),
        ],
    )
    ok = g.one("And", [ok, g.one("Not", [g.one("IsNaN", [f])])])
    v = g.one("Where", [ok, f, g.const(np.float32(-1))])
    edges = np.linspace(0, e - 1, e + 1, dtype=np.float32)
    edges[-1] = np.nextafter(edges[-1], np.float32(np.inf))
    below = g.one(
        "Less", [g.one("Unsqueeze", [v, g.const(np.array([0]))]), g.const(edges[:, None])]
    )
    cnt = g.one(
        "ReduceSum",
        [g.one("Cast", [below], to=TensorProto.FLOAT), g.const(np.array([1]))],
        keepdims=0,
    )
    hi = g.one(
        "Slice", [cnt, g.const(np.array([1])), g.const(np.array([e + 1])), g.const(np.array([0]))]
    )
    lo = g.one(
        "Slice", [cnt, g.const(np.array([0])), g.const(np.array([-1])), g.const(np.array([0]))]
    )
    counts = g.one("Cast", [g.one("Sub", [hi, lo])], to=TensorProto.INT32)
    ends = g.one("Cast", [g.one("CumSum", [counts, g.const(np.array(0))])], to=TensorProto.INT64)
    zero, one, axis0 = g.const(np.array(0)), g.const(np.array(1)), g.const(np.array([0]))
    scalars = [
        g.one("Squeeze", [p, axis0]) for p in g.op("Split", [ends], e, axis=0, num_outputs=e)
    ]
    segments = [
        g.one("Range", [zero if j == 0 else scalars[j - 1], scalars[j], one]) for j in range(e)
    ]

    def grouped(lhs: str, stack: np.ndarray) -> str:
        n_out = stack.shape[2]
        if spec.transposed:
            stack = np.ascontiguousarray(stack.transpose(0, 2, 1))
        parts = g.op("Split", [g.const(stack)], e, axis=0, num_outputs=e)
        outs = []
        for j, part in enumerate(parts):
            w = g.one("Squeeze", [part, axis0])
            if spec.transposed:
                w = g.one("Transpose", [w], perm=[1, 0])
            outs.append(g.one("MatMul", [g.one("Gather", [lhs, segments[j]], axis=0), w]))
        out = g.one("Concat", outs, axis=0)
        if spec.bias:
            bias = rng.standard_normal((e, n_out), dtype=np.float32)
            out = g.one("Add", [out, g.one("Gather", [g.const(bias), sorted_ids], axis=0)])
        return out

    fc1 = grouped(rows, rng.standard_normal((e, h, n1), dtype=np.float32) * 0.5)
    if spec.activation == "swiglu":
        gate, up = g.op("Split", [fc1], 2, axis=1, num_outputs=2)
        act = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])
    elif spec.activation == "gelu_tanh":
        act = g.one("Gelu", [fc1], approximate="tanh")
    elif spec.activation == "bias_relu":
        act = g.one(
            "Relu", [g.one("Add", [fc1, g.const(rng.standard_normal((1, n1), dtype=np.float32))])]
        )
    else:
        act = g.one("Relu", [fc1])
    out = grouped(act, rng.standard_normal((e, i, h), dtype=np.float32) * 0.5)

    flat_w = g.one("Reshape", [weights, g.const(np.array([-1]))])
    if spec.weight_first:
        sorted_w = g.one("GatherND", [flat_w, _unsqueeze_last(g, perm)])
        out = g.one("Mul", [out, g.one("Unsqueeze", [sorted_w, g.const(np.array([-1]))])])
    if spec.unsort == "scatter_rows":
        blank = g.one("Expand", [g.const(np.float32(0)), g.one("Shape", [out])])
        out = g.one("ScatterND", [blank, _unsqueeze_last(g, perm), out])
    else:
        count = g.one("Squeeze", [g.one("Shape", [perm]), axis0])
        arange = g.one("Range", [zero, count, one])
        blank = g.one("Expand", [zero, g.one("Shape", [perm])])
        if spec.unsort == "gather":
            inverse = g.one("ScatterElements", [blank, perm, arange], axis=0)
            out = g.one("Gather", [out, inverse], axis=0)
        else:
            inverse = g.one("ScatterND", [blank, _unsqueeze_last(g, perm), arange])
            out = g.one("GatherND", [out, _unsqueeze_last(g, inverse)])
    if not spec.weight_first:
        out = g.one("Mul", [out, g.one("Unsqueeze", [flat_w, g.const(np.array([-1]))])])
    slots = g.one("Reshape", [out, g.const(np.array([-1, k, h]))])
    g.nodes.append(
        helper.make_node("ReduceSum", [slots, g.const(np.array([1]))], ["moe_out"], keepdims=0)
    )
    g.nodes.append(helper.make_node("Add", ["x", "moe_out"], ["y"]))
    graph = helper.make_graph(
        g.nodes,
        "sorted_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", h])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", h])],
        g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


SPECS = st.integers(2, 6).flatmap(
    lambda experts: st.builds(
        BlockSpec,
        experts=st.just(experts),
        k=st.integers(1, min(3, experts)),
        hidden=st.integers(2, 12),
        inner=st.integers(1, 10),
        activation=st.sampled_from(["swiglu", "relu", "gelu_tanh", "bias_relu"]),
        transposed=st.booleans(),
        floor_div=st.sampled_from(["torch", "div"]),
        unsort=st.sampled_from(["gathernd", "gather", "scatter_rows"]),
        weight_first=st.booleans(),
        bias=st.booleans(),
        seed=st.integers(0, 2**31 - 1),
    )
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=SPECS, tokens=st.integers(1, 9))
def test_hand_written_blocks_keep_their_numbers(spec: BlockSpec, tokens: int):
    proto = build_block(spec)
    model = ir.serde.deserialize_model(proto)
    work, pss, modified = _canonical(model)
    assert modified, pss.refusals
    ops = _ops(work)
    assert ops["GroupedMatMul"] == 2 and ops["CumSum"] == 0 and ops["TopK"] == 1
    assert "moe_out" in {o.name for n in work.graph for o in n.outputs}
    x = np.random.default_rng(spec.seed + 1).standard_normal(
        (tokens, spec.hidden), dtype=np.float32
    )
    (want,) = _run_ort(proto, {"x": x})
    (got,) = _run_ort(_decomposed(work, 20), {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("activation", "bias"), [("swiglu", False), ("relu", True)])
def test_hand_written_swiglu_and_relu_blocks_fuse(activation: str, bias: bool):
    spec = BlockSpec(activation=activation, transposed=True, unsort="gather", bias=bias, seed=3)
    proto = build_block(spec)
    work, _, _ = _canonical(ir.serde.deserialize_model(proto))
    result = onnx_moe_fuse.fuse(work)
    assert [f["op"] for f in result.report.fusions] == ["MoE"], result.report.to_dict()
    x = np.random.default_rng(5).standard_normal((7, spec.hidden), dtype=np.float32)
    (want,) = _run_ort(proto, {"x": x})
    (got,) = _run_ort(result.model, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_hand_written_block_with_transposed_weights_leaves_the_original_tensor():
    proto = build_block(BlockSpec(transposed=True, seed=11))
    model = ir.serde.deserialize_model(proto)
    stacks = {
        n: v.const_value.numpy().copy()
        for n, v in model.graph.initializers.items()
        if v.const_value.numpy().ndim == 3
    }
    work, _, modified = _canonical(model)
    assert modified
    for name, array in stacks.items():
        np.testing.assert_array_equal(model.graph.initializers[name].const_value.numpy(), array)
    fc1 = next(n for n in work.graph if n.op_type == "GroupedMatMul")
    assert fc1.inputs[1].name not in stacks  # a transposed copy, under a fresh name
