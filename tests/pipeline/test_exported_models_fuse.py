"""The MoE layer rules on real torch.onnx exports (``sample_models/exported``), and variants.

Every ``*_batched_mm*`` export fuses exactly into what its record (``<name>.json``) expects, and
the fused model, run in ONNX Runtime CPU, matches the stored PyTorch output and the reference
path on the original; the recorded "none" forms come out unchanged with a plain-words reason.
Variants edited from the exports (weights replaced by int4 DequantizeLinear, other spellings of
the same layout, structural constants that change the meaning) check QMoE and the refusals.

Inputs are fresh random values on every run; each failure message carries the seed, and
``ONNX_MOE_FUSE_SEED=<seed>`` replays it. No torch needed.
"""

from __future__ import annotations

import collections
import json
import math
import os
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper as nh
import onnxruntime as ort
import pytest
from onnx import helper

from onnx_moe_fuse import fuse
from onnx_moe_fuse.pipeline import REQUIRED_ATTRIBUTES
from onnx_moe_fuse.verify.checker import verify
from onnx_moe_fuse.verify.reference import random_feeds, run_reference

RTOL = 1e-4
MS = "com.microsoft"
EXPORTED = Path(__file__).resolve().parents[2] / "sample_models" / "exported"
RECORDS = {
    m["name"]: json.loads((EXPORTED / f"{m['name']}.json").read_text())
    for m in json.loads((EXPORTED / "index.json").read_text())["models"]
}
FUSING = sorted(n for n, r in RECORDS.items() if r["expected"])
UNFUSED = sorted(n for n, r in RECORDS.items() if not r["expected"])
#: token shapes [batch, sequence] of the random inputs (one token; two rows of a prime length)
TOKEN_SHAPES = ({"batch": 1, "sequence": 1}, {"batch": 2, "sequence": 7})


def base_seed() -> int:
    env = os.environ.get("ONNX_MOE_FUSE_SEED")
    return int(env) if env else int(np.random.SeedSequence().entropy % (2**31))


def load(name: str) -> onnx.ModelProto:
    return onnx.load(EXPORTED / f"{name}.onnx")


def fused_node(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.domain == MS]
    return node


def node_attributes(node: onnx.NodeProto) -> dict[str, object]:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}


def assert_matches_reference(original: onnx.ModelProto, fused: onnx.ModelProto) -> None:
    """``fused`` in ORT CPU and through the numpy oracles matches the original's reference path.

    ORT runs through the project's equivalence checker (graph optimisations off, 1e-4 relative
    to the output's largest magnitude), on fresh inputs of each token shape.
    """
    seed = base_seed()
    for i, dims in enumerate(TOKEN_SHAPES):
        report = verify(original, fused, seeds=(seed + i,), dim_values=dims, paths=("ort",))
        report.raise_for_failure()  # the summary names the seed and the errors
        assert report.paths["ort"].outputs["output"].max_rel <= RTOL
        feeds = random_feeds(original, seed + i, dims)
        ref = run_reference(original, feeds)["output"]
        oracle = run_reference(fused, feeds)["output"]
        worst = float(np.abs(oracle - ref).max())
        assert worst <= RTOL * float(np.abs(ref).max()), f"oracle (seed {seed + i}, {dims})"


def refused(model: onnx.ModelProto, words: str, **kwargs) -> str:
    """``model`` comes out byte for byte unchanged with a near miss whose reason has ``words``."""
    result = fuse(model, **kwargs)
    assert not result.report.fusions
    assert result.model.SerializeToString() == model.SerializeToString()
    reasons = [m["reason"] for m in result.report.near_misses]
    hits = [r for r in reasons if words in r.lower()]
    assert hits, reasons
    return hits[0]


# -- graph edits ---------------------------------------------------------------------------------


from export_edits import (  # noqa: E402
    initializer,
    producer,
    quantized,
    replace_nodes,
    set_initializer,
    set_input,
    stacked,
    with_inter,
)

