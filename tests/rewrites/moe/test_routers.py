"""Router classification (``onnx_moe_fuse.rewrites.moe.routers``) on every router the project holds.

* the hand-written layers (``samples.handwritten``): the five refused routers get their kind, a
  description naming the form, and a near-miss sentence that names the part and the keyword
  their :class:`Refused` record expects; every other layer's router is fusable softmax top-k;
* the committed samples: each sample's router as its description says (softmax top-k, top-k
  softmax, renormalised or not, the sigmoid near miss refused as "sigmoid routing");
* the torch exports (``sample_models/exported`` and its ``causal_lm`` whole models): each MoE
  layer's router classified as its JSON record says (form, renormalisation, k, DeepSeek-V3's
  scaling factor and bias, PhiMoE's jitter threshold), argsort TopKs and DeepSeek-V3's group
  steps are not routers, and only refused layers get a near miss;
* random routers built here (hypothesis): the kind follows from how the router was built;
* odd graphs: classification never raises.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from onnx_moe_fuse import samples
from onnx_moe_fuse.rewrites.graph.facts import label
from onnx_moe_fuse.rewrites.moe.routers import (
    FUSABLE_KINDS,
    KINDS,
    RouterForm,
    classify_router,
    router_near_miss,
)
from onnx_moe_fuse.samples.handwritten import HANDWRITTEN, Refused
from onnx_moe_fuse.samples.handwritten_routers import (
    DEEPSEEK_SCALING,
    PHIMOE_JITTER,
    SOFTMAX_SCALING,
)

EXPORTED = Path(__file__).resolve().parents[3] / "sample_models" / "exported"
SELECTORS = ("TopK", "ArgMax")


def forms(model: onnx.ModelProto | ir.Model) -> list[RouterForm]:
    """The classification of every TopK / ArgMax of ``model``, in graph order."""
    graph = (model if isinstance(model, ir.Model) else ir.from_proto(model)).graph
    return [classify_router(n) for n in graph if n.op_type in SELECTORS]


def routers(model: onnx.ModelProto | ir.Model) -> list[RouterForm]:
    """The forms of the TopKs that route: not argsorts, not group-selection steps."""
    return [f for f in forms(model) if is_router(f)]


def is_router(form: RouterForm) -> bool:
    return form.kind != "argsort" and not form.description.startswith("a group-selection step")


# -- hand-written layers -------------------------------------------------------------------------

#: kind of the router that selects experts, and phrases its description must hold
HANDWRITTEN_ROUTERS = {
    "router_sigmoid_topk": ("topk_sigmoid", ["sigmoid of the 2 selected values"]),
    "router_llama4_prescaled": (
        "topk_sigmoid",
        ["sigmoid of the selected value", "scaling the token before the experts"],
    ),
    "router_deepseek_v3": (
        "group_limited_topk",
        [
            "sigmoid scores",
            "selection bias ('gate.e_score_correction_bias')",
            "group-limited top-4 (the top 2 of 4 groups, each scored by the sum of its top 2)",
            "DeepSeek-V3",
            "gathered from the unbiased scores",
            "renormalised",
            f"scaled by {DEEPSEEK_SCALING:g}",
        ],
    ),
    "router_softmax_scaled": (
        "scaled",
        ["a softmax over the experts", "renormalised", f"scaled by {SOFTMAX_SCALING:g}"],
    ),
    "router_phimoe_sparse_mixer": (
        "sparse_mixer",
        [f"jitter threshold {2 * PHIMOE_JITTER:g}", "sparse mixer"],
    ),
}


@pytest.mark.parametrize("name", list(HANDWRITTEN_ROUTERS))
def test_handwritten_refused_router(name: str) -> None:
    model, _, expected = HANDWRITTEN[name]()
    kind, phrases = HANDWRITTEN_ROUTERS[name]
    found = routers(model)
    assert found, forms(model)
    for form in found:
        assert (form.kind, form.fusable) == (kind, False), form
        for phrase in phrases:
            assert phrase in form.description, (phrase, form.description)
    if not isinstance(expected, Refused):
        return  # a router the fused op does not compute, fed as its selection and weights
    # the refusal sentence names what the layer's Refused record expects a near miss to name
    sentences = [router_near_miss(f.topk) for f in found]
    assert all(sentences), sentences
    for form, sentence in zip(found, sentences, strict=True):
        assert sentence.startswith(("router not fusable (", "router not fused (")), sentence
        assert f"'{label(form.topk)}'" in sentence
    named = [
        s for f, s in zip(found, sentences, strict=True) if expected.part in s + label(f.scores)
    ]
    assert any(expected.reason in s.lower() for s in named), (expected, sentences)


def test_handwritten_deepseek_group_steps_are_not_routers() -> None:
    all_forms = forms(HANDWRITTEN["router_deepseek_v3"]().model)
    steps = [f for f in all_forms if f.description.startswith("a group-selection step")]
    assert len(all_forms) == 3 and len(steps) == 2, all_forms
    for step in steps:
        assert step.kind == "group_limited_topk" and router_near_miss(step.topk) is None
        assert step.scores is not None and step.scores.op_type == "Sigmoid"


#: the second set of hand-written routers (samples/handwritten_router_traps.py): other forms
OTHER_ROUTERS = frozenset(
    n for n in HANDWRITTEN if n.startswith(("router_ernie", "router_switch", "router_trap"))
)


@pytest.mark.parametrize(
    "name", [n for n in HANDWRITTEN if n not in HANDWRITTEN_ROUTERS and n not in OTHER_ROUTERS]
)
def test_handwritten_softmax_router_fusable(name: str) -> None:
    found = routers(HANDWRITTEN[name]().model)
    assert len(found) == 1, found
    (form,) = found
    assert form.kind == "softmax_topk_renorm" and form.fusable, form
    assert form.scores is not None and form.scores.op_type == "Softmax"
    assert router_near_miss(form.topk) is None


# -- committed samples ---------------------------------------------------------------------------

SAMPLE_ROUTING = {
    "Softmax over the experts, TopK, renormalised": "softmax_topk_renorm",
    "Softmax over the experts, TopK, NOT renormalised": "softmax_topk",
    "TopK on the logits, then Softmax over the k values": "topk_softmax",
    "Sigmoid scores (not Softmax), TopK, renormalised": "sigmoid_topk",
}


def _moe_samples() -> list[samples.Sample]:
    return [s for s in samples.all_samples() if s.kind == "moe"]


@pytest.mark.parametrize("sample", _moe_samples(), ids=lambda s: s.name)
def test_sample_router(sample: samples.Sample) -> None:
    routing = re.search(r"routing: ([^.]*)\.", sample.description).group(1)
    (kind,) = [kind for start, kind in SAMPLE_ROUTING.items() if routing.startswith(start)]
    found = routers(sample.model)
    assert [f.kind for f in found] == [kind], found
    k = sample.expected_attributes.get("k")
    if k is not None:
        assert f"top-{k} " in found[0].description, found[0].description
    sentence = router_near_miss(found[0].topk)
    if kind in FUSABLE_KINDS:
        assert found[0].fusable and sentence is None
    elif sample.expected:  # fused, fed as its selection and weights
        assert not found[0].fusable and sentence.startswith("router not fused ("), sentence
    else:
        assert not found[0].fusable and sample.near_miss_reason in sentence, sentence


# -- torch exports -------------------------------------------------------------------------------

#: router form of a causal_lm record -> kind (softmax_topk: by its ``renormalised`` flag)
CAUSAL_FORMS = {
    "softmax_topk": {True: "softmax_topk_renorm", False: "softmax_topk"},
    "topk_softmax": "topk_softmax",
    "sigmoid_bias_group_topk": "group_limited_topk",
    "sparsemixer": "sparse_mixer",
    "sigmoid_topk_dense": "topk_sigmoid",
}


def _records(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.glob("*.json")
        if p.name != "index.json" and p.with_suffix(".onnx").exists()
    )


def _causal_records() -> list[Path]:
    return _records(EXPORTED / "causal_lm") if (EXPORTED / "causal_lm").is_dir() else []


@pytest.mark.skipif(not _causal_records(), reason="no causal_lm exports in sample_models/exported")
@pytest.mark.parametrize("record", _causal_records(), ids=lambda p: p.stem)
def test_causal_lm_routers(record: Path) -> None:
    meta = json.loads(record.read_text())
    router = meta["router"]
    kind = CAUSAL_FORMS.get(router["form"])
    if isinstance(kind, dict):
        kind = kind.get(router.get("renormalised"))
    if kind is None:
        pytest.skip(f"router form {router['form']!r} has no expected kind here yet")
    layers = [e for e in meta["expected_layers"] if e["outcome"] != "no MoE"]
    model = ir.load(record.with_suffix(".onnx"))
    found = routers(model)
    # one router per MoE layer (and per mixture-of-attention-experts layer, JetMoE's MoA, which
    # routes by the same top-k softmax): the selections read distinct scores nodes
    attention = meta.get("expected_attention_experts", [])
    assert len({id(f.scores) for f in found}) == len(layers) + len(attention), found
    config = meta["config"]
    k = config["num_experts_per_tok"]
    for form in found:
        assert form.kind == kind, form
        assert form.fusable == (kind in FUSABLE_KINDS)
        sentence = router_near_miss(form.topk)
        if form.fusable:
            assert sentence is None and f"top-{k} " in form.description, form
        else:
            assert sentence is not None and label(form.topk) in sentence, sentence
    if meta["dtype"] == "float32":  # other dtypes are refused for their dtype first
        # a router the fused op does not compute itself fuses through the routing
        # construction (PhiMoE's sparse mixer too: its rounds are one TopK's columns)
        assert all(e["outcome"] == "MoE" for e in layers), layers
    text = " ".join(f.description for f in found)
    if kind == "group_limited_topk":
        assert f"scaled by {config['routed_scaling_factor']:g}" in text, text
        assert "selection bias" in text and "sigmoid scores" in text, text
        if meta["dtype"] == "float32":  # a folded cast to float16 loses the initializer's name
            assert "e_score_correction_bias" in text, text
        assert f"the top {config['topk_group']} of {config['n_group']} groups" in text, text
    if kind == "sparse_mixer":
        assert f"jitter threshold {2 * config['router_jitter_noise']:g}" in text, text
        assert len(found) == 2 * len(layers)  # two rounds per layer


def _older_records() -> list[Path]:
    return _records(EXPORTED) if EXPORTED.is_dir() else []


@pytest.mark.skipif(not _older_records(), reason="no exports in sample_models/exported")
@pytest.mark.parametrize("record", _older_records(), ids=lambda p: p.stem)
def test_exported_block_router(record: Path) -> None:
    computes = json.loads(record.read_text())["computes"]
    if computes["routing"].startswith("top-k of the logits") and "sigmoid" in computes["routing"]:
        kind = "topk_sigmoid"  # Llama4: the sigmoid of the selected logits
    elif computes["routing"].startswith("top-k of the logits"):
        kind = "topk_softmax"
    else:
        kind = "softmax_topk_renorm" if computes["renormalised"] else "softmax_topk"
    all_forms = forms(ir.load(record.with_suffix(".onnx")))
    found = [f for f in all_forms if is_router(f)]
    assert [f.kind for f in found] == [kind], found
    assert f"top-{computes['top_k']} " in found[0].description
    assert all(f.kind == "argsort" for f in all_forms if not is_router(f)), all_forms
    if kind == "topk_sigmoid":  # Llama4's input scaling: the dense pass fuses top-1 itself
        assert "scale the expert input" in router_near_miss(found[0].topk)
    else:
        assert router_near_miss(found[0].topk) is None


# -- random routers (hypothesis) -----------------------------------------------------------------


def _router_model(
    rng: np.random.Generator,
    e: int,
    k: int,
    score: str | None,
    post: str | None,
    bias: bool,
    renorm: str | None,
    scale: float | None,
) -> onnx.ModelProto:
    """x @ W, [Softmax|Sigmoid], [+ bias], TopK, [weights], ids -> Gather of per-expert rows."""
    h = 8
    inits = [
        numpy_helper.from_array(rng.standard_normal((h, e)).astype(np.float32), "router_w"),
        numpy_helper.from_array(np.array([k], np.int64), "k"),
        numpy_helper.from_array(rng.standard_normal((e, h)).astype(np.float32), "expert_rows"),
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
    ]
    nodes = [helper.make_node("MatMul", ["x", "router_w"], ["logits"])]
    choice = scores = "logits"
    if score is not None:
        nodes.append(helper.make_node(score, ["logits"], ["scores"], **_axis(score)))
        choice = scores = "scores"
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(e).astype(np.float32), "bias"))
        nodes.append(helper.make_node("Add", [scores, "bias"], ["choice"]))
        choice = "choice"
    nodes.append(helper.make_node("TopK", [choice, "k"], ["top_v", "top_i"], axis=-1))
    w = "top_v"
    if bias and score is not None:  # weights from the unbiased scores
        nodes.append(helper.make_node("GatherElements", [scores, "top_i"], ["w_raw"], axis=1))
        w = "w_raw"
    if post is not None:
        nodes.append(helper.make_node(post, [w], ["w_post"], **_axis(post)))
        w = "w_post"
    if renorm is not None:
        nodes.append(helper.make_node("ReduceSum", [w, "last"], ["w_sum"], keepdims=1))
        if renorm == "div":
            nodes.append(helper.make_node("Div", [w, "w_sum"], ["w_norm"]))
        else:
            nodes.append(helper.make_node("Reciprocal", ["w_sum"], ["w_inv"]))
            nodes.append(helper.make_node("Mul", [w, "w_inv"], ["w_norm"]))
        w = "w_norm"
    if scale is not None:
        inits.append(numpy_helper.from_array(np.array(scale, np.float32), "factor"))
        nodes.append(helper.make_node("Mul", [w, "factor"], ["w_scaled"]))
        w = "w_scaled"
    nodes += [
        helper.make_node("Gather", ["expert_rows", "top_i"], ["rows"], axis=0),
        helper.make_node("Unsqueeze", [w, "last"], ["w3"]),
        helper.make_node("Mul", ["rows", "w3"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "k_axis"], ["y"], keepdims=0),
    ]
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "k_axis"))
    graph = helper.make_graph(
        nodes,
        "router",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", h])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", h])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    return model


def _axis(op: str) -> dict[str, int]:
    return {"axis": -1} if op == "Softmax" else {}


def _expected_kind(score, post, bias, renorm, scale) -> str:
    """The kind each combination must get, from the module's documented precedence."""
    if bias and score is not None:
        return "biased_selection"  # whatever becomes of the weights gathered from the scores
    if score is not None and post is not None:
        return "unknown"  # two score functions: no form this module names
    if score == "Sigmoid":
        return "sigmoid_topk"
    if post == "Sigmoid":
        return "topk_sigmoid"
    if score is None and post is None:
        return "unknown"  # raw logits as weights
    if scale is not None:
        return "scaled"
    if score == "Softmax":
        return "softmax_topk_renorm" if renorm else "softmax_topk"
    return "unknown" if renorm else "topk_softmax"


