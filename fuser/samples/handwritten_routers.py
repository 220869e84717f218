"""Hand-written MoE layers whose routers are not what ``com.microsoft.MoE`` / ``QMoE`` compute.

Layer 11 of the hand-written catalogue (:mod:`onnx_moe_fuse.samples.handwritten`). The experts
are ordinary per-slot SwiGLU experts (float ``[E, K, N]`` weights, Gather/Expand/MatMul); only
the router differs from the fused ops' own (softmax over all experts, top-k, optional
renormalisation). A top-k selection with per-selected non-negative weights fuses, the router
staying in the graph (the routing construction, ``docs/routing.md``); the rest must be refused
with the router named:

* :func:`sigmoid_topk` (fuses): Llama4-style sigmoid of the top-k logits weighting the outputs;
* :func:`llama4_prescaled` (refused): Llama4 as its code reads: the sigmoid of the top-1 logit
  scales the token before the expert (not a weighted sum of expert outputs);
* :func:`deepseek_v3` (fuses): sigmoid scores, ``e_score_correction_bias`` for the selection
  only, group-limited top-k (top-2 sum per group, top groups, masked scores), weights gathered
  from the unbiased scores, renormalised and multiplied by ``routed_scaling_factor``;
* :func:`softmax_scaled` (fuses): softmax top-k renormalised, then times a scaling factor;
* :func:`phimoe_sparse_mixer` (fuses): PhiMoE's sparse mixer (two rounds of a masked softmax
  with a jitter threshold, the second with the first choice masked out: the rounds are the two
  columns of one TopK, :mod:`onnx_moe_fuse.rewrites.graph.selection_rounds`).
"""

from __future__ import annotations

import numpy as np

from onnx_moe_fuse.samples.handwritten_graph import Fused, Graph, HandwrittenLayer, Refused, normal

__all__ = [
    "routed_experts",
    "sigmoid_topk",
    "llama4_prescaled",
    "deepseek_v3",
    "softmax_scaled",
    "phimoe_sparse_mixer",
    "DEEPSEEK_SCALING",
    "SOFTMAX_SCALING",
    "PHIMOE_JITTER",
]

DEEPSEEK_SCALING = 2.5
SOFTMAX_SCALING = 1.75
PHIMOE_JITTER = 0.01


def routed_experts(
    g: Graph,
    rng: np.random.Generator,
    x: str,
    idx: str,
    weights: str,
    dims: tuple[int, int, int, int],
    prescale: bool = False,
) -> str:
    """SwiGLU experts per slot and the sum over the k slots: ``y [T, H]``.

    The routing weights multiply the expert outputs, or with ``prescale`` (Llama4) the tokens
    before the experts, and the slots are then summed unweighted.
    """
    h, i, e, k = dims
    if prescale:
        x3 = g.op("Unsqueeze", [x, g.init("token_axis", [1])], "x_t1h")
        scale = g.op("Unsqueeze", [weights, g.init("score_axis", [-1])], "scores_tk1")
        routed_in = g.op("Mul", [x3, scale], "routed_in")  # [T, k, H]
        x4 = g.op("Unsqueeze", [routed_in, g.init("slot_axes", [2])], "routed_in4")
    else:
        x4 = g.op("Unsqueeze", [x, g.init("token_axes", [1, 2])], "x4")
        x4 = g.op("Expand", [x4, g.init("bcast", [1, k, 1, 1])], "x_slots")
    per: list[str] = []
    for name in ("gate", "up"):
        w = g.init(f"experts.{name}", normal(rng, (e, h, i), h))
        sel = g.op("Gather", [w, idx], f"{name}_w", axis=0)
        mm = g.op("MatMul", [x4, sel], f"{name}_mm")
        per.append(g.op("Squeeze", [mm, g.init(f"{name}_drop", [2])], f"{name}_proj"))
    gate, up = per
    act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate], "gsig")], "gsilu"), up], "act")
    sel = g.op("Gather", [g.init("experts.down", normal(rng, (e, i, h), i)), idx], "down_w", axis=0)
    a4 = g.op("Unsqueeze", [act, g.init("act_axis", [2])], "act4")
    down = g.op(
        "Squeeze", [g.op("MatMul", [a4, sel], "down_mm"), g.init("down_drop", [2])], "down_proj"
    )
    if not prescale:
        w3 = g.op("Unsqueeze", [weights, g.init("w_axis", [-1])], "w3")
        down = g.op("Mul", [down, w3], "weighted")
    return g.op("ReduceSum", [down, g.init("k_axis", [1])], "y", keepdims=0)


def _finish(g: Graph, h: int, description: str, router: str, reason: str) -> HandwrittenLayer:
    g.output("y", ["T", h])
    return HandwrittenLayer(g.model(21), description, Refused(router, reason))