# -- the exports -------------------------------------------------------------------------------


def test_every_batched_mm_export_is_expected_to_fuse() -> None:
    batched = sorted(p.stem for p in EXPORTED.glob("*_batched_mm*.onnx"))
    assert sorted([*batched, "llama4_text_moe"]) == FUSING  # Llama4's own dense experts, top-1
    # Llama4 at top-2 scales one token by two scores: no fused node computes it
    assert UNFUSED == ["llama4_text_moe_top2", "mixtral_eager_torchscript", "mixtral_grouped_mm"]


def test_grouped_mm_export_fuses_like_its_batched_mm_twin() -> None:
    """The sorted per-expert form (canonicalised to the per-slot form on the working copy).

    Its record predates that canonicalisation and still says "left unchanged"; it holds the same
    weights as ``mixtral_batched_mm``, so it must fuse into the same MoE and match PyTorch.
    """
    original = load("mixtral_grouped_mm")
    result = fuse(original)
    assert [f["op"] for f in result.report.fusions] == ["MoE"], result.report.near_misses
    attrs = node_attributes(fused_node(result.model))
    twin = node_attributes(fused_node(fuse(load("mixtral_batched_mm")).model))
    assert attrs == twin
    counts = collections.Counter(n.op_type for n in result.model.graph.node)
    for gone in ("TopK", "CumSum", "ScatterND", "MatMul"):
        assert counts[gone] == 0, f"a {gone} survived: {counts}"
    stored = np.load(EXPORTED / "mixtral_grouped_mm.npz")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        result.model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
    )
    got = session.run(None, {"hidden_states": stored["hidden_states"]})[0]
    err = np.abs(got - stored["output"]).max() / np.abs(stored["output"]).max()
    assert err <= RTOL, f"ORT (fused) vs PyTorch rel err {err:.2e}"
    assert_matches_reference(original, result.model)


BATCHED_FUSING = [n for n in FUSING if "_batched_mm" in n]


def test_llama4_top1_fuses_over_its_scaled_tokens() -> None:
    """Llama4's dense experts with input-scaling scores: one MoE over ``x * score``, weight 1.

    The router stays as written (its scores scale the tokens); the experts, the E-fold tiled
    rows and the sum over experts are gone; the top-2 block stays unchanged, naming k.
    """
    record, original = RECORDS["llama4_text_moe"], load("llama4_text_moe")
    result = fuse(original)
    counts = collections.Counter((n.domain or "", n.op_type) for n in result.model.graph.node)
    assert {op: c for (d, op), c in counts.items() if d == MS} == {"MoE": 1}
    assert counts[("", "TopK")] == 1 and counts[("", "ScatterElements")] == 1
    assert counts[("", "Tile")] == 0 and counts[("", "ReduceSum")] == 0
    assert not result.report.near_misses, result.report.near_misses
    node = fused_node(result.model)
    attrs = node_attributes(node)
    for key, value in record["expected_attributes"].items():
        assert attrs[key] == pytest.approx(value), (key, attrs[key], value)
    scaled = producer(result.model, node.input[0])
    assert scaled.op_type == "Mul"
    assert {producer(result.model, i).op_type for i in scaled.input} >= {"GatherElements"}
    refused = fuse(load("llama4_text_moe_top2"))
    assert not refused.report.fusions
    (miss,) = refused.report.near_misses
    assert miss["part"] == "routing" and "k = 2" in miss["reason"], miss


