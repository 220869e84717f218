"""``CanonicalDenseExpertsPass``: the dense all-experts MoE form -> the per-slot form.

Each builder of :mod:`dense_models` (unrolled experts + Equal masks + Add chain; stacked experts
+ OneHot + ReduceSum over E; stacked experts + ScatterElements + MatMul combine) runs in ONNX
Runtime and matches numpy. After the pass the layer is in the per-slot GroupedMatMul form, keeps
its boundary names, and today's ``fuse`` emits one MoE / QMoE that matches ORT on the original
dense model within 1e-5 (relative to the output's scale) on fresh random tokens. What the pass
must refuse stays byte-for-byte as it was, with a reason.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from dense_models import DenseSpec, build_dense, reference, with_int8_experts
from helpers import nonzero_rel_err
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnx_moe_fuse import fuse
from onnx_moe_fuse.rewrites.canonical.experts.dense.dense_experts import (
    CanonicalDenseExpertsPass,
    dense_experts_refusals,
)
from onnx_moe_fuse.samples import all_samples
from onnx_moe_fuse.verify.ort_nodes import session

TOL = 1e-5
FORMS = ("unrolled", "onehot", "scatter")
ACTIVATIONS = ("swiglu", "swiglu_oss", "relu", "gelu")
MASK_OPS = {"Equal", "OneHot", "ScatterElements", "Transpose", "Cast", "ConstantOfShape"}
BOUNDARY = ("x", "router_logits", "router_topk_values", "router_topk_idx", "y")


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return session(model).run(None, {"x": x})[0]


def canonical(model: onnx.ModelProto) -> tuple[ir.Model, bool]:
    """The pass on a working copy (``clone()``: shares the tensors with ``model``'s IR)."""
    working = ir.serde.deserialize_model(model).clone()
    result = CanonicalDenseExpertsPass()(working)
    return working, result.modified


def ops(model: ir.Model) -> collections.Counter[str]:
    return collections.Counter(n.op_type for n in model.graph)


def tokens(rng: np.random.Generator, spec: DenseSpec, count: int = 9) -> np.ndarray:
    return rng.standard_normal((count, spec.hidden)).astype(np.float32)


def fuses_to(spec: DenseSpec) -> str | None:
    """The op today's rules emit for the canonical form, None where they refuse it."""
    if not spec.int4:
        return "MoE"
    return "QMoE" if spec.renorm and spec.activation != "gelu" else None


ALL_SPECS = [
    DenseSpec(form=f, activation=a, int4=q, bias=b, renorm=r)
    for f, a, q, b, r in itertools.product(
        FORMS, ACTIVATIONS, (False, True), (False, True), (True, False)
    )
]
FUSING = [s for s in ALL_SPECS if fuses_to(s)]
VARIANTS = [DenseSpec(form=f, activation=a, variant=True) for f in FORMS for a in ACTIVATIONS]


def spec_id(spec: DenseSpec) -> str:
    weights = "nbits" if spec.nbits else "int4" if spec.int4 else "f32"
    return (
        f"{spec.form}-{spec.activation}-{weights}{'-bias' if spec.bias else ''}"
        f"-{'renorm' if spec.renorm else 'raw'}{'-variant' if spec.variant else ''}"
    )


# -- the builders ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL_SPECS[::3] + VARIANTS, ids=spec_id)
def test_builder_matches_numpy(spec: DenseSpec, rng: np.random.Generator) -> None:
    x = tokens(rng, spec)
    assert nonzero_rel_err(run(build_dense(spec), x), reference(spec, x)) < TOL


# -- the canonical form ------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_canonical_form_and_names(form: str, activation: str) -> None:
    spec = DenseSpec(form=form, activation=activation, bias=True)
    model = build_dense(spec)
    working, modified = canonical(model)
    assert modified
    counts = ops(working)
    fc1 = 2 if activation == "swiglu" else 1
    assert counts["GroupedMatMul"] == fc1 + 1, counts
    assert counts["MatMul"] == 1, counts  # only the router is left
    assert counts["TopK"] == 1 and not MASK_OPS & set(counts), counts
    assert working.graph.opset_imports[""] == 29
    names = [v.name for n in working.graph for v in n.outputs]
    assert len(names) == len(set(names)), "a new value name collides"
    present = set(names) | {v.name for v in working.graph.inputs}
    assert set(BOUNDARY) <= present
    (out,) = working.graph.outputs
    assert out.name == "y" and out.producer().op_type == "ReduceSum"
    gmm = [n for n in working.graph if n.op_type == "GroupedMatMul"]
    assert all(n.inputs[2].name == "router_topk_idx" for n in gmm[:fc1])
    assert gmm[0].inputs[0].name == "x"
    assert all(len(n.inputs) == 4 for n in gmm), "biases are GroupedMatMul's 4th input"
    assert dense_experts_refusals(ir.serde.deserialize_model(model)) == []


@pytest.mark.parametrize("spec", VARIANTS, ids=spec_id)
def test_variant_spellings_canonical(spec: DenseSpec) -> None:
    """Swapped operands, keepdims=0 masks, an Add tree, tokens Expand-ed to [E, T, H]."""
    working, modified = canonical(build_dense(spec))
    assert modified
    counts = ops(working)
    assert not {"Expand", "Equal", "Cast"} & set(counts), counts
    assert counts["Add"] == (spec.activation == "swiglu_oss"), counts  # only oss's linear + 1
    assert counts["Unsqueeze"] == 1 and counts["MatMul"] == 1, counts


def test_stacked_weights_are_expert_ordered_and_k_major() -> None:
    spec = DenseSpec(form="unrolled", activation="relu")
    working, _ = canonical(build_dense(spec))
    fc1, fc2 = [n for n in working.graph if n.op_type == "GroupedMatMul"]
    w1, w2 = fc1.inputs[1].const_value.numpy(), fc2.inputs[1].const_value.numpy()
    originals = {t.name: onnx.numpy_helper.to_array(t) for t in build_dense(spec).graph.initializer}
    for e in range(spec.experts):
        np.testing.assert_array_equal(w1[e], originals[f"fc1_{e}_weight"])
        np.testing.assert_array_equal(w2[e], originals[f"down_{e}_weight"])


def test_int4_becomes_one_dequantize_of_stacked_codes() -> None:
    spec = DenseSpec(form="unrolled", activation="swiglu", int4=True)
    working, _ = canonical(build_dense(spec))
    dqs = [n for n in working.graph if n.op_type == "DequantizeLinear"]
    assert len(dqs) == 3  # gate, up, down: one each instead of one per expert
    for dq in dqs:
        q, scale = dq.inputs[0].const_value, dq.inputs[1].const_value
        assert q.dtype == ir.DataType.INT4 and q.shape[0] == spec.experts
        assert dq.attributes["axis"].value == 1 and dq.attributes["block_size"].value == 16
        assert tuple(scale.shape) == (spec.experts, q.shape[1] // 16, q.shape[2])


def test_original_model_untouched_by_working_copy() -> None:
    """The working copy shares tensors with the original: the pass must not mutate them."""
    model = build_dense(DenseSpec(form="unrolled", int4=True, bias=True))
    original = ir.serde.deserialize_model(model)
    before = ir.serde.serialize_model(original).SerializeToString()
    working = original.clone()
    assert CanonicalDenseExpertsPass()(working).modified
    assert ir.serde.serialize_model(original).SerializeToString() == before


# -- canonical form -> fuse -> same numbers ----------------------------------------------------


@pytest.mark.parametrize("spec", FUSING + VARIANTS, ids=spec_id)
def test_fused_matches_dense(spec: DenseSpec, rng: np.random.Generator) -> None:
    model = build_dense(spec)
    working, modified = canonical(model)
    assert modified
    result = fuse(model)  # the pipeline canonicalises itself
    assert [f["op"] for f in result.report.fusions] == [fuses_to(spec)], result.report
    x = tokens(rng, spec)
    assert nonzero_rel_err(run(result.model, x), run(model, x)) < TOL


@pytest.mark.parametrize(
    "spec",
    [
        DenseSpec(form="onehot", int4=True, renorm=False),
        DenseSpec(form="scatter", int4=True, renorm=False, activation="relu"),
    ],
    ids=["int4-onehot-raw", "int4-scatter-raw"],
)
def test_unrenormalised_int4_fuses_through_the_routing_construction(
    spec: DenseSpec, rng: np.random.Generator
) -> None:
    """QMoE renormalises its own softmax: raw top-k weights go in as router_weights (ORT CPU)."""
    model = build_dense(spec)
    result = fuse(model)  # the pipeline canonicalises itself
    assert [f["op"] for f in result.report.fusions] == ["QMoE"], result.report.near_misses
    assert result.report.fusions[0]["routing"]["construction"] == "router_weights"
    x = tokens(rng, spec)
    assert nonzero_rel_err(run(result.model, x), run(model, x)) < TOL


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    form=st.sampled_from(FORMS),
    activation=st.sampled_from(ACTIVATIONS),
    experts=st.integers(2, 6),
    k_frac=st.floats(0, 1),
    hidden=st.sampled_from([8, 16, 24]),
    inter=st.sampled_from([4, 8, 12]),
    count=st.integers(1, 17),
    seed=st.integers(0, 2**16),
    variant=st.booleans(),
)
def test_property_any_sizes(
    form, activation, experts, k_frac, hidden, inter, count, seed, variant
) -> None:
    k = 1 + int(k_frac * (experts - 1))
    spec = DenseSpec(
        form=form,
        activation=activation,
        experts=experts,
        top_k=k,
        hidden=hidden,
        inter=inter,
        seed=seed,
        bias=seed % 2 == 0,
        renorm=seed % 3 != 0,
        variant=variant,
    )
    model = build_dense(spec)
    working, modified = canonical(model)
    assert modified
    result = fuse(model)  # the pipeline canonicalises itself
    assert [f["op"] for f in result.report.fusions] == ["MoE"], result.report
    x = np.random.default_rng(seed).standard_normal((count, hidden)).astype(np.float32)
    assert nonzero_rel_err(run(result.model, x), run(model, x)) < TOL


# -- MatMulNBits experts (Mobius' dense fallback) ---------------------------------------------


NBITS = [DenseSpec(nbits=True, activation=a, bias=b) for a in ("swiglu", "relu") for b in (0, 1)]


@pytest.mark.parametrize("spec", NBITS, ids=spec_id)
def test_matmul_nbits_experts_fuse(spec: DenseSpec, rng: np.random.Generator) -> None:
    model = build_dense(spec)
    x = tokens(rng, spec)
    assert nonzero_rel_err(run(model, x), reference(spec, x)) < TOL
    working, modified = canonical(model)
    assert modified
    counts = ops(working)
    assert counts["MatMulNBits"] == 0 and counts["DequantizeLinear"] == counts["GroupedMatMul"]
    result = fuse(model)  # the pipeline canonicalises itself
    assert [f["op"] for f in result.report.fusions] == ["QMoE"], result.report
    assert nonzero_rel_err(run(result.model, x), run(model, x)) < TOL


def with_nbits_zero_points(model: onnx.ModelProto, byte: int) -> onnx.ModelProto:
    """Every MatMulNBits node gets explicit packed 4-bit zero points, all bytes ``byte``."""
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            k_blocks = -(-attrs["K"] // attrs["block_size"])
            zp = np.full(attrs["N"] * -(-k_blocks // 2), byte, dtype=np.uint8)
            name = f"{node.output[0]}_zp"
            model.graph.initializer.append(onnx.numpy_helper.from_array(zp, name))
            node.input.append(name)
    return model


def test_matmul_nbits_zero_points(rng: np.random.Generator) -> None:
    spec = DenseSpec(nbits=True, activation="relu")
    x = tokens(rng, spec)
    symmetric = with_nbits_zero_points(build_dense(spec), 0x88)  # zp 8 in both nibbles
    working, modified = canonical(symmetric)
    assert modified
    result = fuse(symmetric)  # the pipeline canonicalises itself
    assert [f["op"] for f in result.report.fusions] == ["QMoE"]
    assert nonzero_rel_err(run(result.model, x), run(symmetric, x)) < TOL
    # asymmetric (zp 7 low, 9 high): canonical, exact as DQ, fused with zero-point inputs on
    # ort-cpu, refused on ort-webgpu (its QMoE kernel takes no zero points)
    skewed = with_nbits_zero_points(build_dense(spec), 0x97)
    working, modified = canonical(skewed)
    assert modified
    want = run(skewed, x)
    assert nonzero_rel_err(run(lowered_to_ort(working), x), want) < TOL
    result = fuse(skewed)  # the pipeline canonicalises itself
    assert [f["op"] for f in result.report.fusions] == ["QMoE"]
    assert nonzero_rel_err(run(result.model, x), want) < TOL
    result = fuse(skewed, target="ort-webgpu")  # relu, and zero points: both refused there
    assert not result.report.fusions
    assert [m["part"] for m in result.report.near_misses] == ["target"]


def lowered_to_ort(working: ir.Model) -> onnx.ModelProto:
    """The canonical form, GroupedMatMul expanded to Gather/MatMul so ORT 1.32 can run it."""
    proto = ir.serde.serialize_model(working)
    graph = proto.graph
    nodes = []
    for node in graph.node:
        if node.op_type != "GroupedMatMul":
            nodes.append(node)
            continue
        x, w, idx, *bias = node.input
        out = node.output[0]
        axes = f"{out}_axes"
        nodes += [
            onnx.helper.make_node("Constant", [], [axes], value_ints=[1]),
            onnx.helper.make_node("Unsqueeze", [x, axes], [f"{out}_x"]),  # [M, 1, K]
            onnx.helper.make_node("Unsqueeze", [f"{out}_x", axes], [f"{out}_x4"]),  # [M,1,1,K]
            onnx.helper.make_node("Gather", [w, idx], [f"{out}_w"], axis=0),  # [M, S, K, N]
            onnx.helper.make_node("MatMul", [f"{out}_x4", f"{out}_w"], [f"{out}_mm"]),
            onnx.helper.make_node("Constant", [], [f"{out}_sq"], value_ints=[2]),
            onnx.helper.make_node(
                "Squeeze", [f"{out}_mm", f"{out}_sq"], [out if not bias else f"{out}_nb"]
            ),
        ]
        if bias:
            nodes += [
                onnx.helper.make_node("Gather", [bias[0], idx], [f"{out}_b"], axis=0),
                onnx.helper.make_node("Add", [f"{out}_nb", f"{out}_b"], [out]),
            ]
    del graph.node[:]
    graph.node.extend(nodes)
    for imp in proto.opset_import:
        if imp.domain == "":
            imp.version = 21
    return proto


def test_experts_stacked_in_mask_order(rng: np.random.Generator) -> None:
    """Expert e is the MLP its mask ``Equal(idx, e)`` weights, wherever it sits in the graph."""
    spec = DenseSpec(activation="relu")
    model = build_dense(spec)
    masks = {n.output[0]: n for n in model.graph.node if n.op_type == "Equal"}
    for mlp, expert in ((0, 1), (1, 0)):  # MLP 0 is now expert 1 and MLP 1 expert 0
        const = onnx.helper.make_node("Constant", [], [f"id_{expert}"], value_ints=[expert])
        model.graph.node.insert(0, const)
        masks[f"mask_{mlp}_hit"].input[1] = f"id_{expert}"
    working, modified = canonical(model)
    assert modified
    fc1 = next(n for n in working.graph if n.op_type == "GroupedMatMul")
    originals = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(fc1.inputs[1].const_value.numpy()[0], originals["fc1_1_weight"])
    np.testing.assert_array_equal(fc1.inputs[1].const_value.numpy()[1], originals["fc1_0_weight"])
    result = fuse(model)  # the pipeline canonicalises itself
    x = tokens(rng, spec)
    assert nonzero_rel_err(run(result.model, x), run(model, x)) < TOL


@pytest.mark.parametrize("granularity, fused", [("tensor", "QMoE"), ("out", "QMoE"), ("in", None)])
def test_int8_dequantize_granularities(granularity, fused, rng: np.random.Generator) -> None:
    """Per tensor -> per expert; per axis -> one block spanning the other axis (exact)."""
    spec = DenseSpec(activation="relu")
    model = with_int8_experts(build_dense(spec), granularity)
    x = tokens(rng, spec)
    working, modified = canonical(model)
    assert modified
    assert ops(working)["DequantizeLinear"] == 2
    assert nonzero_rel_err(run(lowered_to_ort(working), x), run(model, x)) < TOL
    result = fuse(model)  # the pipeline canonicalises itself
    assert [f["op"] for f in result.report.fusions] == ([fused] if fused else [])
    if fused:
        assert nonzero_rel_err(run(result.model, x), run(model, x)) < TOL


@pytest.mark.parametrize("form", FORMS)
def test_canonical_form_computes_the_same(form: str, rng: np.random.Generator) -> None:
    """The canonical form itself (GroupedMatMul as its decomposition) equals the dense model."""
    spec = DenseSpec(form=form, activation="swiglu", int4=True, bias=True, renorm=False)
    model = build_dense(spec)
    working, _ = canonical(model)
    x = tokens(rng, spec)
    assert nonzero_rel_err(run(lowered_to_ort(working), x), run(model, x)) < TOL


# -- refusals: unchanged, with a reason --------------------------------------------------------


def assert_refused(model: onnx.ModelProto, reason: str) -> None:
    ir_model = ir.serde.deserialize_model(model)
    before = ir.serde.serialize_model(ir_model).SerializeToString()
    refusals = dense_experts_refusals(ir_model)
    assert any(reason in r for _, r in refusals), refusals
    assert not CanonicalDenseExpertsPass()(ir_model).modified
    assert ir.serde.serialize_model(ir_model).SerializeToString() == before


NEAR_MISSES = [
    (DenseSpec(mask_from_other_topk=True), "not computed from this TopK's values"),
    (DenseSpec(form="onehot", mask_from_other_topk=True), "not computed from this TopK's values"),
    (DenseSpec(form="scatter", mask_from_other_topk=True), "not computed from this TopK's values"),
    (DenseSpec(odd_expert_activation=1), "expert 1's MLP differs"),
    (DenseSpec(activation="relu", odd_expert_activation=3), "expert 3's MLP differs"),
    (DenseSpec(missing_expert=2), "no mask for experts [2]"),
    (DenseSpec(activation="swiglu_oss", odd_expert_activation=2), "expert 2's MLP differs"),
    (DenseSpec(nbits=True, missing_expert=0), "no mask for experts [0]"),
]


@pytest.mark.parametrize("spec, reason", NEAR_MISSES, ids=lambda v: v if isinstance(v, str) else "")
def test_near_misses_unchanged(spec: DenseSpec, reason: str) -> None:
    assert_refused(build_dense(spec), reason)


def test_escaping_expert_output_refused() -> None:
    model = build_dense(DenseSpec(activation="relu"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("down_1_mm", 1, None))
    assert_refused(model, "escapes the dense layer")


def test_escaping_mask_refused() -> None:
    model = build_dense(DenseSpec(form="onehot"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("dense_weights", 1, None))
    assert_refused(model, "dense routing weights")


def test_onehot_of_wrong_depth_refused() -> None:
    model = build_dense(DenseSpec(form="onehot", experts=4))
    (depth_node,) = [n for n in model.graph.node if n.op_type == "OneHot"]
    # a depth of E + 1 leaves every row's last column zero: not the mask of E experts
    model.graph.node.insert(0, onnx.helper.make_node("Constant", [], ["depth5"], value_ints=[5]))
    depth_node.input[1] = "depth5"
    assert_refused(model, "depth E = 4")


def test_mlp_of_other_tokens_refused() -> None:
    spec = DenseSpec(form="unrolled", activation="relu")
    model = build_dense(spec)
    neg = onnx.helper.make_node("Neg", ["x"], ["x_neg"])
    model.graph.node.insert(0, neg)
    for node in model.graph.node:
        if node.output[0] == "fc1_2_mm":
            node.input[0] = "x_neg"
    assert_refused(model, "does not read the router's tokens")


def test_nbits_expert_of_other_block_size_refused() -> None:
    model = build_dense(DenseSpec(nbits=True, activation="relu"))
    node = next(n for n in model.graph.node if n.output[0] == "fc1_2_mm")
    b_name = node.input[1]
    b = next(t for t in model.graph.initializer if t.name == b_name)
    arr = onnx.numpy_helper.to_array(b)  # [N, K/16, 8] -> the same bytes as [N, K/32, 16]
    b.CopyFrom(onnx.numpy_helper.from_array(arr.reshape(arr.shape[0], -1, 16), b_name))
    s_name = node.input[2]
    s = next(t for t in model.graph.initializer if t.name == s_name)
    s.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(s)[:, ::2].copy(), s_name))
    for a in node.attribute:
        if a.name == "block_size":
            a.i = 32
    assert_refused(model, "expert 2's MLP differs")


def test_mask_cast_to_int_refused() -> None:
    model = build_dense(DenseSpec(activation="relu"))
    cast = next(n for n in model.graph.node if n.output[0] == "mask_1_float")
    cast.attribute[0].i = onnx.TensorProto.INT64  # not a valid model for ORT: only analysed
    ir_model = ir.serde.deserialize_model(model)
    assert any("Cast to a float" in r for _, r in dense_experts_refusals(ir_model))
    assert not CanonicalDenseExpertsPass()(ir_model).modified


@pytest.mark.parametrize("sample", [s for s in all_samples()], ids=lambda s: s.name)
def test_per_slot_samples_left_alone(sample) -> None:
    """The sample catalogue's layers are not dense: nothing to refuse, nothing changed."""
    ir_model = ir.serde.deserialize_model(sample.model)
    before = ir.serde.serialize_model(ir_model).SerializeToString()
    assert dense_experts_refusals(ir_model) == []
    assert not CanonicalDenseExpertsPass()(ir_model).modified
    assert ir.serde.serialize_model(ir_model).SerializeToString() == before