@settings(max_examples=30, deadline=None)
@given(
    e=st.integers(2, 16),
    k_frac=st.floats(0.0, 1.0),
    score=st.sampled_from([None, "Softmax", "Sigmoid"]),
    post=st.sampled_from([None, "Softmax", "Sigmoid"]),
    bias=st.booleans(),
    renorm=st.sampled_from([None, "div", "reciprocal"]),
    scale=st.one_of(st.none(), st.floats(0.125, 16.0).filter(lambda f: f != 1.0)),
    seed=st.integers(0, 2**16),
)
def test_random_router_kind(e, k_frac, score, post, bias, renorm, scale, seed) -> None:
    k = 1 + int(k_frac * (e - 1))
    scale = None if scale is None else float(np.float32(scale))
    model = _router_model(np.random.default_rng(seed), e, k, score, post, bias, renorm, scale)
    (form,) = forms(model)
    want = _expected_kind(score, post, bias, renorm, scale)
    assert form.kind == want, (form, score, post, bias, renorm, scale)
    assert form.kind in KINDS and form.fusable == (want in FUSABLE_KINDS)
    assert f"top-{k} " in form.description, form.description
    if scale is not None and want not in ("unknown",):
        assert f"scaled by {scale:g}" in form.description, form.description
    if renorm is not None and want != "unknown":
        assert "renormalised" in form.description, form.description
    sentence = router_near_miss(form.topk)
    assert (sentence is None) == (form.fusable or want == "unknown"), sentence