def test_llama4_passes_verify_and_its_mutants_are_refused() -> None:
    """``--verify`` (wgpu and ORT) on the Llama4 fusion; experts that map 0 to non-zero refused.

    Llama4's unselected experts read zero rows: only when each maps a zero row to zero do they
    add nothing. A stacked bias after gate_up or after down (``[E, 1, N]``, as read for the
    dense experts) breaks that: the dense pass must refuse, naming the zero rows, and the
    layer stays as it is.
    """
    original = load("llama4_text_moe")
    report = verify(original, fuse(original).model, seeds=(3, 4))
    assert report.passed and report.paths["wgpu"].status == "passed", report.summary()
    e, inter, hidden = 4, 48, 64
    for where, shape in (("bmm", (e, 1, 2 * inter)), ("bmm_1", (e, 1, hidden))):
        mutant = onnx.ModelProto()
        mutant.CopyFrom(original)
        node = producer(mutant, where)
        bump = f"{where}_bumped"
        tail = [n for n in mutant.graph.node if where in n.input]
        for n in tail:
            n.input[list(n.input).index(where)] = bump
        mutant.graph.initializer.append(
            nh.from_array(np.full(shape, 0.25, np.float32), f"{bump}_c")
        )
        idx = list(mutant.graph.node).index(node)
        mutant.graph.node.insert(idx + 1, helper.make_node("Add", [where, f"{bump}_c"], [bump]))
        del mutant.graph.value_info[:]
        result = fuse(mutant)
        assert not result.report.fusions, where
        (miss,) = [m for m in result.report.near_misses if m["part"] == "activation"]
        assert "zero row" in miss["reason"], miss


@pytest.mark.parametrize("name", BATCHED_FUSING)
def test_export_fuses_as_recorded(name: str) -> None:
    record, original = RECORDS[name], load(name)
    result = fuse(original)
    counts = collections.Counter((n.domain or "", n.op_type) for n in result.model.graph.node)
    emitted = {op: c for (domain, op), c in counts.items() if domain == MS}
    assert emitted == {op: c for op, c in record["expected"]}
    for op, c in record["kept_ops"]:
        assert counts[("", op)] == c, f"{c} {op} expected, {counts[('', op)]} left"
    for gone in ("TopK", "Softmax", "GatherND", "MatMul", "Split", "Slice", "Clip", "ReduceSum"):
        assert counts[("", gone)] == 0, f"a {gone} survived"
    assert not result.report.near_misses, result.report.near_misses
    (fusion,) = result.report.fusions
    assert fusion["rule"] == "BatchedFusedSwiGLUMoELayer[reshape_reduce_sum]"
    replaced_ops = {n.op_type for n in original.graph.node if n.name in fusion["replaced"]}
    assert {"TopK", "GatherND", "MatMul", "ReduceSum"} <= replaced_ops
    node = fused_node(result.model)
    attrs = node_attributes(node)
    assert set(attrs) == REQUIRED_ATTRIBUTES["MoE"]
    want = {"swiglu_limit": math.inf, "use_sparse_mixer": 0, **record["expected_attributes"]}
    for key, value in want.items():
        assert attrs[key] == pytest.approx(value), (key, attrs[key], value)
        assert fusion["attributes"][key] == pytest.approx(value), key
    # router_probs are the router Gemm's logits; weights output-major, SwiGLU rows interleaved
    assert producer(result.model, node.input[1]).op_type == "Gemm"
    e = record["computes"]["num_experts"]
    inter = record["config"].get("moe_intermediate_size", record["config"]["intermediate_size"])
    weights = {t.name: t for t in result.model.graph.initializer}
    assert list(weights[node.input[2]].dims) == [e, 2 * inter, 64]
    assert list(weights[node.input[4]].dims) == [e, 64, inter]
    has_bias = record["family"] == "gpt_oss"
    assert (node.input[3] != "") == has_bias and (len(node.input) == 6) == has_bias
    onnx.checker.check_model(result.model, full_check=True)


@pytest.mark.parametrize("name", FUSING)
def test_fused_export_matches_pytorch_and_reference(name: str) -> None:
    original = load(name)
    fused = fuse(original).model
    stored = np.load(EXPORTED / f"{name}.npz")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        fused.SerializeToString(), opts, providers=["CPUExecutionProvider"]
    )
    got = session.run(None, {"hidden_states": stored["hidden_states"]})[0]
    err = np.abs(got - stored["output"]).max() / np.abs(stored["output"]).max()
    assert err <= RTOL, f"ORT (fused) vs PyTorch rel err {err:.2e}"
    assert_matches_reference(original, fused)


