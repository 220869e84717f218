"""Tests of ``CanonicalSortedExpertsPass``: grouped_mm (sorted rows) experts -> GroupedMatMul.

On the exported ``mixtral_grouped_mm`` sample: the pass writes the per-slot form, keeps the boundary
names, leaves the original model's bytes alone, keeps the numbers (ORT CPU, with GroupedMatMul
decomposed into the Gather/MatMul form ORT runs), and ``fuse`` then fuses one MoE matching the
stored PyTorch output. Negative tests break one link of the proof in the sample (an un-sort by
another permutation, bin edges, expert order, a non-row-wise activation) and check the block comes
out byte-identical with a reason. The causal-LM exports in ``sample_models/exported/causal_lm``
(whole models, several families, dynamic and static shapes) fuse every layer their metadata expects
through ``fuse`` and match PyTorch (float16 ones too, their float32 combine's Cast kept).
The static export's folded un-sort constants are broken one at a time (not ``arange``, a longer
blank, slots of another token count) and stay refused. The pass records each refusal, as it runs,
for the routing TopK whose ids it sorts. A hypothesis property builds random hand-written blocks
(:mod:`sorted_models`: sizes, activation, biases, weight layout, floor-divide, weighting and un-sort
spellings) and checks the numbers.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import decompose_grouped_matmul
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sorted_models import BlockSpec, build_block

import onnx_moe_fuse
from onnx_moe_fuse.rewrites.canonical.experts.sorted.sorted_experts import (
    CanonicalSortedExpertsPass,
    sorted_experts_refusals,
)
from onnx_moe_fuse.rewrites.canonical.passes import canonicalisation_passes
from onnx_moe_fuse.rewrites.graph.refusals import SORTED_EXPERTS, recorded

SAMPLE = Path(__file__).resolve().parents[4] / "sample_models" / "exported" / "mixtral_grouped_mm"
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
    reason = pss.refusals[0].reason
    assert all(w in reason for w in words), reason
    assert [r for _, r in sorted_experts_refusals(model)] == [reason]


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
    canon = decompose_grouped_matmul(work, 20)
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


def test_fuse_near_miss_says_which_link_of_the_sort_failed():
    """Through the whole pipeline: the refused grouped_mm layer's near miss carries the proof."""
    model = _sample()
    edges = model.graph.initializers["val_63"]
    edges.const_value = ir.tensor(edges.const_value.numpy() + np.float32(0.8), name="val_63")
    proto = ir.serde.serialize_model(model)
    result = onnx_moe_fuse.fuse(proto)
    assert not result.report.fusions
    assert result.model.SerializeToString() == proto.SerializeToString()
    reasons = [m["reason"] for m in result.report.near_misses]
    assert any("the sorted-experts pass: the histogram bins" in r for r in reasons), reasons


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
STATIC = SAMPLE.parent / "causal_lm" / "mixtral_grouped_mm_static_op18.onnx"


def _meta(path: Path) -> dict:
    return json.loads(path.with_suffix(".json").read_text())


#: fused ORT vs PyTorch logits by dtype (float16: the export's own 2e-2; its fusion adds ~1e-3)
_RTOL = {"float32": 1e-4, "float16": 2e-2}


def _before_the_pass(model: ir.Model) -> ir.Model:
    """A copy as the pipeline hands it to the pass: after the shape, weight and spelling passes.

    (PhiMoE's two ArgMax rounds are one TopK only once the spelling pass has run.)
    """
    copy = model.clone()
    for stage in canonicalisation_passes():
        if type(stage).__name__ == "CanonicalSlotsPass":  # the layer-form passes start here
            break
        stage(copy)
    return copy


