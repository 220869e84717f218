"""The RMS norm + Q/K/V rule (``onnx_moe_fuse.rewrites.qkv.rule``) on its samples: catalogue, positives, near misses, roles.

Structure it must see through and its refusals: ``test_matmul_nbits_qkv_structure.py``; shared
helpers: ``qkv_rule_helpers.py``.

The rule set is applied with onnxscript's rewriter directly (``onnxscript.rewriter.rewrite``,
which also sweeps dead code), not through the fuser's pipeline. Inputs are fresh random values on
every run (the ``rng`` fixture prints its seed; ``TEST_SEED=<seed>`` replays it).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import onnx_ir as ir
import pytest
from onnx_ir.passes.common import RemoveUnusedNodesPass
from qkv_rule_helpers import (
    ATTRIBUTES,
    NEAR_MISSES,
    POSITIVE,
    SAMPLES,
    TOL,
    assert_unchanged,
    attrs,
    fuse,
    fused_nodes,
    fused_sample,
    graph_text,
    inits,
    op_counts,
    ort_run,
    reasons,
    rel_err,
    seed_of,
    slots,
)

from onnx_moe_fuse.rewrites.qkv.rule import (
    MS_DOMAIN,
    REPLACED_KEY,
    near_misses,
    rules,
)
from onnx_moe_fuse.samples import all_samples, get_sample, sample_names
from onnx_moe_fuse.samples.qkv import QKV_CATALOG, QkvSpec, build_qkv, repacked_weights
from onnx_moe_fuse.verify.checker import verify
from onnx_moe_fuse.verify.reference import random_feeds, run_reference

# -- the catalogue -----------------------------------------------------------------------------


def test_catalogue_lists_qkv_samples() -> None:
    assert set(SAMPLES) == set(QKV_CATALOG) == set(sample_names("qkv"))
    assert sample_names("all") == sample_names("moe") + sample_names("qkv")
    assert not set(sample_names("moe")) & set(SAMPLES)
    spellings = {s.spelling for s in SAMPLES.values() if not s.is_near_miss}
    assert {
        "decomposed RMS norm",
        "RMSNormalization",
        "SkipSimplifiedLayerNormalization",
        "SimplifiedLayerNormalization",
    } <= spellings
    weights = {s.weights for s in SAMPLES.values() if not s.is_near_miss}
    assert any(w.startswith("MatMulNBits") for w in weights)
    assert any(w.startswith(("int4", "uint4")) for w in weights)
    assert {s.near_miss_reason for n, s in SAMPLES.items() if s.is_near_miss} >= {
        "asymmetric zero point",
        "block_size 64",
        "only two projections",
        "8-bit",
    }
    with pytest.raises(ValueError, match="kind"):
        all_samples("nope")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(SAMPLES))
def test_record_well_formed(name: str) -> None:
    s = SAMPLES[name]
    assert s.kind == "qkv" and s.twin is None
    assert s.opset == {o.domain: o.version for o in s.model.opset_import}[""]
    meta = {p.key: p.value for p in s.model.metadata_props}
    assert meta["onnx_moe_fuse.sample"] == name
    dims = s.model.graph.input[0].type.tensor_type.shape.dim
    assert set(s.dim_values) == {d.dim_param for d in dims[:-1]}
    if s.is_near_miss:
        assert s.family.startswith("nearmiss_qkv") and "Must NOT fuse" in s.description
        assert meta["onnx_moe_fuse.near_miss_reason"] == s.near_miss_reason
        assert not s.expected_attributes
    else:
        assert s.family == "qkv" and s.expected == [("MatMulNBitsQkv", 1)]
        assert set(s.expected_attributes) == ATTRIBUTES
    ops = {n.op_type for n in s.model.graph.node}
    if "SimplifiedLayerNormalization" in ops:
        # ONNX Runtime registers it in the default domain; onnx has no schema for it
        with pytest.raises(onnx.checker.ValidationError, match="SimplifiedLayerNormalization"):
            onnx.checker.check_model(s.model, full_check=True)
    else:
        onnx.checker.check_model(s.model, full_check=True)


@pytest.mark.parametrize("name", list(SAMPLES))
def test_original_runs_in_ort_like_reference(name: str, rng: np.random.Generator) -> None:
    """Pins the reference OpRuns (MatMulNBits, (Skip)SimplifiedLayerNormalization) to ORT CPU."""
    s = SAMPLES[name]
    seed = seed_of(rng)
    feeds = random_feeds(s.model, seed, s.dim_values)
    want = run_reference(s.model, feeds, check_shapes=True)
    got = ort_run(s.model, feeds)
    for out, value in want.items():
        assert got[out].shape == value.shape and got[out].dtype == value.dtype, out
        err = rel_err(got[out], value)
        assert err <= TOL[value.dtype], f"{name}/{out}: ORT vs reference {err:.2e} (seed {seed})"


# -- positives ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", POSITIVE)
def test_sample_fuses_as_recorded(name: str) -> None:
    s = SAMPLES[name]
    entry = QKV_CATALOG[name]
    spec = entry.spec
    fused = fused_sample(name)
    onnx.checker.check_model(fused)  # well formed, nodes in topological order
    counts = op_counts(fused)
    for op, count in s.expected:
        assert counts[op] == count, (name, counts)
    for op, count in s.kept_ops:
        assert counts[op] == count, (name, op, counts)
    assert not {"MatMulNBits", "MatMul", "DequantizeLinear"} & set(counts), counts
    (node,) = fused_nodes(fused)
    got = attrs(node)
    assert set(got) == ATTRIBUTES, got
    for key, want in s.expected_attributes.items():
        if isinstance(want, float):
            assert math.isclose(got[key], want, rel_tol=1e-6), (key, got[key], want)
        else:
            assert got[key] == want, (key, got[key], want)
    # inputs: by slot, at ONNX Runtime's positions
    have = slots(node)
    for slot, want in entry.expected_inputs.items():
        assert have[slot] == want, (slot, have[slot], want)
    new = inits(fused)
    roles = list(spec.roles)
    for role in ("q", "k", "v"):
        b_want, s_want = repacked_weights(s.model, spec, roles.index(role))
        b_got, s_got = new[have[f"{role}_B"]], new[have[f"{role}_scales"]]
        assert b_got.dtype == np.uint8 and b_got.shape == (spec.width[role], spec.k_blocks, 16)
        np.testing.assert_array_equal(b_got, b_want, err_msg=f"{role}_B")
        assert s_got.dtype == spec.np_dtype
        np.testing.assert_array_equal(s_got, s_want, err_msg=f"{role}_scales")
    assert tuple(node.output) == entry.expected_outputs
    # the graph's interface is unchanged
    assert [(o.name, o.type) for o in fused.graph.output] == [
        (o.name, o.type) for o in s.model.graph.output
    ]
    assert [i.name for i in fused.graph.input] == [i.name for i in s.model.graph.input]
    assert node.metadata_props and REPLACED_KEY in {p.key for p in node.metadata_props}


@pytest.mark.parametrize("name", POSITIVE)
def test_rule_emits_all_twelve_slots(name: str) -> None:
    """Right after the rewrite the node has 12 inputs, "" at 5, 8, 11.

    Dead-code removal (onnx_ir's RemoveUnusedNodesPass) then drops the trailing empty input,
    which ONNX reads the same way.
    """
    model = ir.serde.deserialize_model(get_sample(name).model)
    assert rules().apply_to_model(model) == 1
    (node,) = fused_nodes(ir.serde.serialize_model(model))
    raw = list(node.input)
    assert len(raw) == 12 and [raw[i] for i in (5, 8, 11)] == ["", "", ""], raw
    assert all(raw[i] for i in (0, 2, 3, 4, 6, 7, 9, 10)), raw
    RemoveUnusedNodesPass()(model)
    (node,) = fused_nodes(ir.serde.serialize_model(model))
    assert list(node.input) == raw[:11]


@pytest.mark.parametrize("name", POSITIVE)
def test_fused_reference_matches_ort_original(name: str, rng: np.random.Generator) -> None:
    """The fused model on the reference path (numpy oracle) against ORT CPU on the original."""
    s = SAMPLES[name]
    seed = seed_of(rng)
    feeds = random_feeds(s.model, seed, s.dim_values)
    want = ort_run(s.model, feeds)
    got = run_reference(fused_sample(name), feeds, check_shapes=True)
    for out, value in want.items():
        err = rel_err(got[out], value)
        assert err <= TOL[value.dtype], f"{name}/{out}: {err:.2e} (seed {seed})"


@pytest.mark.parametrize("name", POSITIVE)
def test_fused_sample_verifies_on_wgpu(name: str, device, rng: np.random.Generator) -> None:
    del device
    s = SAMPLES[name]
    seeds = (seed_of(rng), seed_of(rng))
    report = verify(s.model, fused_sample(name), seeds=seeds, dim_values=s.dim_values)
    assert report.passed, report.messages
    assert report.paths["wgpu"].status == "passed"
    assert report.paths["ort"].status == "skipped"
    assert "MatMulNBitsQkv" in (report.paths["ort"].reason or "")


@pytest.mark.parametrize("name", POSITIVE)
def test_positive_has_no_near_miss(name: str) -> None:
    assert near_misses(get_sample(name).model) == []


# -- near misses -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_near_miss_unchanged_with_reason(name: str) -> None:
    s = SAMPLES[name]
    assert_unchanged(s.model)
    assert graph_text(fuse(s.model)) == graph_text(s.model)
    why = reasons(s.model)
    assert why, name
    keyword = (s.near_miss_reason or "").lower()
    assert any(keyword in r.lower() for r in why), (keyword, why)


# -- roles: shapes, downstream use, names --------------------------------------------------------


def _replace_outputs(model: onnx.ModelProto, nodes, outputs, inputs=()) -> onnx.ModelProto:
    """``model`` with its graph outputs replaced by ``outputs`` and ``nodes`` appended."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[:]
    m.graph.output.extend(outputs)
    m.graph.node.extend(nodes)
    m.graph.input.extend(inputs)
    return m


def _equal_width_spec(name: str, **over) -> QkvSpec:
    base = dict(
        norm="sln",
        projection="nbits",
        nq=64,
        nkv=64,
        rank=3,
        roles=("q", "k", "v"),
        out_names=("p0", "p1", "p2"),
        weight_names=("w0", "w1", "w2"),
    )
    base.update(over)
    return QkvSpec(name, **base)  # type: ignore[arg-type]


def _role_of(fused: onnx.ModelProto, weight_base: str) -> str:
    (node,) = fused_nodes(fused)
    have = slots(node)
    return next(r for r in "qkv" if have[f"{r}_B"] == f"{weight_base}_B")


def test_roles_from_group_query_attention_inputs() -> None:
    spec = _equal_width_spec("gqa", roles=("v", "q", "k"))
    model = build_qkv(spec)
    f = onnx.TensorProto.FLOAT
    extra = [oh.make_tensor_value_info(n, f, None) for n in ("past_k", "past_v")]
    extra += [oh.make_tensor_value_info("seqlens_k", onnx.TensorProto.INT32, None)]
    extra += [oh.make_tensor_value_info("total_len", onnx.TensorProto.INT32, None)]
    gqa = oh.make_node(
        "GroupQueryAttention",
        ["p1", "p2", "p0", "past_k", "past_v", "seqlens_k", "total_len"],
        ["attn", "present_k", "present_v"],
        domain=MS_DOMAIN,
        num_heads=4,
        kv_num_heads=4,
    )
    out = [oh.make_tensor_value_info("attn", f, None)]
    fused = fuse(_replace_outputs(model, [gqa], out, extra))
    assert {_role_of(fused, w) for w in ("w0", "w1", "w2")} == {"q", "k", "v"}
    assert (_role_of(fused, "w1"), _role_of(fused, "w2"), _role_of(fused, "w0")) == ("q", "k", "v")


def _decomposed_attention(model: onnx.ModelProto, q: str, k: str, v: str) -> onnx.ModelProto:
    nodes = [
        oh.make_node("Transpose", [k], ["kt"], perm=[0, 2, 1]),
        oh.make_node("MatMul", [q, "kt"], ["scores"]),
        oh.make_node(
            "Constant", [], ["scale"], value=onnx.numpy_helper.from_array(np.array(8.0, np.float32))
        ),
        oh.make_node("Div", ["scores", "scale"], ["scaled"]),
        oh.make_node("Softmax", ["scaled"], ["probs"], axis=-1),
        oh.make_node("MatMul", ["probs", v], ["attn"]),
    ]
    out = [oh.make_tensor_value_info("attn", onnx.TensorProto.FLOAT, ["B", "S", 64])]
    return _replace_outputs(model, nodes, out)


def test_roles_from_decomposed_attention(device, rng: np.random.Generator) -> None:
    spec = _equal_width_spec("dec_attn", roles=("k", "v", "q"))
    model = _decomposed_attention(build_qkv(spec), q="p2", k="p0", v="p1")
    fused = fuse(model)
    assert (_role_of(fused, "w2"), _role_of(fused, "w0"), _role_of(fused, "w1")) == ("q", "k", "v")
    del device
    report = verify(model, fused, seeds=(seed_of(rng),), dim_values={"B": 2, "S": 3})
    assert report.passed, report.messages


def test_rope_alone_cannot_tell_q_from_k_but_names_can() -> None:
    spec = _equal_width_spec("rope")
    model = build_qkv(spec)
    f = onnx.TensorProto.FLOAT
    extra = [oh.make_tensor_value_info("pos", onnx.TensorProto.INT64, None)]
    extra += [oh.make_tensor_value_info(n, f, None) for n in ("cos", "sin")]
    nodes = [
        oh.make_node("RotaryEmbedding", [p, "pos", "cos", "sin"], [f"{p}_rot"], domain=MS_DOMAIN)
        for p in ("p0", "p1")
    ]
    out = [oh.make_tensor_value_info(n, f, None) for n in ("p0_rot", "p1_rot", "p2")]
    ambiguous = _replace_outputs(model, nodes, out, extra)
    assert_unchanged(ambiguous)
    assert any("cannot tell which projection is Q" in r for r in reasons(ambiguous))
    named = onnx.ModelProto()
    named.CopyFrom(ambiguous)
    for node in named.graph.node:
        if node.op_type == "MatMulNBits":
            node.name = {"p0": "attn/k_proj/MatMul", "p1": "attn/q_proj/MatMul"}.get(
                node.output[0], node.name
            )
    fused = fuse(named)
    assert (_role_of(fused, "w1"), _role_of(fused, "w0"), _role_of(fused, "w2")) == ("q", "k", "v")


def test_names_that_contradict_the_widths_refuse() -> None:
    spec = QkvSpec(  # the 64-wide projection (Q by the widths) is named as V
        "contra",
        "sln",
        "nbits",
        out_names=("value", "k", "q"),
        weight_names=("v_proj", "k_proj", "q_proj"),
    )
    model = build_qkv(spec)
    assert_unchanged(model)
    assert any("contradicts the widths" in r for r in reasons(model))


def test_three_different_widths_refuse() -> None:
    model = build_qkv(QkvSpec("widths", "sln", "nbits"))
    for node in model.graph.node:  # cut V to 16 columns: N, B and scales
        if node.output[0] == "v":
            for a in node.attribute:
                if a.name == "N":
                    a.i = 16
    for t in model.graph.initializer:
        if t.name.startswith("v_proj"):
            t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t)[:16], t.name))
    for o in model.graph.output:
        if o.name == "v":
            o.type.tensor_type.shape.dim[-1].dim_value = 16
    assert_unchanged(model)
    assert any("different widths" in r for r in reasons(model))