@pytest.mark.parametrize(
    ("name", "words"),
    [("mixtral_eager_torchscript", "one-hot mask")],
)
def test_unfused_forms_left_unchanged_with_reason(name: str, words: str) -> None:
    """One near miss, at the routing TopK (not at the argsort TopK of grouped_mm)."""
    assert name in UNFUSED
    reason = refused(load(name), words)
    # the analysis of meaning points at the node that departs from the fused op's contract
    assert not reason.startswith("not recognised") and "left as it is" in reason
    (miss,) = fuse(load(name)).report.near_misses
    assert miss["part"] and miss["node"] != miss["topk"]
    router_topk = next(n for n in load(name).graph.node if n.op_type == "TopK")
    assert miss["topk"] == router_topk.name


# -- quantized variants: QMoE ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "limit"), [("qwen3_moe_batched_mm", math.inf), ("gpt_oss_batched_mm", 7.0)]
)
def test_int4_blocked_variant_fuses_into_qmoe(name: str, limit: float) -> None:
    """Weights W -> DequantizeLinear(int4, blocks of 32 along `in`): QMoE 4-bit, block 32.

    Qwen3 stores ``[E, out, in]``, gpt-oss ``[E, in, out]`` (with float biases); I is trimmed to
    32 so that 32 divides both H and I.
    """
    original = quantized(with_inter(load(name), 32))
    result = fuse(original)
    assert [f["op"] for f in result.report.fusions] == ["QMoE"], result.report.near_misses
    node = fused_node(result.model)
    attrs = node_attributes(node)
    assert set(attrs) == REQUIRED_ATTRIBUTES["QMoE"]
    assert attrs["expert_weight_bits"] == 4 and attrs["block_size"] == 32
    assert attrs["activation_type"] == "swiglu" and attrs["swiglu_fusion"] == 1
    assert attrs["normalize_routing_weights"] == 1
    assert attrs["swiglu_limit"] == pytest.approx(limit)
    e, k = RECORDS[name]["computes"]["num_experts"], RECORDS[name]["computes"]["top_k"]
    assert attrs["k"] == k
    weights = {t.name: nh.to_array(t) for t in result.model.graph.initializer}
    assert weights[node.input[2]].shape == (e, 64, 32) and weights[node.input[2]].dtype == np.uint8
    assert weights[node.input[3]].shape == (e, 64, 2)  # fc1 scales [E, 2I, H / 32]
    assert weights[node.input[5]].shape == (e, 64, 16)
    assert weights[node.input[6]].shape == (e, 64, 1)
    assert (node.input[4] != "") == (name == "gpt_oss_batched_mm")
    kinds = {n.op_type for n in result.model.graph.node}
    assert not kinds & {"DequantizeLinear", "GatherND", "TopK"}
    assert_matches_reference(original, result.model)


def test_int4_blocked_along_output_axis_refused() -> None:
    """QMoE blocks along the reduction axis; [E, out, in] blocked along axis 1 is the wrong one."""
    refused(quantized(with_inter(load("mixtral_batched_mm"), 32), along_input=False), "axis 2 of")


def test_int4_unnormalised_routing_fuses_through_router_weights() -> None:
    """Qwen2-MoE's top-k weights used as they are, int4 experts: QMoE fed router_weights.

    QMoE renormalises its own softmax, so the weights go in through the routing construction
    (ORT CPU: router_weights, normalize_routing_weights=0, and a per-token rescale).
    """
    m = quantized(with_inter(load("qwen2_moe_batched_mm"), 32))
    result = fuse(m)
    assert [f["op"] for f in result.report.fusions] == ["QMoE"], result.report.near_misses
    (fusion,) = result.report.fusions
    assert fusion["routing"]["construction"] == "router_weights"
    assert fusion["attributes"]["normalize_routing_weights"] == 0
    assert_matches_reference(m, result.model)