@pytest.mark.parametrize("path", WHOLE_MODELS, ids=[p.stem for p in WHOLE_MODELS])
def test_whole_model_exports(path: Path):
    """Causal-LM exports (another helper writes them): what should fuse fuses, numbers kept.

    Where the export's metadata expects MoE layers, ``fuse`` (which canonicalises a working copy
    itself) fuses every layer and the fused model matches PyTorch (float16 exports too, their
    combine summed in float32 after a widening Cast). Where an export expects none (routers MoE
    cannot express), the pass's working copy, run with GroupedMatMul decomposed, still matches
    PyTorch.
    """
    meta = _meta(path)
    original = ir.load(str(path))
    ref = np.load(path.with_suffix(".npz"))
    feeds = {"input_ids": ref["input_ids"]}
    scale = np.abs(ref["logits"]).max()
    if meta["expected"]:
        assert sorted_experts_refusals(_before_the_pass(original)) == []
        result = onnx_moe_fuse.fuse(original)
        fused = collections.Counter(f["op"] for f in result.report.fusions)
        assert sorted(fused.items()) == sorted((op, n) for op, n in meta["expected"])
        assert not any(n.op_type == "GroupedMatMul" for n in result.ir_model.graph)
        (got,) = _run_ort(result.model, feeds)
        tol = _RTOL[meta["dtype"]]
        got, want = got.astype(np.float64), ref["logits"].astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)
    else:
        work, _, _ = _canonical(original)
        (got,) = _run_ort(decompose_grouped_matmul(work, original.opset_imports[""]), feeds)
        tol = _RTOL[meta["dtype"]]
        got, want = got.astype(np.float64), ref["logits"].astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


def _routing_topk(model: ir.Model, sort: ir.Node) -> ir.Node:
    return sort.inputs[0].producer().inputs[0].producer()


def _recorded(model: ir.Model, topk: ir.Node) -> str | None:
    """The reason the pass records for the block that sorts ``topk``'s ids (None: none)."""
    pss = CanonicalSortedExpertsPass()
    pss(model)
    refusal = recorded(pss.refusals, SORTED_EXPERTS, topk)
    return None if refusal is None else refusal.reason


def test_the_refusal_is_recorded_for_that_layer_only():
    model = _sample()
    (sort,) = [n for n in model.graph if n.op_type == "TopK" and n.inputs[0].name == "view_3"]
    router = _routing_topk(model, sort)
    proved = CanonicalSortedExpertsPass()
    assert proved(model.clone()).modified and proved.refusals == []  # the pass rewrites it
    sort.attributes["largest"] = ir.AttrInt64("largest", 1)
    before = _bytes(model)
    reason = _recorded(model, router)
    assert reason is not None and "ascending" in reason
    assert _bytes(model) == before
    assert _recorded(model, sort) is None  # the argsort itself routes nothing


def test_a_float16_block_sums_in_float32_as_the_export_does():
    """A float16 grouped_mm block (FC2's rows cast up to float32, weighted, summed) is proved.

    The per-slot form keeps the widening Cast before the weighting, so the layer output keeps
    its float32 type.
    """
    path = SAMPLE.parent / "causal_lm" / "mixtral_grouped_mm_dynamic_op23_fp16.onnx"
    model = ir.load(str(path))
    pss = CanonicalSortedExpertsPass()
    assert pss(model).modified and pss.refusals == []
    wide = [
        n
        for n in model.graph
        if n.op_type == "Cast" and n.outputs[0].name and "fc2_slots_wide" in n.outputs[0].name
    ]
    assert len(wide) == 2, [n.op_type for n in model.graph]
    for cast in wide:
        assert cast.inputs[0].dtype == ir.DataType.FLOAT16
        assert cast.outputs[0].dtype == ir.DataType.FLOAT
        (mul,) = [u for u, _ in cast.outputs[0].uses()]
        assert mul.op_type == "Mul"


