"""Dense all-experts spellings beyond the first three forms, and near misses that name the part.

* The one-hot spelled ``Cast(Equal(Unsqueeze(idx, -1), arange(E)))`` (every expert compared at
  once, as optimum-onnx and Mobius write it) and the ``Einsum("te,eth->th")`` combine are
  canonicalised by ``CanonicalDenseExpertsPass`` alone (the Einsum reaches it unlowered where
  the mask's element type is unknown) and fuse to one MoE / QMoE matching ORT CPU on the dense
  model within 1e-5 of the output's scale, on fresh random tokens.
* A dense layer broken only in its router, its TopK or its weights is recognised from its
  mask: the model comes out byte-identical and the near miss names the part (``routing``,
  ``fc1``), the node and the reason in the words the gathered forms use, not the generic
  "not recognised".
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from dense_models import DenseSpec, build_dense, reference
from helpers import env_seed, nonzero_rel_err

from onnx_moe_fuse import fuse
from onnx_moe_fuse.rewrites.canonical.experts.dense.dense_experts import (
    CanonicalDenseExpertsPass,
    dense_experts_refusals,
)
from onnx_moe_fuse.rewrites.graph.facts import label
from onnx_moe_fuse.rewrites.graph.refusals import DENSE_EXPERTS, Refusal, recorded, source_label
from onnx_moe_fuse.verify.ort_nodes import session

TOL = 1e-5
GONE = {"Equal", "OneHot", "Cast", "Einsum", "Transpose", "ScatterElements"}


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return session(model).run(None, {"x": x})[0]


def tokens(rng: np.random.Generator, spec: DenseSpec, count: int = 7) -> np.ndarray:
    return rng.standard_normal((count, spec.hidden)).astype(np.float32)


def spec_id(spec: DenseSpec) -> str:
    parts = [spec.form, spec.activation, "int4" if spec.int4 else "f32"]
    parts += ["einsum"] if spec.einsum_combine else []
    parts += ["variant"] if spec.variant else []
    parts += ["bias"] if spec.bias else []
    parts += [f"softmax{spec.topk_softmax_axis}"] if spec.topk_softmax_axis is not None else []
    return "-".join(parts)


# -- the Equal one-hot and the Einsum combine fuse -------------------------------------------

FUSING = [
    DenseSpec(form="equal", activation="swiglu"),
    DenseSpec(form="equal", activation="relu", variant=True, bias=True),
    DenseSpec(form="equal", activation="swiglu_oss", einsum_combine=True),
    DenseSpec(form="equal", activation="gelu", einsum_combine=True, variant=True, renorm=False),
    DenseSpec(form="equal", activation="swiglu", int4=True, bias=True),
    DenseSpec(form="onehot", activation="swiglu", einsum_combine=True),
    DenseSpec(form="onehot", activation="relu", einsum_combine=True, int4=True, bias=True),
    DenseSpec(form="equal", activation="relu", topk_softmax_axis=-1, experts=6, top_k=3),
]


@pytest.mark.parametrize("spec", FUSING, ids=spec_id)
def test_dense_spelling_fuses_and_matches(spec: DenseSpec, rng: np.random.Generator) -> None:
    model = build_dense(spec)
    x = tokens(rng, spec)
    assert nonzero_rel_err(run(model, x), reference(spec, x)) < TOL  # the builder is right
    working = ir.serde.deserialize_model(model).clone()
    assert CanonicalDenseExpertsPass()(working).modified  # alone: no Einsum lowering before it
    counts = collections.Counter(n.op_type for n in working.graph)
    assert not GONE & set(counts), counts
    assert counts["GroupedMatMul"] == (3 if spec.activation == "swiglu" else 2), counts
    result = fuse(model)
    assert [f["op"] for f in result.report.fusions] == ["QMoE" if spec.int4 else "MoE"]
    for _ in range(2):  # fresh tokens, fresh token counts
        x = tokens(rng, spec, int(rng.integers(1, 12)))
        assert nonzero_rel_err(run(result.model, x), run(model, x)) < TOL


def test_equal_form_keeps_the_boundary_names() -> None:
    spec = DenseSpec(form="equal", activation="relu", einsum_combine=True)
    working = ir.serde.deserialize_model(build_dense(spec)).clone()
    assert CanonicalDenseExpertsPass()(working).modified
    (out,) = working.graph.outputs
    assert out.name == "y" and out.producer().op_type == "ReduceSum"
    gmm = [n for n in working.graph if n.op_type == "GroupedMatMul"]
    assert gmm[0].inputs[0].name == "x" and gmm[0].inputs[2].name == "router_topk_idx"


def test_canonical_nodes_take_over_the_dense_names() -> None:
    """The per-slot nodes are named after the dense ones they stand for.

    The layer rules' near misses then name values the user's model has.
    """
    spec = DenseSpec(form="onehot", activation="relu")
    working = ir.serde.deserialize_model(build_dense(spec)).clone()
    assert CanonicalDenseExpertsPass()(working).modified
    producers = {v.name: n.op_type for n in working.graph for v in n.outputs}
    assert producers["fc1_mm"] == "GroupedMatMul" and producers["down_mm"] == "GroupedMatMul"
    assert producers["experts_act"] == "Relu" and producers["y"] == "ReduceSum"


# -- what the readers must refuse --------------------------------------------------------------


def _replace_initializer(model: onnx.ModelProto, name: str, array: np.ndarray) -> None:
    tensor = next(t for t in model.graph.initializer if t.name == name)
    tensor.CopyFrom(onnx.numpy_helper.from_array(array, name))


def _assert_left_alone(model: onnx.ModelProto, reason: str) -> None:
    ir_model = ir.serde.deserialize_model(model)
    before = ir.serde.serialize_model(ir_model).SerializeToString()
    refusals = dense_experts_refusals(ir_model)
    assert any(reason in r for _, r in refusals), refusals
    assert not CanonicalDenseExpertsPass()(ir_model).modified
    assert ir.serde.serialize_model(ir_model).SerializeToString() == before


@pytest.mark.parametrize(
    "experts",
    [np.array([1, 0, 2, 3]), np.arange(5), np.arange(4).astype(np.float32)],
    ids=["permuted", "E+1", "float"],
)
def test_equal_with_other_than_the_expert_range_refused(experts: np.ndarray) -> None:
    """A permuted range swaps two experts' masks; E + 1 ids or a float range is no one-hot."""
    model = build_dense(DenseSpec(form="equal", activation="relu"))
    _replace_initializer(model, "expert_range", experts)
    _assert_left_alone(model, "the range 0..3 of the E experts")


