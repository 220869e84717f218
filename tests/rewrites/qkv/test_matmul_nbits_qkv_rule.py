"""The RMS norm + Q/K/V rule (``onnx_moe_fuse.rewrites.qkv.rule``) on its samples and more.

The rule set is applied with onnxscript's rewriter directly (``onnxscript.rewriter.rewrite``,
which also sweeps dead code), not through the fuser's pipeline. Inputs are fresh random values on
every run (the ``rng`` fixture prints its seed; ``TEST_SEED=<seed>`` replays it).
"""

from __future__ import annotations

import collections
import math

import ml_dtypes
import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import onnx_ir as ir
import onnxruntime as ort
import onnxscript.rewriter
import pytest
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnx_moe_fuse.rewrites.qkv.rule import (
    FUSED_OP,
    MS_DOMAIN,
    REPLACED_KEY,
    near_misses,
    rules,
)
from onnx_moe_fuse.samples import Sample, all_samples, get_sample, sample_names
from onnx_moe_fuse.samples.qkv import QKV_CATALOG, QkvSpec, build_qkv, repacked_weights
from onnx_moe_fuse.verify.checker import verify
from onnx_moe_fuse.verify.reference import random_feeds, run_reference

SAMPLES: dict[str, Sample] = {s.name: s for s in all_samples("qkv")}
POSITIVE = [n for n, s in SAMPLES.items() if not s.is_near_miss]
NEAR_MISSES = [n for n, s in SAMPLES.items() if s.is_near_miss]
SLOTS = (
    "A",
    "skip",
    "norm_scale",
    "q_B",
    "q_scales",
    "q_bias",
    "k_B",
    "k_scales",
    "k_bias",
    "v_B",
    "v_scales",
    "v_bias",
)
ATTRIBUTES = {"K", "Nq", "Nkv", "bits", "block_size", "epsilon", "accuracy_level"}
# Relative to max|reference|. float16: ORT rounds the normalised value to float16 and a float16
# decomposed norm squares in float16; 60 seeds measured at most 1.3e-3.
TOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 4e-3}


# -- helpers -----------------------------------------------------------------------------------


def fuse(model: onnx.ModelProto) -> onnx.ModelProto:
    """The rule set through onnxscript's rewriter (it sweeps dead code afterwards)."""
    return onnxscript.rewriter.rewrite(model, pattern_rewrite_rules=rules())


_FUSED: dict[str, onnx.ModelProto] = {}


def fused_sample(name: str) -> onnx.ModelProto:
    if name not in _FUSED:
        _FUSED[name] = fuse(get_sample(name).model)
    return _FUSED[name]


def fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if (n.domain, n.op_type) == (MS_DOMAIN, FUSED_OP)]


def op_counts(model: onnx.ModelProto) -> collections.Counter[str]:
    return collections.Counter(n.op_type for n in model.graph.node)


def attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: oh.get_attribute_value(a) for a in node.attribute}


def slots(node: onnx.NodeProto) -> dict[str, str]:
    names = list(node.input) + [""] * (len(SLOTS) - len(node.input))
    return dict(zip(SLOTS, names, strict=True))


def inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def graph_text(model: onnx.ModelProto) -> tuple[object, ...]:
    """The graph as comparable data: nodes in order, inputs, outputs, initializers by name."""
    g = model.graph
    nodes = [
        (n.domain, n.op_type, tuple(n.input), tuple(n.output), onnx.printer.to_text(n))
        for n in g.node
    ]
    values = [(v.name, v.type.SerializeToString()) for v in (*g.input, *g.output)]
    weights = sorted((t.name, t.SerializeToString()) for t in g.initializer)
    return tuple(nodes), tuple(values), tuple(weights)


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, sess.run(None, feeds), strict=True))


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.abs(want.astype(np.float64)).max())
    assert scale > 0, "reference output is all zeros: the comparison would prove nothing"
    return float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max() / scale)


def assert_unchanged(model: onnx.ModelProto) -> None:
    """The rules fire nowhere and leave the graph exactly as it was (no dead-code sweep)."""
    ir_model = ir.serde.deserialize_model(model)
    assert rules().apply_to_model(ir_model) == 0
    assert graph_text(ir.serde.serialize_model(ir_model)) == graph_text(model)


def reasons(model: onnx.ModelProto) -> list[str]:
    return [m.reason for m in near_misses(model)]


def seed_of(rng: np.random.Generator) -> int:
    return int(rng.integers(0, 2**31))


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


# -- structure the rule must see through, and refusals ---------------------------------------------


def _edit(model: onnx.ModelProto, fn) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    fn(m)
    return m