def _fused(g: Graph, h: int, description: str, k: int) -> HandwrittenLayer:
    """A top-k selection with per-selected non-negative weights: one MoE node, router kept."""
    g.output("y", ["T", h])
    return HandwrittenLayer(g.model(21), description, Fused("MoE", {"k": k}))


def sigmoid_topk(seed: int = 50) -> HandwrittenLayer:
    """Llama4-style: top-k of the logits, weights ``Sigmoid`` of the k selected logits."""
    rng = np.random.default_rng(seed)
    h, i, e, k = 32, 32, 8, 2
    g = Graph("llama4_router")
    x = g.input("x", ["T", h])
    logits = g.op("MatMul", [x, g.init("router.weight", normal(rng, (h, e), h))], "router_logits")
    vals, idx = g.op_multi(
        "TopK", [logits, g.init("top_k", [k])], ["top_logits", "top_ids"], axis=-1
    )
    weights = g.op("Sigmoid", [vals], "router_scores")
    routed_experts(g, rng, x, idx, weights, (h, i, e, k))
    return _fused(g, h, "Llama4-style sigmoid of the top-k logits weighting the outputs", k)


def llama4_prescaled(seed: int = 54) -> HandwrittenLayer:
    """Llama4 as written: top-1 of the logits, its sigmoid scales the token before the expert."""
    rng = np.random.default_rng(seed)
    h, i, e, k = 32, 32, 8, 1
    g = Graph("llama4_text_moe")
    x = g.input("x", ["T", h])
    logits = g.op("MatMul", [x, g.init("router.weight", normal(rng, (h, e), h))], "router_logits")
    vals, idx = g.op_multi(
        "TopK", [logits, g.init("top_k", [k])], ["top_logits", "top_ids"], axis=-1
    )
    scores = g.op("Sigmoid", [vals], "router_scores")
    routed_experts(g, rng, x, idx, scores, (h, i, e, k), prescale=True)
    return _finish(
        g,
        h,
        "Llama4 routing as written: sigmoid of the top-1 logit scales the token before the expert",
        "router_scores",
        "sigmoid",
    )


