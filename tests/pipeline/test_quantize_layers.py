"""``fuse(..., quantize=)``: float layers quantised into QMoE end to end, run in ORT CPU.

What is checked against what: the QMoE node's codes and scales against the oracles' quantiser
applied to the weights of the float MoE the same layer fuses into without ``quantize`` (bit for
bit); the fused model in ORT CPU against the QMoE oracle on the node's own inputs (exact: ORT
runs what was written) and against the float original in ORT (within the recorded error's
tolerance); the recorded error against a change of weights (it moves) and against weights
already on the grid (it vanishes). Options that cannot work are ``OptionError``.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnx_moe_fuse import fuse
from onnx_moe_fuse.errors import OptionError
from onnx_moe_fuse.samples import get_sample
from onnx_moe_fuse.samples.handwritten import handwritten_layer
from onnx_moe_fuse.verify.oracles.moe import qmoe
from onnx_moe_fuse.verify.oracles.quant import dequantize_qmoe, quantize_symmetric
from onnx_moe_fuse.verify.ort_nodes import run_node, session
from onnx_moe_fuse.verify.quant_error import VERIFY_FACTOR, measure_quantization_error

MS = "com.microsoft"


def _node(model: onnx.ModelProto, op: str) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.domain == MS and n.op_type == op]
    return node


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _attrs(node: onnx.NodeProto) -> dict:
    values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return session(model).run(None, feeds)[0]


def _feeds(model: onnx.ModelProto, rng: np.random.Generator, tokens: int = 24) -> dict:
    (x,) = [i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    dims = [d.dim_value or tokens for d in x.type.tensor_type.shape.dim]
    return {x.name: rng.standard_normal(dims).astype(np.float32)}


@pytest.mark.parametrize(
    ("sample", "quantize", "block", "bits", "want_block"),
    [
        ("qwen3_dec_f32", "int4", None, 4, 32),
        ("mixtral_dec_f32", "int4", 0, 4, 0),
        ("gelu_dec_f32", "int8", None, 8, 0),
    ],
)
def test_a_float_sample_quantised_end_to_end_runs_in_ort_cpu(
    rng, sample, quantize, block, bits, want_block
):
    original = get_sample(sample).model
    result = fuse(original, quantize=quantize, block_size=block)
    (fusion,) = result.report.fusions
    node = _node(result.model, "QMoE")
    attrs = _attrs(node)
    assert (attrs["expert_weight_bits"], attrs["block_size"]) == (bits, want_block)
    assert attrs["accuracy_level"] == 0  # ort-cpu's exact mode unless asked otherwise
    record = fusion["quantization"]
    assert (record["bits"], record["block_size"], record["from"]) == (
        bits,
        want_block,
        "float32 weights",
    )
    assert 0 < record["max_rel_error"] < (0.5 if bits == 4 else 0.05)
    assert result.report.quantization["quantize"] == quantize

    # the codes: the oracles' quantiser on the weights the same layer has as a float MoE
    float_moe = _node(fuse(original).model, "MoE")
    floats, got = _inits(fuse(original).model), _inits(result.model)
    for slot, (w_in, s_in) in {2: (2, 3), 4: (5, 6)}.items():
        w = floats[float_moe.input[slot]]
        packed, scales = quantize_symmetric(w, bits, want_block or None)
        np.testing.assert_array_equal(got[node.input[w_in]], packed)
        np.testing.assert_array_equal(got[node.input[s_in]], scales)

    # ORT runs what was written: the QMoE oracle on the node's own inputs, through the graph
    feeds = _feeds(original, rng)
    fused_out = _run(result.model, feeds)
    float_out = _run(original, feeds)
    err = np.abs(fused_out - float_out).max() / np.abs(float_out).max()
    assert 0 < err <= VERIFY_FACTOR * record["max_rel_error"], (err, record)


def test_the_qmoe_node_computes_its_oracle_in_ort():
    """One float layer quantised: ORT's output is the QMoE oracle of the emitted inputs."""
    original = get_sample("qwen2_dec_f32").model
    result = fuse(original, quantize="int4")
    node = _node(result.model, "QMoE")
    attrs, inits = _attrs(node), _inits(result.model)
    # run the node alone, its router and tokens fed: the rest of the graph is ours to check
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    logits = rng.standard_normal((16, 8)).astype(np.float32)
    inputs = [x, logits] + [inits.get(name) if name else None for name in node.input[2:]]
    got = run_node("QMoE", inputs, attrs, const=range(2, len(inputs)))
    want = qmoe(
        x,
        logits,
        inputs[2],
        inputs[3],
        inputs[5],
        inputs[6],
        k=attrs["k"],
        activation_type=attrs["activation_type"],
        expert_weight_bits=4,
        block_size=32,
        swiglu_fusion=attrs["swiglu_fusion"],
        normalize_routing_weights=attrs["normalize_routing_weights"],
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_hand_written_float_layer_quantised_runs_in_ort(rng):
    layer = handwritten_layer("swish_swiglu")
    result = fuse(layer.model, quantize="int8")
    (fusion,) = result.report.fusions
    assert fusion["op"] == "QMoE" and fusion["attributes"]["block_size"] == 0
    feeds = _feeds(layer.model, rng)
    ref = _run(layer.model, feeds)
    err = np.abs(_run(result.model, feeds) - ref).max() / np.abs(ref).max()
    assert 0 < err <= VERIFY_FACTOR * fusion["quantization"]["max_rel_error"]


def test_the_recorded_error_is_measured_not_a_constant(rng):
    w1 = rng.standard_normal((4, 64, 32)).astype(np.float32)
    w2 = rng.standard_normal((4, 32, 32)).astype(np.float32)
    attrs = {
        "k": 2,
        "activation_type": "swiglu",
        "swiglu_fusion": 1,
        "expert_weight_bits": 4,
        "block_size": 16,
        "swiglu_limit": float("inf"),
    }

    def measured(a, b, bits=4, block=16):
        p1, s1 = quantize_symmetric(a, bits, block or None)
        p2, s2 = quantize_symmetric(b, bits, block or None)
        floats = {"fc1_experts_weights": a, "fc2_experts_weights": b}
        quant = {
            "fc1_experts_weights": p1,
            "fc1_scales": s1,
            "fc2_experts_weights": p2,
            "fc2_scales": s2,
        }
        return measure_quantization_error(
            floats, quant, {**attrs, "expert_weight_bits": bits, "block_size": block}
        )["max_rel_error"]

    base = measured(w1, w2)
    assert 0.01 < base < 0.5
    other = measured(rng.standard_normal(w1.shape).astype(np.float32), w2)
    assert other != base  # other weights, another error
    assert measured(w1, w2, bits=8, block=0) < base / 5  # a finer grid, a smaller error
    # weights already on the grid quantise losslessly: the error vanishes
    p1, s1 = quantize_symmetric(w1, 4, 16)
    p2, s2 = quantize_symmetric(w2, 4, 16)
    on_grid = measured(dequantize_qmoe(p1, s1, 4, 16), dequantize_qmoe(p2, s2, 4, 16))
    assert on_grid < 1e-5


def test_accuracy_level_is_written_and_reported_as_inexact(rng):
    original = get_sample("qwen3_dec_f32").model
    exact = fuse(original, quantize="int4")
    level4 = fuse(original, quantize="int4", accuracy_level=4)
    assert _attrs(_node(level4.model, "QMoE"))["accuracy_level"] == 4
    assert level4.report.quantization["accuracy_level"] == 4
    assert "int8 activations, not exact" in level4.report.quantization["note"]
    feeds = _feeds(original, rng)
    a, b = _run(exact.model, feeds), _run(level4.model, feeds)
    diff = np.abs(a - b).max() / np.abs(a).max()
    assert 1e-4 < diff < 5e-2  # int8 activations: measured about 1 % off the exact QMoE
    # a quantized layer's QMoE takes it too, without --quantize
    dq = fuse(get_sample("qwen3_dec_int4b32").model, accuracy_level=4)
    assert _attrs(_node(dq.model, "QMoE"))["accuracy_level"] == 4
    assert "quantization" not in dq.report.fusions[0]


def test_webgpu_takes_the_quantised_swiglu_layer_and_refuses_accuracy_level():
    result = fuse(get_sample("mixtral_dec_f32").model, quantize="int4", target="ort-webgpu")
    assert [f["op"] for f in result.report.fusions] == ["QMoE"]
    assert "accuracy_level" not in _attrs(_node(result.model, "QMoE"))
    gelu = fuse(get_sample("gelu_dec_f32").model, quantize="int4", target="ort-webgpu")
    assert not gelu.report.fusions
    assert any(m["part"] == "target" and "swiglu" in m["reason"] for m in gelu.report.near_misses)
    with pytest.raises(OptionError, match="ort-webgpu.*accuracy_level"):
        fuse(get_sample("mixtral_dec_f32").model, accuracy_level=4, target="ort-webgpu")


def test_quantized_layers_are_left_to_their_own_codes():
    """--quantize touches float layers only: a DequantizeLinear layer fuses as it did."""
    model = get_sample("mixtral_dec_int4b32").model
    plain, asked = fuse(model), fuse(model, quantize="int8")
    assert plain.model.SerializeToString() == asked.model.SerializeToString()
    assert "quantization" not in asked.report.fusions[0]


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"quantize": "int3"}, "'int3'"),
        ({"quantize": "int4", "block_size": 24}, "power of two"),
        ({"quantize": "int4", "block_size": 8}, "power of two"),
        ({"quantize": "int4", "block_size": 64}, "64 does not divide I = 32"),
        ({"quantize": "int8", "block_size": 32}, "block-wise 8-bit"),
        ({"block_size": 32}, "no effect"),
        ({"quantize": "int4", "only": {"MoE"}}, "exclude"),
        ({"accuracy_level": 9}, "0, 1, 2, 3 or 4"),
        ({"accuracy_level": 4, "target": "ort-cuda"}, "ort-cuda"),
    ],
)
def test_options_that_cannot_work_are_option_errors(options, words):
    with pytest.raises(OptionError, match=words):
        fuse(get_sample("qwen3_dec_f32").model, **options)


def test_a_float16_export_quantised_keeps_its_dtype_and_verifies():
    """A whole float16 2-layer export: QMoE in float16 (float16 scales), within the tolerance."""
    from pathlib import Path

    from onnx_moe_fuse.verify import verify, verify_tolerance

    path = (
        Path(__file__).resolve().parents[2]
        / "sample_models/exported/causal_lm/qwen3_moe_batched_mm_dynamic_op23_fp16.onnx"
    )
    result = fuse(path, quantize="int4", block_size=16)
    assert [(f["op"], f["dtype"]) for f in result.report.fusions] == [("QMoE", "float16")] * 2
    for fusion in result.report.fusions:
        assert fusion["quantization"]["from"] == "float16 weights"
    scales = [t for t in result.model.graph.initializer if t.name.endswith("fc1_scales")]
    assert scales and all(t.data_type == onnx.TensorProto.FLOAT16 for t in scales)
    report = verify(
        path, result.model, seeds=(0,), paths=("ort",),
        quantization=verify_tolerance(result.report.fusions),
    )  # fmt: skip
    assert report.passed, report.summary()