# -- other spellings of the flattened-rows layout ------------------------------------------------


def test_swapped_split_halves() -> None:
    """Gate from the second half of gate_up, up from the first: the rows are reordered."""
    m = load("mixtral_batched_mm")
    split = next(n for n in m.graph.node if n.op_type == "Split")
    split.output[0], split.output[1] = split.output[1], split.output[0]
    result = fuse(m)
    assert [f["op"] for f in result.report.fusions] == ["MoE"], result.report.near_misses
    assert_matches_reference(m, result.model)


def test_separate_gate_and_up_experts() -> None:
    """Two GatherND projections (gate, up) of the same rows instead of one Split gate_up.

    mixtral_batched_mm: val_30 = GatherND(val_23, val_28); bmm = MatMul(val_30, unsqueeze);
    squeeze = Squeeze(bmm, val_22); split_split_0, split_split_1 = Split(squeeze).
    """
    m = load("mixtral_batched_mm")
    gate_up = initializer(m, "val_23")
    half = gate_up.shape[1] // 2
    set_initializer(m, "val_23", None)
    m.graph.initializer.extend(
        [
            nh.from_array(gate_up[:, :half].copy(), "w_gate"),
            nh.from_array(gate_up[:, half:].copy(), "w_up"),
        ]
    )
    parts = (("gate", "split_split_0"), ("up", "split_split_1"))
    replace_nodes(
        m,
        {
            "val_30": [
                helper.make_node("GatherND", [f"w_{p}", "val_28"], [f"g_{p}"]) for p, _ in parts
            ],
            "bmm": [
                helper.make_node("MatMul", [f"g_{p}", "unsqueeze"], [f"mm_{p}"]) for p, _ in parts
            ],
            "squeeze": [helper.make_node("Squeeze", [f"mm_{p}", "val_22"], [o]) for p, o in parts],
            "split_split_0": [],
        },
    )
    result = fuse(m)
    assert [f["rule"] for f in result.report.fusions] == [
        "BatchedGatedSwiGLUMoELayer[reshape_reduce_sum]"
    ], result.report.near_misses
    assert_matches_reference(m, result.model)