def deepseek_v3(seed: int = 51) -> HandwrittenLayer:
    """DeepSeek-V3 routing: biased sigmoid selection, group-limited top-k, scaling factor."""
    rng = np.random.default_rng(seed)
    h, i, e, k, groups, topk_group = 32, 32, 16, 4, 4, 2
    g = Graph("deepseek_v3_router")
    x = g.input("x", ["T", h])
    logits = g.op("MatMul", [x, g.init("gate.weight", normal(rng, (h, e), h))], "router_logits")
    scores = g.op("Sigmoid", [logits], "gate_sigmoid_scores")
    bias = g.init("gate.e_score_correction_bias", (rng.standard_normal(e) * 0.1).astype(np.float32))
    biased = g.op("Add", [scores, bias], "scores_for_choice")
    grouped = g.op(
        "Reshape", [biased, g.init("group_shape", [-1, groups, e // groups])], "scores_grouped"
    )
    top2, _ = g.op_multi(
        "TopK", [grouped, g.init("two", [2])], ["group_top2", "group_top2_ids"], axis=-1
    )
    group_scores = g.op("ReduceSum", [top2, g.init("last_axis", [-1])], "group_scores", keepdims=0)
    _, group_idx = g.op_multi(
        "TopK",
        [group_scores, g.init("topk_group", [topk_group])],
        ["top_group_scores", "group_idx"],
        axis=-1,
    )
    # group mask: ones scattered at the chosen groups into zeros [T, G], widened to [T, E]
    zeros = g.op("Mul", [group_scores, g.init("zero", np.array(0.0, np.float32))], "group_zeros")
    idx_shape = g.op("Shape", [group_idx], "group_idx_shape")
    ones = g.op("Expand", [g.init("one", np.array(1.0, np.float32)), idx_shape], "group_ones")
    group_mask = g.op("ScatterElements", [zeros, group_idx, ones], "group_mask", axis=1)
    mask3 = g.op("Unsqueeze", [group_mask, g.init("mask_axis", [-1])], "group_mask3")
    mask3 = g.op("Expand", [mask3, g.init("per_group", [1, 1, e // groups])], "expert_mask3")
    expert_mask = g.op("Reshape", [mask3, g.init("flat_experts", [-1, e])], "score_mask")
    keep = g.op("Cast", [expert_mask], "score_keep", to=9)
    masked = g.op(
        "Where", [keep, biased, g.init("masked_fill", np.array(0.0, np.float32))], "tmp_scores"
    )
    _, idx = g.op_multi(
        "TopK", [masked, g.init("top_k", [k])], ["topk_masked", "topk_idx"], axis=-1
    )
    w = g.op("GatherElements", [scores, idx], "topk_weight_raw", axis=1)
    topk_sum = g.op("ReduceSum", [w, g.init("sum_axis", [-1])], "topk_sum", keepdims=1)
    eps = g.init("eps", np.array(1e-20, np.float32))
    total = g.op("Add", [topk_sum, eps], "denominator")
    normed = g.op("Div", [w, total], "topk_weight_norm")
    weights = g.op(
        "Mul",
        [normed, g.init("routed_scaling_factor", np.array(DEEPSEEK_SCALING, np.float32))],
        "topk_weight",
    )
    routed_experts(g, rng, x, idx, weights, (h, i, e, k))
    return _fused(
        g,
        h,
        "DeepSeek-V3 router: sigmoid, e_score_correction_bias selection, "
        "group-limited top-k, routed_scaling_factor",
        k,
    )


def softmax_scaled(seed: int = 52) -> HandwrittenLayer:
    """Softmax, top-k, renormalised, then times a constant scaling factor."""
    rng = np.random.default_rng(seed)
    h, i, e, k = 32, 32, 8, 2
    g = Graph("scaled_softmax_router")
    x = g.input("x", ["T", h])
    logits = g.op("MatMul", [x, g.init("router", normal(rng, (h, e), h))], "logits")
    probs = g.op("Softmax", [logits], "probs", axis=-1)
    vals, idx = g.op_multi("TopK", [probs, g.init("k", [k])], ["top_p", "top_i"], axis=-1)
    normed = g.op(
        "Div",
        [vals, g.op("ReduceSum", [vals, g.init("ax", [-1])], "top_sum", keepdims=1)],
        "top_norm",
    )
    weights = g.op(
        "Mul",
        [normed, g.init("scaling_factor", np.array(SOFTMAX_SCALING, np.float32))],
        "scaled_routing_weights",
    )
    routed_experts(g, rng, x, idx, weights, (h, i, e, k))
    return _fused(g, h, f"softmax top-k renormalised, times a scaling factor {SOFTMAX_SCALING}", k)


def _mixer_round(g: Graph, scores: str, logits: str, p: str) -> tuple[str, str]:
    """One sparse-mixer round on ``scores``: ``(weight [T, 1], choice [T, 1])``."""
    top, choice = g.op_multi(
        "TopK", [scores, g.init(f"{p}one", [1])], [f"{p}max", f"{p}argmax"], axis=-1
    )
    factor = g.op("Max", [g.op("Abs", [logits], f"{p}abs"), top], f"{p}factor")
    gap = g.op("Div", [g.op("Sub", [top, logits], f"{p}diff"), factor], f"{p}gap")
    masked = g.op(
        "Greater", [gap, g.init(f"{p}jitter2", np.array(2 * PHIMOE_JITTER, np.float32))], f"{p}mask"
    )
    gates = g.op(
        "Where",
        [masked, g.init(f"{p}neg_inf", np.array(-np.inf, np.float32)), scores],
        f"{p}masked_gates",
    )
    gates = g.op("Softmax", [gates], f"{p}gates", axis=-1)
    return g.op("GatherElements", [gates, choice], f"{p}multiplier", axis=1), choice


def phimoe_sparse_mixer(seed: int = 53) -> HandwrittenLayer:
    """PhiMoE's sparse mixer (top-2): two rounds of a masked, jitter-thresholded softmax."""
    rng = np.random.default_rng(seed)
    h, i, e, k = 32, 32, 8, 2
    g = Graph("phimoe_router")
    x = g.input("x", ["T", h])
    logits = g.op("MatMul", [x, g.init("gate.weight", normal(rng, (h, e), h))], "router_logits")
    w1, c1 = _mixer_round(g, logits, logits, "r1_")
    # round 2 sees the scores with the first choice masked out
    neg_inf = g.init("neg_inf", np.array(-np.inf, np.float32))
    neg_inf_col = g.op("Expand", [neg_inf, g.op("Shape", [c1], "c1_shape")], "neg_inf_col")
    second = g.op("ScatterElements", [logits, c1, neg_inf_col], "masked_scores", axis=1)
    w2, c2 = _mixer_round(g, second, logits, "r2_")
    weights = g.op("Concat", [w1, w2], "multiplier", axis=1)
    idx = g.op("Concat", [c1, c2], "selected_experts", axis=1)
    routed_experts(g, rng, x, idx, weights, (h, i, e, k))
    g.output("y", ["T", h])
    # the two rounds are the two columns of TopK(logits, 2); the masked-softmax weights are
    # per slot and non-negative: the routing construction carries them exactly
    return HandwrittenLayer(
        g.model(21),
        f"PhiMoE sparse mixer (top-2, jitter {PHIMOE_JITTER})",
        Fused("MoE", {"k": k}),
    )