def _set_attr(model: onnx.ModelProto, op: str, name: str, value) -> None:
    for node in model.graph.node:
        if node.op_type == op:
            for a in list(node.attribute):
                if a.name == name:
                    node.attribute.remove(a)
            node.attribute.append(oh.make_attribute(name, value))


def _add_init(model: onnx.ModelProto, name: str, array: np.ndarray) -> None:
    model.graph.initializer.append(onnx.numpy_helper.from_array(array, name))


def _nbits_bias(m: onnx.ModelProto) -> None:
    node = next(n for n in m.graph.node if n.op_type == "MatMulNBits")
    _add_init(m, "bias_0", np.zeros(attrs(node)["N"], np.float32))
    node.input.extend(["", "", "bias_0"])


def _nbits_g_idx(order: str):
    def edit(m: onnx.ModelProto) -> None:
        g = np.arange(96, dtype=np.int32) // 32
        if order == "shuffled":
            g = g[::-1].copy()
        _add_init(m, "g_idx", g)
        for node in m.graph.node:
            if node.op_type == "MatMulNBits":
                node.input.extend(["", "g_idx"])

    return edit


def _uint4_without_zero_point(m: onnx.ModelProto) -> None:
    for node in m.graph.node:
        if node.op_type == "DequantizeLinear":
            del node.input[2:]


def _int4_zero_point(m: onnx.ModelProto) -> None:
    weights = inits(m)
    for node in m.graph.node:
        if node.op_type == "DequantizeLinear":
            name = node.input[0] + "_zp"
            shape = weights[node.input[1]].shape  # the scale's [k_blocks, N]
            _add_init(m, name, np.full(shape, 1, ml_dtypes.int4))
            node.input.append(name)


def _float_weight(m: onnx.ModelProto) -> None:
    dq = next(n for n in m.graph.node if n.op_type == "DequantizeLinear")
    m.graph.node.remove(dq)
    _add_init(m, dq.output[0], np.zeros((96, 64), np.float32))


def _fourth_projection(m: onnx.ModelProto) -> None:
    node = next(n for n in m.graph.node if n.op_type == "MatMulNBits")
    extra = onnx.NodeProto()
    extra.CopyFrom(node)
    extra.output[0] = "p4"
    m.graph.node.append(extra)
    n = attrs(node)["N"]
    m.graph.output.append(oh.make_tensor_value_info("p4", onnx.TensorProto.FLOAT, ["T", n]))


def _ssln_bias(m: onnx.ModelProto) -> None:
    _add_init(m, "ssln_bias", np.zeros(96, np.float32))
    next(n for n in m.graph.node if n.op_type == "SkipSimplifiedLayerNormalization").input.append(
        "ssln_bias"
    )


def _reduce_first_axis(m: onnx.ModelProto) -> None:
    for node in m.graph.node:
        if node.op_type == "ReduceMean":
            for a in node.attribute:
                if a.name == "axes":
                    a.ints[:] = [0]


def _pow3(m: onnx.ModelProto) -> None:
    for t in m.graph.initializer:
        if t.name == "rms_two":
            t.CopyFrom(onnx.numpy_helper.from_array(np.array(3.0, np.float32), t.name))


def _no_shapes(m: onnx.ModelProto) -> None:
    for v in [*m.graph.input, *m.graph.output]:
        v.type.tensor_type.ClearField("shape")


REFUSALS = [
    ("qkv_sln_nbits_kvq_order", _nbits_bias, "bias input"),
    ("qkv_sln_nbits_kvq_order", _nbits_g_idx("shuffled"), "g_idx"),
    ("qkv_rms23_dq_uint4_f16", _uint4_without_zero_point, "asymmetric zero point"),
    ("qkv_decomposed_recip_dq_int4_rank3", _int4_zero_point, "asymmetric zero points"),
    ("qkv_add_sln_dq_int4_residual", _float_weight, "not a DequantizeLinear output"),
    ("qkv_sln_nbits_kvq_order", _fourth_projection, "feeds 4 projections"),
    ("qkv_skip_sln_nbits_residual_rank3", _ssln_bias, "with a bias input"),
    ("qkv_decomposed_nbits", _reduce_first_axis, "not the last axis"),
    ("qkv_decomposed_nbits", _pow3, "not 2"),
    (
        "qkv_sln_nbits_kvq_order",
        lambda m: _set_attr(m, "SimplifiedLayerNormalization", "axis", 0),
        "axis 0",
    ),
    ("qkv_sln_nbits_kvq_order", _no_shapes, "unknown rank"),
]