def test_equal_mask_not_cast_refused() -> None:
    model = build_dense(DenseSpec(form="equal", activation="relu"))
    cast = next(n for n in model.graph.node if n.op_type == "Cast")
    cast.op_type = "Not"  # a bool mask (the model is not run: only analysed)
    del cast.attribute[:]
    _assert_left_alone(model, "not Cast to a float type")


@pytest.mark.parametrize("equation", ["te,eth->ht", "te,teh->th", "tf,fth->tf"])
def test_einsum_of_another_contraction_refused(equation: str) -> None:
    model = build_dense(DenseSpec(form="onehot", activation="relu", einsum_combine=True))
    einsum = next(n for n in model.graph.node if n.op_type == "Einsum")
    einsum.attribute[0].s = equation.encode()
    _assert_left_alone(model, "not combined with stacked experts")


# -- mutants: byte-identical, the near miss names the part and the node -----------------------

MUTANTS = [
    (DenseSpec(form="onehot", topk_axis=0), "routing", "router_topk", "selects along axis 0"),
    (DenseSpec(form="equal", topk_axis=0), "routing", "router_topk", "selects along axis 0"),
    (
        DenseSpec(form="onehot", router_input="second_input"),
        "routing",
        "router_logits",
        "reads 'router_input', not the token rows 'x' the experts read",
    ),
    (
        DenseSpec(form="unrolled", router_input="second_input"),
        "routing",
        "router_logits",
        "reads 'router_input', not the token rows 'x' the experts read",
    ),
    (
        DenseSpec(form="equal", router_input="reversed_tokens"),
        "routing",
        "router_logits",
        "reads 'router_rows', not the token rows 'x' the experts read",
    ),
    (
        DenseSpec(form="scatter", router_input="reversed_tokens", activation="relu"),
        "routing",
        "router_logits",
        "reads 'router_rows', not the token rows 'x' the experts read",
    ),
    (
        DenseSpec(form="onehot", weights_input=True),
        "fc1",
        "gate_weight",
        "FC1 expert weights not constant: 'gate_weight' is a graph input",
    ),
    (
        DenseSpec(form="equal", weights_input=True, activation="relu", einsum_combine=True),
        "fc1",
        "fc1_weight",
        "FC1 expert weights not constant: 'fc1_weight' is a graph input",
    ),
]


MUTANT_IDS = [f"{m[0].form}-{m[1]}-{m[2]}" for m in MUTANTS]


