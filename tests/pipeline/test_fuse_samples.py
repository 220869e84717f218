"""The MoE layer rules on every sample: exact fusions, ORT numerics, near misses, ``only``.

Inputs are fresh random values on every run; each failure message carries the seed, and
``ONNX_MOE_FUSE_SEED=<seed>`` replays it.
"""

from __future__ import annotations

import collections
import math

import onnx
import onnx_ir as ir
import pytest
from helpers import env_seed, nonzero_rel_err

from onnx_moe_fuse import FuseResult, fuse
from onnx_moe_fuse.contract.targets import DEFAULT
from onnx_moe_fuse.pipeline import (
    FusedNodesCheckPass,
    FusionReport,
    LowerOpsetPass,
    fusion_pipeline,
)
from onnx_moe_fuse.samples import Sample, all_samples, get_sample
from onnx_moe_fuse.verify.ort_nodes import session
from onnx_moe_fuse.verify.reference import random_feeds, run_reference

RTOL = 1e-4
SEEDS = 3
SAMPLES: dict[str, Sample] = {s.name: s for s in all_samples()}
POSITIVE = [n for n, s in SAMPLES.items() if not s.is_near_miss]
NEAR_MISSES = [n for n, s in SAMPLES.items() if s.is_near_miss]
QMOE_ONLY = [n for n in POSITIVE if SAMPLES[n].expected == [("QMoE", 1)]]
MOE_ONLY = [n for n in POSITIVE if SAMPLES[n].expected == [("MoE", 1)]]
MS = "com.microsoft"


def op_counts(model: onnx.ModelProto) -> collections.Counter[tuple[str, str]]:
    return collections.Counter((n.domain, n.op_type) for n in model.graph.node)


def assert_same_value(name: str, got: object, want: object) -> None:
    if isinstance(want, float):
        assert isinstance(got, float) and math.isclose(got, want, rel_tol=1e-6), (name, got, want)
    else:
        assert got == want, (name, got, want)


_FUSED: dict[str, FuseResult] = {}


def fused(name: str) -> FuseResult:
    if name not in _FUSED:
        _FUSED[name] = fuse(get_sample(name).model)
    return _FUSED[name]


# -- positives ---------------------------------------------------------------------------------


def node_takes_router_weights(fusion: dict) -> bool:
    """QMoE on the default target (ORT CPU) is fed router_weights; everything else logits."""
    return fusion["op"] == "QMoE"


@pytest.mark.parametrize("name", POSITIVE)
def test_fuses_exactly_as_recorded(name: str) -> None:
    s = SAMPLES[name]
    result = fused(name)
    counts = op_counts(result.model)
    emitted = {op: n for (domain, op), n in counts.items() if domain == MS}
    assert emitted == dict(s.expected), f"{name}: emitted {emitted}, expected {s.expected}"
    for op, n in s.kept_ops:
        assert counts[("", op)] == n, f"{name}: {counts[('', op)]} {op} left, expected {n}"
    assert not result.report.near_misses, result.report.near_misses
    ((fusion,),) = [result.report.fusions]
    # a router the fused op does not compute itself stays in the graph: the node is fed its
    # selection and weights (routing construction), the TopK and its renormalisation kept
    selected = "routing" in fusion
    kept_router = ("TopK", "ReduceSum") if selected else ()
    for gone in ("GroupedMatMul", "DequantizeLinear", "TopK", "Gather", "ReduceSum"):
        if gone not in kept_router:
            assert counts[("", gone)] == 0, f"{name}: a {gone} survived"
    assert fusion["op"] == s.expected[0][0]
    replaced = fusion["replaced"]
    assert replaced[-1] in ("ReduceSum(y)", "ReduceSum(moe_out)", "ReduceSum(layer_out)")
    if selected:
        assert "TopK(topk_probs)" not in replaced and "TopK(topk_logits)" not in replaced
        want = "router_weights" if node_takes_router_weights(fusion) else "logits"
        assert fusion["routing"]["construction"] == want, fusion["routing"]
    else:
        assert "TopK(topk_probs)" in replaced or "TopK(topk_logits)" in replaced
    assert len(replaced) == len(set(replaced))
    if "router_probs" in {o for n in s.model.graph.node for o in n.output}:
        assert ("Softmax(router_probs)" in replaced) != selected
    node = next(n for n in result.model.graph.node if n.domain == MS)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    for key, want in s.expected_attributes.items():
        assert key in attrs, f"{name}: attribute {key} not written"
        assert_same_value(key, attrs[key], want)
        assert_same_value(key, fusion["attributes"][key], want)
    expected_keys = DEFAULT.attribute_names(node.op_type)
    assert set(attrs) == expected_keys, f"{name}: attributes {sorted(attrs)}"
    # ORT's input positions, "" for an absent optional input
    n_inputs = {"MoE": (4, 6), "QMoE": (7, 8)}[node.op_type]
    if selected and fusion["routing"]["construction"] == "router_weights":
        n_inputs = (15, 15)  # router_weights is QMoE input 14
    elif "asymmetric" in s.description:
        n_inputs = (13, 13)  # fc1/fc2 zero points are QMoE inputs 11 and 12
    assert n_inputs[0] <= len(node.input) <= n_inputs[1]
    if node.op_type == "QMoE":
        weights = {t.name: t for t in result.model.graph.initializer}
        assert weights[node.input[2]].data_type == onnx.TensorProto.UINT8
        assert weights[node.input[5]].data_type == onnx.TensorProto.UINT8
        has_bias = "fc1_bias" in {t.name for t in s.model.graph.initializer}
        assert (node.input[4] != "") == has_bias
        assert (len(node.input) >= 8) == (has_bias or len(node.input) in (13, 15))
    onnx.checker.check_model(result.model)