@pytest.mark.parametrize(("name", "edit", "keyword"), REFUSALS, ids=[r[2] for r in REFUSALS])
def test_refusals(name: str, edit, keyword: str) -> None:
    model = _edit(get_sample(name).model, edit)
    assert_unchanged(model)
    why = reasons(model)
    assert any(keyword in r for r in why), why


def test_plain_g_idx_still_fuses() -> None:
    model = _edit(get_sample("qkv_sln_nbits_kvq_order").model, _nbits_g_idx("plain"))
    assert len(fused_nodes(fuse(model))) == 1


def _fused_and_checked(model: onnx.ModelProto, dims: dict[str, int], rng) -> onnx.ModelProto:
    fused = fuse(model)
    assert len(fused_nodes(fused)) == 1, op_counts(fused)
    seed = seed_of(rng)
    feeds = random_feeds(model, seed, dims)
    want = run_reference(model, feeds)
    got = run_reference(fused, feeds)
    for out, value in want.items():
        assert rel_err(got[out], value) <= TOL[value.dtype], (out, seed)
    return fused


def test_mixed_projection_kinds(rng: np.random.Generator) -> None:
    """Q from MatMulNBits, K and V from DequantizeLinear + MatMul (the "ndd" mix)."""
    a = build_qkv(QkvSpec("mix_a", "sln", "nbits"))
    b = build_qkv(QkvSpec("mix_b", "sln", "dq_int4"))
    m = onnx.ModelProto()
    m.CopyFrom(a)
    keep = [n for n in a.graph.node if n.output[0] not in ("k", "v")]
    add = [n for n in b.graph.node if n.op_type != "SimplifiedLayerNormalization"]
    add = [n for n in add if n.output[0] not in ("q", "q_proj_weight")]
    del m.graph.node[:]
    m.graph.node.extend(keep + add)
    weights = [t for t in a.graph.initializer if not t.name.startswith(("k_", "v_"))]
    weights += [t for t in b.graph.initializer if t.name.startswith(("k_", "v_"))]
    del m.graph.initializer[:]
    m.graph.initializer.extend(weights)
    fused = _fused_and_checked(m, {"T": 5}, rng)
    (node,) = fused_nodes(fused)
    assert slots(node)["q_B"] == "q_proj_B" and slots(node)["k_B"] != "k_proj_B"


def test_broadcast_skip_add_reads_the_sum(rng: np.random.Generator) -> None:
    """Add(x, bias [K]) is no skip: the fused node reads the sum as A, the Add stays."""
    model = build_qkv(QkvSpec("bcast", "add_sln", "nbits", residual_output=True))

    def edit(m: onnx.ModelProto) -> None:
        m.graph.input.remove(next(i for i in m.graph.input if i.name == "skip"))
        _add_init(m, "skip", np.linspace(-1, 1, 96, dtype=np.float32))

    model = _edit(model, edit)
    fused = _fused_and_checked(model, {"T": 5}, rng)
    (node,) = fused_nodes(fused)
    assert (slots(node)["A"], slots(node)["skip"], len(node.output)) == ("residual", "", 3)
    assert op_counts(fused)["Add"] == 1


def test_residual_reader_before_the_norm_keeps_the_add(rng: np.random.Generator) -> None:
    model = build_qkv(QkvSpec("early", "add_sln", "nbits"))

    def edit(m: onnx.ModelProto) -> None:
        nodes = list(m.graph.node)
        at = next(i for i, n in enumerate(nodes) if n.op_type == "Add") + 1
        nodes.insert(at, oh.make_node("Neg", ["residual"], ["early_reader"]))
        del m.graph.node[:]
        m.graph.node.extend(nodes)
        m.graph.output.append(
            oh.make_tensor_value_info("early_reader", onnx.TensorProto.FLOAT, ["T", 96])
        )

    model = _edit(model, edit)
    fused = _fused_and_checked(model, {"T": 5}, rng)
    (node,) = fused_nodes(fused)
    assert (slots(node)["A"], slots(node)["skip"], len(node.output)) == ("residual", "", 3)


def test_normed_as_graph_output_keeps_the_norm(rng: np.random.Generator) -> None:
    model = build_qkv(QkvSpec("normed_out", "skip_sln", "nbits", residual_output=True))
    model = _edit(
        model,
        lambda m: m.graph.output.append(
            oh.make_tensor_value_info("normed", onnx.TensorProto.FLOAT, ["T", 96])
        ),
    )
    fused = _fused_and_checked(model, {"T": 5}, rng)
    (node,) = fused_nodes(fused)
    assert (slots(node)["A"], slots(node)["skip"]) == ("residual", "")
    assert op_counts(fused)["SkipSimplifiedLayerNormalization"] == 1