def test_non_gated_experts_relu() -> None:
    """transformers' has_gate=False: one `up` projection [E, I, H] and an element-wise activation.

    mixtral_batched_mm: squeeze (FC1) -> Split -> val_34 = Sigmoid, silu, mul_45 (the
    activation) -> unsqueeze_1 -> FC2; here mul_45 = Relu(squeeze).
    """
    m = load("mixtral_batched_mm")
    gate_up = initializer(m, "val_23")
    set_initializer(m, "val_23", np.ascontiguousarray(gate_up[:, : gate_up.shape[1] // 2]))
    replace_nodes(
        m,
        {
            "split_split_0": [],
            "val_34": [],
            "silu": [],
            "mul_45": [helper.make_node("Relu", ["squeeze"], ["mul_45"])],
        },
    )
    result = fuse(m)
    assert [f["rule"] for f in result.report.fusions] == [
        "BatchedElementwiseMoELayer[reshape_reduce_sum]"
    ], result.report.near_misses
    assert result.report.fusions[0]["attributes"]["activation_type"] == "relu"
    assert_matches_reference(m, result.model)


def _reshape_drop(m: onnx.ModelProto) -> None:
    """FC1's ``Squeeze(bmm, [-1])`` -> ``Reshape(bmm, [0, 2I])``."""
    m.graph.initializer.append(nh.from_array(np.array([0, 96], np.int64), "drop_shape"))
    replace_nodes(m, {"squeeze": [helper.make_node("Reshape", ["bmm", "drop_shape"], ["squeeze"])]})


def _short_expand_shape(m: onnx.ModelProto) -> None:
    """``Expand(Unsqueeze(x, [1]), [1, k, 1])`` -> ``[k, 1]`` (the same broadcast)."""
    set_input(m, "val_15", 1, np.array([2, 1], np.int64))


def _combine_mul_swapped(m: onnx.ModelProto) -> None:
    node = producer(m, "mul_57")
    node.input[0], node.input[1] = node.input[1], node.input[0]


@pytest.mark.parametrize("edit", [_reshape_drop, _short_expand_shape, _combine_mul_swapped])
def test_equivalent_spellings_fuse(edit) -> None:
    m = load("mixtral_batched_mm")
    edit(m)
    result = fuse(m)
    assert [f["op"] for f in result.report.fusions] == ["MoE"], result.report.near_misses
    assert_matches_reference(m, result.model)


# -- refusals: a structural constant that changes the meaning, or what MoE cannot take ---------


def test_gate_clamped_from_below_refused() -> None:
    m = load("gpt_oss_batched_mm")
    set_input(m, "clamp", 1, np.array(-7.0, np.float32))  # Clip(gate, "", 7) -> Clip(gate, -7, 7)
    refused(m, "is not min(gate, limit)")


def test_repeat_count_not_k_refused() -> None:
    m = load("mixtral_batched_mm_hf_table")  # Tile(Unsqueeze(x, [1]), [1, k, 1])
    tile = next(n for n in m.graph.node if n.op_type == "Tile")
    set_input(m, tile.output[0], 1, np.array([1, 3, 1], np.int64))
    refused(m, "does not repeat each token exactly k = 2 times")


def test_combine_reshape_not_token_slots_refused() -> None:
    """Reshape [-1, k, H] -> [k, -1, H]: a valid shape, but it sums rows of different tokens."""
    m = load("qwen3_moe_batched_mm")
    reduce = next(
        n
        for n in m.graph.node
        if n.op_type == "ReduceSum" and producer(m, n.input[0]).op_type == "Reshape"
    )
    set_input(m, reduce.input[0], 1, np.array([4, -1, 64], np.int64))
    refused(m, "restore the [t, k, h] slots")


@pytest.mark.parametrize(
    ("output", "index", "value", "words"),
    [
        ("val_28", 1, [0], "does not make the flat ids [t*k, 1]"),  # ids Unsqueeze axis 0
        ("view_3", 1, [2, -1], "does not flatten the top-k ids"),  # ids Reshape [2, -1]
        ("unsqueeze", 1, [1], "does not make each fc1 input a column"),  # [R, 1, K]
        ("view_5", 1, [2, -1], "does not flatten the routing weights"),  # as [k, T]
        ("sum_2", 1, [0], "does not sum over the k slots"),
    ],
)
def test_structural_constant_refused(output: str, index: int, value: list, words: str) -> None:
    """A constant of mixtral_batched_mm changed so that the layer means something else."""
    m = load("mixtral_batched_mm")
    set_input(m, output, index, np.array(value, np.int64))
    refused(m, words)


def test_gather_nd_batch_dims_refused() -> None:
    m = load("mixtral_batched_mm")
    gather = next(n for n in m.graph.node if n.op_type == "GatherND")
    next(a for a in gather.attribute if a.name == "batch_dims").i = 1
    refused(m, "batch_dims 1")


def test_expert_weights_graph_input_refused() -> None:
    m = load("mixtral_batched_mm")
    (_, w2) = stacked(m, 3)
    array = initializer(m, w2)
    set_initializer(m, w2, None)
    m.graph.input.append(helper.make_tensor_value_info(w2, onnx.TensorProto.FLOAT, array.shape))
    refused(m, "not constant")


def test_escaping_fc1_output_refused() -> None:
    m = load("gpt_oss_batched_mm")
    m.graph.output.append(helper.make_tensor_value_info("add_46", onnx.TensorProto.FLOAT, None))
    reason = refused(m, "escape")
    assert "add_46" in reason


def test_only_qmoe_leaves_float_export_unchanged() -> None:
    refused(load("qwen2_moe_batched_mm"), "not among the requested ops", only={"QMoE"})