def _deepseek_variant(rng: np.random.Generator, e: int, groups: int, kept: int, k: int):
    """DeepSeek-V3 routing spelled otherwise: OneHot group mask, ``Mul`` masking, Constant k."""
    h, per = 8, e // groups
    consts = {
        "router_w": rng.standard_normal((h, e)).astype(np.float32),
        "bias": (rng.standard_normal(e) * 0.1).astype(np.float32),
        "grouped_shape": np.array([-1, groups, per], np.int64),
        "two": np.array([2], np.int64),
        "kept": np.array([kept], np.int64),
        "last": np.array([-1], np.int64),
        "slot_axis": np.array([1], np.int64),
        "depth": np.array(groups, np.int64),
        "off_on": np.array([0.0, 1.0], np.float32),
        "per_group": np.array([1, 1, per], np.int64),
        "flat": np.array([-1, e], np.int64),
        "scale": np.array(2.5, np.float32),
        "expert_rows": rng.standard_normal((e, h)).astype(np.float32),
    }
    nodes = [
        helper.make_node(
            "Constant", [], [name], value=numpy_helper.from_array(value, name + "_tensor")
        )
        for name, value in consts.items()
        if name != "router_w" and name != "expert_rows"
    ]
    nodes.append(helper.make_node("Constant", [], ["k"], value_ints=[k]))
    nodes += [
        helper.make_node("MatMul", ["x", "router_w"], ["logits"]),
        helper.make_node("Sigmoid", ["logits"], ["scores"]),
        helper.make_node("Add", ["scores", "bias"], ["choice"]),
        helper.make_node("Reshape", ["choice", "grouped_shape"], ["grouped"]),
        helper.make_node("TopK", ["grouped", "two"], ["top2", "top2_i"], axis=-1),
        helper.make_node("ReduceSum", ["top2", "last"], ["group_scores"], keepdims=0),
        helper.make_node("TopK", ["group_scores", "kept"], ["_g", "group_i"], axis=-1),
        helper.make_node("OneHot", ["group_i", "depth", "off_on"], ["group_hot"], axis=-1),
        helper.make_node("ReduceSum", ["group_hot", "slot_axis"], ["group_mask"], keepdims=0),
        helper.make_node("Unsqueeze", ["group_mask", "last"], ["group_mask3"]),
        helper.make_node("Expand", ["group_mask3", "per_group"], ["expert_mask3"]),
        helper.make_node("Reshape", ["expert_mask3", "flat"], ["expert_mask"]),
        helper.make_node("Mul", ["choice", "expert_mask"], ["masked"]),
        helper.make_node("TopK", ["masked", "k"], ["_v", "top_i"], axis=-1),
        helper.make_node("GatherElements", ["scores", "top_i"], ["w"], axis=1),
        helper.make_node("ReduceSum", ["w", "last"], ["w_sum"], keepdims=1),
        helper.make_node("Div", ["w", "w_sum"], ["w_norm"]),
        helper.make_node("Mul", ["w_norm", "scale"], ["weights"]),
        helper.make_node("Gather", ["expert_rows", "top_i"], ["rows"], axis=0),
        helper.make_node("Unsqueeze", ["weights", "last"], ["w3"]),
        helper.make_node("Mul", ["rows", "w3"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "slot_axis"], ["y"], keepdims=0),
    ]
    inits = [numpy_helper.from_array(consts[n], n) for n in ("router_w", "expert_rows")]
    graph = helper.make_graph(
        nodes,
        "deepseek_variant",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", h])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", h])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model, full_check=True)
    return model