def test_a_block_in_another_float_type_is_refused_naming_the_dtype():
    """Tokens typed float64 (no MoE/QMoE kernel computes in it): the pass leaves the block."""
    path = SAMPLE.parent / "causal_lm" / "mixtral_grouped_mm_dynamic_op23_fp16.onnx"
    model = ir.load(str(path))
    topks = [_routing_topk(model, s) for s in model.graph if s in _sort_nodes(model)]
    pss = CanonicalSortedExpertsPass()
    for node in model.graph:
        for out in node.outputs:
            if out.dtype == ir.DataType.FLOAT16:
                out.dtype = ir.DataType.DOUBLE
    pss(model)
    reasons = [recorded(pss.refusals, SORTED_EXPERTS, t).reason for t in topks]
    assert len(reasons) == 2 and all("float64" in r for r in reasons), reasons


def _sort_nodes(model: ir.Model) -> list[ir.Node]:
    return [
        n
        for n in model.graph
        if n.op_type == "TopK" and n.inputs[0].dtype is not None and n.inputs[0].dtype.is_integer()
    ]


# -- the static-shape export: folded un-sort constants -----------------------------------------


def _static_block_refused(model: ir.Model, broken: ir.Node, *words: str) -> None:
    """Layer 0's block (``broken`` in it) is refused with ``words``; layer 1 is still rewritten."""
    work, pss, modified = _canonical(model)
    assert modified and len(pss.refusals) == 1, pss.refusals
    assert all(w in pss.refusals[0].reason for w in words), pss.refusals
    assert broken.name in {n.name for n in work.graph}
    assert _ops(work)["GroupedMatMul"] == 2


def _first_unsort(model: ir.Model) -> ir.Node:
    return next(n for n in model.graph if n.op_type == "ScatterND")


def _replace_const(model: ir.Model, node: ir.Node, index: int, array: np.ndarray) -> None:
    """Point input ``index`` of ``node`` at a new initializer (the old tensor is not touched)."""
    name = f"{node.inputs[index].name}_broken"
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    model.graph.register_initializer(value)
    node.replace_input_with(index, value)


def test_static_export_folded_unsort_is_proved_for_both_layers():
    model = ir.load(str(STATIC))
    scatter = _first_unsort(model)
    # The static export folds empty_like and arange into constants (no Expand, no Range).
    assert scatter.inputs[0].const_value is not None and scatter.inputs[2].const_value is not None
    work, pss, modified = _canonical(model)
    assert modified and pss.refusals == []
    ops = _ops(work)
    assert ops["GroupedMatMul"] == 4 and ops["ScatterND"] == 0


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda a: a[::-1].copy(),  # a permutation, but not the identity
        lambda a: np.where(a == 5, 6, a),  # 6 twice, 5 never
        lambda a: a + 1,  # shifted
    ],
    ids=["reversed", "repeated", "shifted"],
)
def test_static_export_unsort_by_a_constant_that_is_not_arange_is_refused(corrupt):
    model = ir.load(str(STATIC))
    scatter = _first_unsort(model)
    _replace_const(model, scatter, 2, corrupt(scatter.inputs[2].const_value.numpy()))
    _static_block_refused(model, scatter, "un-sort")


def test_static_export_unsort_into_a_longer_blank_is_refused():
    model = ir.load(str(STATIC))
    scatter = _first_unsort(model)
    blank = scatter.inputs[0].const_value.numpy()
    _replace_const(model, scatter, 0, np.concatenate([blank, blank[:1]]))
    _static_block_refused(model, scatter, "un-sort")


def test_static_export_slots_of_another_token_count_are_refused():
    model = ir.load(str(STATIC))
    scatter = _first_unsort(model)
    gather = next(u.node for u in scatter.outputs[0].uses()).outputs[0].uses()[0].node
    reshape = gather.outputs[0].uses()[0].node
    assert reshape.op_type == "Reshape"
    tokens, k, hidden = reshape.inputs[1].const_value.numpy().tolist()
    # [T/2, k, H]: the right k and H, but T * k is not the number of rows.
    _replace_const(model, reshape, 1, np.array([tokens // 2, k, hidden], dtype=np.int64))
    _static_block_refused(model, reshape, "reshaped")


# -- hand-written blocks -----------------------------------------------------------------------


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
    (got,) = _run_ort(decompose_grouped_matmul(work, 20), {"x": x})
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