@pytest.mark.parametrize("spec, part, node, reason", MUTANTS, ids=MUTANT_IDS)
def test_mutant_refusal_names_part_and_node(
    spec: DenseSpec, part: str, node: str, reason: str
) -> None:
    """The pass recognises the layer from its mask, leaves it, and records which part is wrong."""
    model = build_dense(spec)
    ir_model = ir.serde.deserialize_model(model)
    before = ir.serde.serialize_model(ir_model).SerializeToString()
    topk = next(n for n in ir_model.graph if n.op_type == "TopK")
    pss = CanonicalDenseExpertsPass()
    assert not pss(ir_model).modified
    assert ir.serde.serialize_model(ir_model).SerializeToString() == before
    refusal = recorded(pss.refusals, DENSE_EXPERTS, topk)  # recorded: the layer was recognised
    assert refusal is not None and pss.refusals == [refusal], pss.refusals
    assert refusal.part == part and node in _where(refusal, topk), refusal
    assert reason in refusal.reason, refusal


def _where(refusal: Refusal, topk: ir.Node) -> str:
    """The node or value a dense refusal names first (the TopK when it names none)."""
    sources = refusal.failure_sources
    return source_label(sources[0]) if sources else label(topk)


@pytest.mark.parametrize("spec, part, node, reason", MUTANTS, ids=MUTANT_IDS)
def test_mutant_near_miss_names_part_and_node(
    spec: DenseSpec, part: str, node: str, reason: str
) -> None:
    """``fuse`` leaves the model byte-identical; its near miss carries the pass's refusal."""
    model = build_dense(spec)
    source = model.SerializeToString()
    result = fuse(model)
    assert not result.report.fusions
    assert result.model.SerializeToString() == source
    misses = [m for m in result.report.near_misses if reason in m["reason"]]
    assert misses, result.report.near_misses
    assert misses[0]["part"] == part and node in misses[0]["node"], misses[0]
    assert not misses[0]["reason"].startswith("not recognised")


def assert_same_outputs(original: onnx.ModelProto, fused: onnx.ModelProto) -> None:
    """Every output of ``fused`` equals ``original``'s on fresh tokens (1e-5 scale-aware)."""
    inp = original.graph.input[0]
    width = inp.type.tensor_type.shape.dim[-1].dim_value
    x = np.random.default_rng(env_seed()).standard_normal((5, width)).astype(np.float32)
    want = ort.InferenceSession(original.SerializeToString()).run(None, {inp.name: x})
    got = ort.InferenceSession(fused.SerializeToString()).run(None, {inp.name: x})
    for w, g in zip(want, got, strict=True):
        scale = max(float(np.abs(w).max()), 1e-30)
        assert float(np.abs(g.astype(np.float64) - w).max()) / scale <= 1e-5


def test_dense_weights_used_twice_fuse_by_meaning() -> None:
    """The dense pass names a second reader of the dense weights; the meaning analysis fuses.

    (optimum-onnx's gpt-oss export reads the shape of the dense weights too.)
    """
    model = build_dense(DenseSpec(form="scatter", activation="relu"))
    model.graph.node.append(onnx.helper.make_node("Shape", ["dense_weights"], ["dense_shape"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("dense_shape", 7, None))
    source = model.SerializeToString()
    ir_model = ir.serde.deserialize_model(model)
    topk = next(n for n in ir_model.graph if n.op_type == "TopK")
    pss = CanonicalDenseExpertsPass()
    pss(ir_model)
    refusal = recorded(pss.refusals, DENSE_EXPERTS, topk)
    assert refusal is not None and refusal.part == "combine", refusal
    # the analysis of meaning reads the layer whatever else reads its dense weights' shape:
    # it fuses, and the Shape read stays (the splice keeps what a kept node needs)
    del source
    result = fuse(model)
    assert [f["op"] for f in result.report.fusions] == ["MoE"]
    assert_same_outputs(model, result.model)


def test_softmax_of_the_topk_values_over_tokens_named_by_the_rules() -> None:
    """Any ``[T, k]`` weights keep the dense identity: the pass rewrites, the rules refuse."""
    spec = DenseSpec(form="equal", activation="relu", topk_softmax_axis=0)
    model = build_dense(spec)
    working = ir.serde.deserialize_model(model).clone()
    assert CanonicalDenseExpertsPass()(working).modified
    source = model.SerializeToString()
    result = fuse(model)
    assert not result.report.fusions and result.model.SerializeToString() == source
    (miss,) = [m for m in result.report.near_misses if "Softmax" in m["reason"]]
    assert miss["part"] == "routing" and "not over the k slots" in miss["reason"], miss


def test_proved_layer_has_no_refusal() -> None:
    model = ir.serde.deserialize_model(build_dense(DenseSpec(form="equal")))
    pss = CanonicalDenseExpertsPass()
    assert pss(model).modified and pss.refusals == []