@settings(max_examples=10, deadline=None)
@given(
    groups=st.sampled_from([2, 4]),
    per=st.integers(2, 4),
    kept_frac=st.floats(0.0, 1.0),
    k=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_deepseek_variant_router(groups, per, kept_frac, k, seed) -> None:
    kept = 1 + int(kept_frac * (groups - 1))
    k = min(k, kept * per)
    model = _deepseek_variant(np.random.default_rng(seed), groups * per, groups, kept, k)
    found = routers(model)
    assert len(found) == 1 and len(forms(model)) == 3, forms(model)
    (form,) = found
    assert (form.kind, form.fusable) == ("group_limited_topk", False), form
    for phrase in (
        "sigmoid scores",
        "selection bias ('bias')",
        f"group-limited top-{k} (the top {kept} of {groups} groups, each scored by the sum of "
        "its top 2)",
        "gathered from the unbiased scores",
        "renormalised",
        "scaled by 2.5",
    ):
        assert phrase in form.description, (phrase, form.description)
    assert "group-limited top-k" in router_near_miss(form.topk)


def test_llama4_dense_router() -> None:
    """Llama4's code: top-k logits scattered into -inf, sigmoid, tokens scaled per expert."""
    rng = np.random.default_rng(7)
    h, e = 8, 4
    inits = [
        numpy_helper.from_array(rng.standard_normal((h, e)).astype(np.float32), "router_w"),
        numpy_helper.from_array(np.array([1], np.int64), "k"),
        numpy_helper.from_array(np.array(-np.inf, np.float32), "neg_inf"),
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
        numpy_helper.from_array(rng.standard_normal((e, h, h)).astype(np.float32), "experts"),
        numpy_helper.from_array(np.array([0], np.int64), "expert_axis"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "router_w"], ["logits"]),
        helper.make_node("TopK", ["logits", "k"], ["top_v", "top_i"], axis=-1),
        helper.make_node("Shape", ["logits"], ["logits_shape"]),
        helper.make_node("Expand", ["neg_inf", "logits_shape"], ["all_neg_inf"]),
        helper.make_node(
            "ScatterElements", ["all_neg_inf", "top_i", "top_v"], ["dense_top"], axis=1
        ),
        helper.make_node("Sigmoid", ["dense_top"], ["router_scores"]),
        helper.make_node("Transpose", ["router_scores"], ["scores_et"], perm=[1, 0]),
        helper.make_node("Unsqueeze", ["scores_et", "last"], ["scores_et1"]),
        helper.make_node("Mul", ["scores_et1", "x"], ["routed_in"]),  # [E, T, H]
        helper.make_node("MatMul", ["routed_in", "experts"], ["expert_out"]),
        helper.make_node("ReduceSum", ["expert_out", "expert_axis"], ["y"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "llama4_dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", h])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", h])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model, full_check=True)
    (form,) = forms(model)
    assert (form.kind, form.fusable) == ("topk_sigmoid", False), form
    assert form.scores is not None and form.scores.outputs[0].name == "router_scores"
    for phrase in ("dense experts tensor", "sigmoid of the selected value", "before the experts"):
        assert phrase in form.description, form.description
    assert "sigmoid routing" in router_near_miss(form.topk)


# -- robustness ----------------------------------------------------------------------------------


def test_every_node_of_every_model_classifies_without_raising() -> None:
    models = [fn().model for fn in HANDWRITTEN.values()]
    models += [s.model for s in samples.all_samples()]
    for model in models:
        for node in ir.from_proto(model).graph:
            form = classify_router(node)
            assert form.kind in KINDS and form.topk is node
            if node.op_type not in SELECTORS:
                assert form.kind == "unknown" and router_near_miss(node) is None


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from([*HANDWRITTEN_ROUTERS, "swish_silu"]),
    cuts=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 8)), min_size=1, max_size=5),
)
def test_cut_graphs_stay_readable(name: str, cuts: list[tuple[int, int]]) -> None:
    """Routers with random inputs disconnected: classified without the catch-all's "unknown"."""
    model = ir.from_proto(HANDWRITTEN[name]().model)
    nodes = list(model.graph)
    for pick, slot in cuts:
        node = nodes[pick % len(nodes)]
        if node.inputs:
            node.replace_input_with(slot % len(node.inputs), None)
    for form in forms(model):
        assert form.kind in KINDS and not form.description.startswith("not readable"), form