@pytest.mark.parametrize("name", POSITIVE)
def test_fused_runs_in_ort_like_the_original(name: str) -> None:
    s = SAMPLES[name]
    result = fused(name)
    sess = session(result.model, log_severity_level=3)
    outputs = [o.name for o in s.model.graph.output]
    seed0 = env_seed()
    for seed in range(seed0, seed0 + SEEDS):
        feeds = random_feeds(s.model, seed, s.dim_values)
        ref = run_reference(s.model, feeds)
        got = dict(zip(outputs, sess.run(None, feeds), strict=True))
        oracle = run_reference(result.model, feeds)  # fused nodes through the numpy oracles
        for out in outputs:
            assert got[out].shape == ref[out].shape
            err = nonzero_rel_err(got[out], ref[out])
            assert err <= RTOL, f"{name}/{out}: ORT vs reference rel err {err:.2e} (seed {seed})"
            err = nonzero_rel_err(oracle[out], ref[out])
            assert err <= RTOL, f"{name}/{out}: oracle rel err {err:.2e} (seed {seed})"


def test_grouped_matmul_samples_lower_the_opset() -> None:
    result = fused("mixtral_gmm_int4b32")
    assert SAMPLES["mixtral_gmm_int4b32"].opset == 29
    assert {o.domain: o.version for o in result.model.opset_import}[""] == 28
    assert {o.domain: o.version for o in result.model.opset_import}[MS] == 1


# -- near misses -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_near_miss_unchanged_with_reason(name: str) -> None:
    s = SAMPLES[name]
    original = get_sample(name).model
    result = fuse(original)
    assert not result.report.fusions
    assert result.model.SerializeToString() == original.SerializeToString()
    assert result.model.graph.SerializeToString() == s.model.graph.SerializeToString()
    reasons = [m["reason"] for m in result.report.near_misses]
    keyword = (s.near_miss_reason or "").lower()
    assert any(keyword in r.lower() for r in reasons), f"{name}: {reasons}"
    miss = next(m for m in result.report.near_misses if keyword in m["reason"].lower())
    assert miss["topk"] and miss["topk"].startswith("TopK")
    assert miss["root"] and miss["rule"]


# -- only ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mixtral_dec_int4b32", "gptoss_gmm_u8pc", "qwen3_dec_int4b128"])
def test_only_moe_leaves_qmoe_layers_unchanged(name: str) -> None:
    original = get_sample(name).model
    result = fuse(original, only={"MoE"})
    assert not result.report.fusions
    assert result.model.SerializeToString() == original.SerializeToString()
    assert any("not among the requested ops" in m["reason"] for m in result.report.near_misses)


def test_only_selects_ops() -> None:
    assert fuse(get_sample("mixtral_dec_f32").model, only={"MoE"}).report.fusions
    assert not fuse(get_sample("mixtral_dec_f32").model, only={"QMoE"}).report.fusions
    assert fuse(get_sample("mixtral_dec_u8pc").model, only={"QMoE"}).report.fusions
    with pytest.raises(ValueError):
        fuse(get_sample("mixtral_dec_f32").model, only={"Gemm"})


# -- escapes -------------------------------------------------------------------------------------


