"""Spellings beyond the sample catalogue: activations, SwiGLU cuts, combines, routing, weights.

Each case edits a sample layer into another spelling (the edited layer computes something else,
and the fused node must compute that), fuses it and compares ORT CPU with the reference path on
fresh random inputs (seed in the message; ``ONNX_MOE_FUSE_SEED`` replays it).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable

import numpy as np
import onnx
import onnx.numpy_helper as nh
import onnxruntime as ort
import pytest
from onnx import helper

from onnx_moe_fuse import fuse
from onnx_moe_fuse.samples import get_sample
from onnx_moe_fuse.verify.reference import random_feeds, run_reference

RTOL = 1e-4
MS = "com.microsoft"


def seed() -> int:
    env = os.environ.get("ONNX_MOE_FUSE_SEED")
    return int(env) if env else int(np.random.SeedSequence().entropy % (2**31))


def edit(
    name: str,
    replace: dict[str, list[onnx.NodeProto]],
    consts: dict[str, np.ndarray] | None = None,
    inits: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
) -> onnx.ModelProto:
    """Sample ``name`` with the node making each key of ``replace`` swapped for new nodes."""
    model = get_sample(name).model
    nodes = []
    for node in model.graph.node:
        out = node.output[0] if node.output else ""
        if out in replace:
            nodes.extend(replace.pop(out))
        else:
            nodes.append(node)
    assert not replace, f"no node makes {list(replace)}"
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    arrays = {t.name: nh.to_array(t) for t in model.graph.initializer}
    if inits is not None:
        arrays = inits(arrays)
    arrays.update(consts or {})
    del model.graph.initializer[:]
    model.graph.initializer.extend(nh.from_array(a, n) for n, a in arrays.items())
    return model


def check_fused(model: onnx.ModelProto, op: str, **attrs: object) -> dict[str, object]:
    result = fuse(model)
    assert [f["op"] for f in result.report.fusions] == [op], result.report.near_misses
    got = result.report.fusions[0]["attributes"]
    for key, want in attrs.items():
        assert got[key] == pytest.approx(want) if isinstance(want, float) else got[key] == want
    counts = collections.Counter(n.op_type for n in result.model.graph.node)
    assert counts["TopK"] == 0 and counts["Gather"] == 0
    s = seed()
    dims = {"T": 5, "B": 2, "S": 3}
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(
        result.model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
    )
    for k in range(2):
        feeds = random_feeds(model, s + k, dims)
        ref = run_reference(model, feeds)["y"]
        out = sess.run(None, feeds)[0]
        err = float(np.abs(out - ref).max() / np.abs(ref).max())
        assert err <= RTOL, f"ORT vs reference rel err {err:.2e} (seed {s + k})"
    return got


def refused(model: onnx.ModelProto, words: str) -> None:
    result = fuse(model)
    assert not result.report.fusions
    assert result.model.SerializeToString() == model.SerializeToString()
    reasons = [m["reason"] for m in result.report.near_misses]
    assert any(words in r.lower() for r in reasons), reasons


# -- element-wise activations (GELU-MLP base: FC1 output "fc1_proj", activation "gelu") --------


def test_relu() -> None:
    m = edit("gelu_dec_f32", {"gelu": [helper.make_node("Relu", ["fc1_proj"], ["gelu"])]})
    check_fused(m, "MoE", activation_type="relu", swiglu_fusion=0)


@pytest.mark.parametrize("order", ["x_sig", "sig_x"])
def test_silu(order: str) -> None:
    mul_in = ["fc1_proj", "s"] if order == "x_sig" else ["s", "fc1_proj"]
    m = edit(
        "gelu_gmm_f32",
        {
            "gelu": [
                helper.make_node("Sigmoid", ["fc1_out"], ["s"]),
                helper.make_node(
                    "Mul", [i.replace("fc1_proj", "fc1_out") for i in mul_in], ["gelu"]
                ),
            ]
        },
    )
    check_fused(m, "MoE", activation_type="silu")


def test_identity() -> None:
    m = edit("gelu_dec_f32", {"gelu": [helper.make_node("Identity", ["fc1_proj"], ["gelu"])]})
    # an Identity node is not the identity activation spelling; rewire FC2 to read FC1 directly
    for node in m.graph.node:
        for i, v in enumerate(node.input):
            if v == "gelu":
                node.input[i] = "fc1_proj"
    m.graph.node.remove(next(n for n in m.graph.node if n.op_type == "Identity"))
    check_fused(m, "MoE", activation_type="identity")


def test_exact_gelu_op_refused() -> None:
    m = edit("gelu_dec_f32", {"gelu": [helper.make_node("Gelu", ["fc1_proj"], ["gelu"])]})
    refused(m, "exact gelu")


# -- SwiGLU cuts of one FC1 (gpt-oss base: FC1 output "fc1_out" [M, k, 64], I = 32) ------------


def test_swiglu_split_halves() -> None:
    m = edit(
        "gptoss_dec_f32",
        {
            "gate": [
                helper.make_node("Split", ["fc1_out"], ["gate", "up"], axis=-1, num_outputs=2)
            ],
            "up": [],
        },
    )
    check_fused(m, "MoE", activation_type="swiglu", swiglu_fusion=1, swiglu_limit=7.0)


def test_swiglu_slice_halves_swapped() -> None:
    """Gate from the second half, linear operand from the first: the rows are reordered."""
    m = edit(
        "gptoss_dec_int4b32",
        {
            "gate": [helper.make_node("Slice", ["fc1_out", "s32", "s64", "ax"], ["gate"])],
            "up": [helper.make_node("Slice", ["fc1_out", "s0", "s32", "ax"], ["up"])],
        },
        consts={
            "s0": np.array([0], np.int64),
            "s32": np.array([32], np.int64),
            "s64": np.array([64], np.int64),
            "ax": np.array([-1], np.int64),
        },
    )
    check_fused(m, "QMoE", activation_type="swiglu", block_size=32)


def test_swiglu_one_sided_clamp_refused() -> None:
    m = edit(
        "gptoss_dec_f32", {"up_clamped": [helper.make_node("Identity", ["up"], ["up_clamped"])]}
    )
    for node in m.graph.node:
        for i, v in enumerate(node.input):
            if v == "up_clamped":
                node.input[i] = "up"
    m.graph.node.remove(next(n for n in m.graph.node if n.op_type == "Identity"))
    refused(m, "clamps only one operand")


# -- combine and routing (Mixtral base) ---------------------------------------------------------


@pytest.mark.parametrize("tail", ["squeeze", "reshape"])
def test_matmul_combine(tail: str) -> None:
    last = (
        helper.make_node("Squeeze", ["mixed", "ax1"], ["y"])
        if tail == "squeeze"
        else helper.make_node("Reshape", ["mixed", "shape"], ["y"])
    )
    m = edit(
        "mixtral_dec_f32",
        {
            "routing_weights_3d": [
                helper.make_node("Unsqueeze", ["routing_weights", "ax1"], ["routing_weights_3d"])
            ],
            "weighted_expert_out": [
                helper.make_node("MatMul", ["routing_weights_3d", "fc2_proj"], ["mixed"])
            ],
            "y": [last],
        },
        consts={"ax1": np.array([1], np.int64), "shape": np.array([0, 64], np.int64)},
    )
    check_fused(m, "MoE", normalize_routing_weights=1)


def test_renormalise_by_reciprocal() -> None:
    m = edit(
        "qwen3_dec_u8pc",
        {
            "routing_weights": [
                helper.make_node("Reciprocal", ["topk_sum"], ["inv"]),
                helper.make_node("Mul", ["inv", "topk_probs"], ["routing_weights"]),
            ]
        },
    )
    check_fused(m, "QMoE", normalize_routing_weights=1, expert_weight_bits=8, block_size=0)


def test_softmax_twice_is_softmax_of_probabilities() -> None:
    """Softmax -> TopK -> Softmax over k: QMoE/MoE with router_probs = the probabilities."""
    m = edit(
        "mixtral_dec_f32",
        {"routing_weights": [helper.make_node("Softmax", ["topk_probs"], ["routing_weights"])]},
    )
    m.graph.node.remove(next(n for n in m.graph.node if n.output[0] == "topk_sum"))
    check_fused(m, "MoE", normalize_routing_weights=1)


def test_topk_smallest_refused() -> None:
    m = get_sample("mixtral_dec_f32").model
    topk = next(n for n in m.graph.node if n.op_type == "TopK")
    next(a for a in topk.attribute if a.name == "largest").i = 0
    refused(m, "smallest")


# -- weights -----------------------------------------------------------------------------------


def _signed_int8(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, a in arrays.items():
        if name.endswith("_zero_point"):
            continue
        out[name] = (a.astype(np.int16) - 128).astype(np.int8) if name.endswith("_quant") else a
    return out


def test_int8_without_zero_point() -> None:
    m = edit("mixtral_dec_u8pc", {}, inits=_signed_int8)
    for node in m.graph.node:
        if node.op_type == "DequantizeLinear":
            del node.input[2:]
    check_fused(m, "QMoE", expert_weight_bits=8, block_size=0)


def test_uint8_without_zero_point_fuses_with_zero_point_0() -> None:
    """uint8 codes without a zero point mean zp 0: explicit zero-point inputs on ort-cpu."""
    m = get_sample("mixtral_dec_u8pc").model
    for node in m.graph.node:
        if node.op_type == "DequantizeLinear":
            del node.input[2:]
    check_fused(m, "QMoE", expert_weight_bits=8, block_size=0)
    fused = fuse(m).model
    qmoe = next(n for n in fused.graph.node if n.op_type == "QMoE")
    consts = {t.name: nh.to_array(t) for t in fused.graph.initializer}
    for slot in (11, 12):  # fc1/fc2 zero points, column-wise [E, N]: all 0
        zp = consts[qmoe.input[slot]]
        assert zp.ndim == 2 and not zp.any(), (slot, zp.shape)
    result = fuse(m, target="ort-webgpu")
    assert not result.report.fusions
    assert any("zero points" in n["reason"] for n in result.report.near_misses)


def test_mixed_float_and_quantized_refused() -> None:
    m = get_sample("mixtral_dec_int4b32").model
    dq = next(
        n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "fc2_weight"
    )
    m.graph.node.remove(dq)
    rng = np.random.default_rng(0)
    m.graph.initializer.append(
        nh.from_array(rng.standard_normal((8, 32, 64)).astype(np.float32), "fc2_weight")
    )
    refused(m, "quantized and others are float")


def test_rank3_tokens_without_flattening() -> None:
    """Tokens [B, S, H] straight into router and experts: router_probs reshaped to [B*S, E]."""
    m = get_sample("mixtral_dec_int4b32_rank3").model
    new_axes = {
        "fc1_gate_tokens": "ax23",
        "fc1_up_tokens": "ax23",
        "fc1_gate_proj": "ax3",
        "fc1_up_proj": "ax3",
        "fc2_lhs": "ax3",
        "fc2_proj": "ax3",
        "layer_out": "ax2",
    }
    nodes = []
    for node in m.graph.node:
        if node.output[0] == "tokens":
            continue
        node.input[:] = ["x" if v == "tokens" else v for v in node.input]
        if node.output[0] in new_axes:
            node.input[1] = new_axes[node.output[0]]
        nodes.append(node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    for name, axes in (("ax23", [2, 3]), ("ax3", [3]), ("ax2", [2])):
        m.graph.initializer.append(nh.from_array(np.array(axes, np.int64), name))
    got = check_fused(m, "QMoE", k=2, block_size=32)
    assert got["activation_type"] == "swiglu"
    fused = fuse(m).model
    qmoe = next(n for n in fused.graph.node if n.op_type == "QMoE")
    reshape = next(n for n in fused.graph.node if n.output[0] == qmoe.input[1])
    assert reshape.op_type == "Reshape" and qmoe.input[0] == "x"