def test_classification_only_reads() -> None:
    """Classifying every selector leaves the graph as it was (Constant tensors keep their names)."""
    models = [fn().model for fn in HANDWRITTEN.values()] + [s.model for s in samples.all_samples()]
    for proto in models:
        model = ir.from_proto(proto)
        before = ir.to_proto(model).SerializeToString()
        for form in forms(model):
            router_near_miss(form.topk)
        assert ir.to_proto(model).SerializeToString() == before, proto.graph.name


def test_odd_topks_are_unknown_not_errors() -> None:
    x = ir.Value(name="x")
    k = ir.Value(name="k")
    bare = ir.Node("", "TopK", inputs=[x, k], num_outputs=2)  # reads a graph input, no graph
    assert classify_router(bare).kind == "unknown"
    empty = ir.Node("", "TopK", inputs=[], num_outputs=2)
    assert classify_router(empty).kind == "unknown"
    soft = ir.node("Softmax", [x], attributes={"axis": -1}).outputs[0]
    assert classify_router(ir.Node("", "TopK", inputs=[soft, k], num_outputs=2)).kind == (
        "softmax_topk"
    )
    # 200 Identities between the softmax and the TopK: every walk is bounded, so it gives up
    value = soft
    for i in range(200):
        value = ir.node("Identity", [value], name=f"id{i}").outputs[0]
    deep = ir.Node("", "TopK", inputs=[value, k], num_outputs=2)
    assert classify_router(deep).kind == "unknown"
    assert router_near_miss(deep) is None