def test_float16_decomposed_without_casts(device, rng: np.random.Generator) -> None:
    del device
    spec = QkvSpec("f16_plain", "decomposed", "dq_int4", dtype="float16", rank=3)
    model = build_qkv(spec)
    fused = fuse(model)
    assert len(fused_nodes(fused)) == 1
    report = verify(model, fused, seeds=(seed_of(rng),), dim_values={"B": 2, "S": 3})
    assert report.passed, report.messages


def test_scale_cast_from_float32(rng: np.random.Generator) -> None:
    """A float32 scale cast to the float16 chain fuses when it is exact in float16, else not."""
    spec = QkvSpec("scale32", "decomposed", "nbits", dtype="float16")

    def edit(exact: bool):
        def fn(m: onnx.ModelProto) -> None:
            t = next(t for t in m.graph.initializer if t.name == "norm_scale")
            gamma = onnx.numpy_helper.to_array(t).astype(np.float32)
            if not exact:
                gamma = gamma + np.float32(1e-6)
            t.CopyFrom(onnx.numpy_helper.from_array(gamma, "norm_scale"))
            mul = next(n for n in m.graph.node if n.output[0] == "normed")
            mul.input[1] = "norm_scale_h"
            cast = oh.make_node(
                "Cast", ["norm_scale"], ["norm_scale_h"], to=onnx.TensorProto.FLOAT16
            )
            nodes = [cast, *m.graph.node]
            del m.graph.node[:]
            m.graph.node.extend(nodes)

        return fn

    exact = _edit(build_qkv(spec), edit(True))
    (node,) = fused_nodes(_fused_and_checked(exact, {"T": 5}, rng))
    assert slots(node)["norm_scale"] != "norm_scale"
    inexact = _edit(build_qkv(spec), edit(False))
    assert_unchanged(inexact)
    assert any("not exactly representable" in r for r in reasons(inexact))


def test_two_layers_both_fuse(rng: np.random.Generator) -> None:
    """Two preludes in one graph, the second reading the first's Q."""
    a = build_qkv(QkvSpec("layer", "sln", "nbits", nq=96))
    m = onnx.ModelProto()
    m.CopyFrom(a)
    second = []
    for node in a.graph.node:
        n = onnx.NodeProto()
        n.CopyFrom(node)
        n.input[:] = ["q" if i == "x" else (f"{i}_2" if i else i) for i in n.input]
        n.output[:] = [f"{o}_2" for o in n.output]
        second.append(n)
    m.graph.node.extend(second)
    m.graph.initializer.extend(
        onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t), f"{t.name}_2")
        for t in a.graph.initializer
    )
    m.graph.output.extend(
        oh.make_tensor_value_info(f"{o.name}_2", onnx.TensorProto.FLOAT, None)
        for o in a.graph.output
    )
    fused = fuse(m)
    assert len(fused_nodes(fused)) == 2
    seed = seed_of(rng)
    feeds = random_feeds(m, seed, {"T": 5})
    want, got = run_reference(m, feeds), run_reference(fused, feeds)
    for out, value in want.items():
        assert rel_err(got[out], value) <= 1e-4, (out, seed)


def _swapped_q_k(name: str) -> onnx.ModelProto:
    fused = onnx.ModelProto()
    fused.CopyFrom(fused_sample(name))
    (node,) = fused_nodes(fused)
    node.input[3], node.input[6] = node.input[6], node.input[3]
    node.input[4], node.input[7] = node.input[7], node.input[4]
    return fused


def test_verification_has_teeth(device, rng: np.random.Generator) -> None:
    """Swapping the Q and K weights of an equal-width fusion is caught on both paths."""
    name = "qkv_sln_nbits_equal_widths_named"
    s = SAMPLES[name]
    wrong = _swapped_q_k(name)
    seed = seed_of(rng)
    feeds = random_feeds(s.model, seed, s.dim_values)
    want, got = run_reference(s.model, feeds), run_reference(wrong, feeds)
    assert rel_err(got["query_states"], want["query_states"]) > 1e-2, seed
    del device
    report = verify(s.model, wrong, seeds=(seed,), dim_values=s.dim_values, paths=("wgpu",))
    assert not report.passed and report.paths["wgpu"].status == "failed", report.messages


def test_rules_ignore_the_moe_samples() -> None:
    """No MoE sample holds an RMS norm: the rules fire nowhere and explain nothing there."""
    for s in all_samples("moe"):
        assert_unchanged(s.model)
        assert near_misses(s.model) == [], s.name