def _with_output(model: onnx.ModelProto, value: str) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.output.append(onnx.helper.make_tensor_value_info(value, onnx.TensorProto.FLOAT, None))
    return m


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("mixtral_dec_f32", "router_probs"),  # the router Softmax (gpt-oss blocks output it)
        ("mixtral_dec_int4b32", "topk_probs"),  # the TopK values
        ("mixtral_dec_u8pc", "fc2_weight"),  # the dequantized weights
    ],
)
def test_escape_upstream_of_experts_is_kept_and_the_rest_fuses(name: str, value: str) -> None:
    """A value that escapes but does not depend on the tokens stays; the layer still fuses."""
    s = SAMPLES[name]
    model = _with_output(s.model, value)
    result = fuse(model)
    assert len(result.report.fusions) == 1, result.report.near_misses
    (fusion,) = result.report.fusions
    assert fusion["kept"], fusion
    producers = {o for n in result.model.graph.node for o in n.output}
    assert value in producers or value in {i.name for i in result.model.graph.initializer}
    sess = session(result.model, log_severity_level=3)
    outputs = [o.name for o in model.graph.output]
    feeds = random_feeds(s.model, env_seed(), s.dim_values)
    ref = run_reference(model, feeds)
    got = dict(zip(outputs, sess.run(None, feeds), strict=True))
    for out in outputs:
        err = nonzero_rel_err(got[out], ref[out])
        assert err <= RTOL, f"{name}/{out}: rel err {err:.2e}"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("gptoss_dec_f32", "gate_clamped"),  # deep inside the activation
        ("mixtral_dec_f32", "fc1_gate_matmul"),  # an expert projection
    ],
)
def test_escaping_expert_intermediate_leaves_layer_unchanged(name: str, value: str) -> None:
    model = _with_output(get_sample(name).model, value)
    producers = {o for n in model.graph.node for o in n.output}
    assert value in producers, sorted(producers)
    result = fuse(model)
    assert not result.report.fusions
    assert result.model.SerializeToString() == model.SerializeToString()
    misses = [m for m in result.report.near_misses if m["part"] == "region"]
    assert any("escape" in m["reason"] and value in m["reason"] for m in misses), misses


# -- API and passes ----------------------------------------------------------------------------


def test_fuse_takes_ir_model_and_path(tmp_path) -> None:
    model = get_sample("qwen2_dec_f32").model
    ir_model = ir.serde.deserialize_model(model)
    result = fuse(ir_model)
    assert result.ir_model is ir_model and len(result.report.fusions) == 1
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    result = fuse(path)
    assert [f["op"] for f in result.report.fusions] == ["MoE"]
    assert result.report.to_dict()["fusions"][0]["op"] == "MoE"
    with pytest.raises(TypeError):
        fuse(b"not a model")  # type: ignore[arg-type]


def test_pipeline_passes_compose() -> None:
    report = FusionReport()
    model = ir.serde.deserialize_model(get_sample("gptoss_gmm_int4b128").model)
    result = fusion_pipeline(report)(model)
    assert result.modified and len(report.fusions) == 1
    assert model.opset_imports[""] == 28
    assert not any(n.op_type == "DequantizeLinear" for n in model.graph)
    assert (
        "onnx_moe_fuse.replaced"
        not in next(n for n in model.graph if n.domain == MS).metadata_props
    )


def test_lower_opset_keeps_grouped_matmul_models() -> None:
    model = ir.serde.deserialize_model(get_sample("nearmiss_erf_gelu_gmm_f32").model)
    assert not LowerOpsetPass()(model).modified
    assert model.opset_imports[""] == 29


def test_postcondition_refuses_internal_ops() -> None:
    model = ir.serde.deserialize_model(get_sample("mixtral_dec_f32").model)
    node = next(iter(model.graph))
    node.domain = "ai.onnx_moe_fuse.internal"
    with pytest.raises(ir.passes.PostconditionError):
        FusedNodesCheckPass()(model)


def test_two_layers_one_fused_one_near_miss() -> None:
    """A fusable layer and a near miss in one graph: one fuses, the other is left as it was."""
    a = get_sample("mixtral_dec_f32").model
    b = get_sample("nearmiss_weights_not_const_dec_f32").model
    for m in (a, b):
        del m.metadata_props[:]
    b = onnx.compose.add_prefix(b, "b_")
    merged = onnx.compose.merge_models(a, b, io_map=[("y", "b_x")])
    result = fuse(merged)
    assert [f["op"] for f in result.report.fusions] == ["MoE"]
    assert any("constant" in m["reason"] for m in result.report.near_misses)

    def layer_b(model: onnx.ModelProto) -> list[tuple]:
        return [
            (n.name, n.domain or "", n.op_type, list(n.input), list(n.output))
            + tuple(a.SerializeToString() for a in n.attribute)
            for n in model.graph.node
            if n.output and n.output[0].startswith("b_")
        ]

    assert layer_b(result.model) == layer_b(merged)
    kept = {t.name: t for t in result.model.graph.initializer if t.name.startswith("b_")}
    assert kept.keys() == {t.name for t in merged.graph.initializer if t.name.startswith("b_")}
    seed = env_seed()
    feeds = random_feeds(merged, seed, {"T": 5})
    ref = run_reference(merged, feeds)["b_y"]
    got = session(result.model, log_severity_level=3).run(None, feeds)[0]
    assert nonzero_rel_err(got, ref) <= RTOL, f"seed {seed}"
