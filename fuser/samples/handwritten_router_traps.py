"""Hand-written routers beyond softmax top-k: two more that fuse, and the traps that must not.

Layer 11 of the hand-written catalogue, continued (:mod:`.handwritten_routers` has the first
routers). Every layer has the same per-slot SwiGLU experts (``routed_experts``); the router is
written as its upstream code does:

* :func:`ernie_clamped` (fuses): ERNIE-4.5-MoE: softmax, selection by the softmax plus a
  correction bias, weights gathered from the unbiased softmax and divided by
  ``clamp(sum, min=eps)``;
* :func:`switch_top1` (fuses): Switch-style top-1: the largest softmax probability is the weight;
* :func:`switch_argmax` (fuses): the same written as ``torch.max(probs, dim)`` exports it:
  ``ArgMax`` for the expert, ``ReduceMax`` for the weight (``keepdims=0`` then ``Unsqueeze``,
  or ``keepdims=1``);

and four traps, each a router that is *not* per-selected non-negative weights of the experts
FC1/FC2 use, refused with the router part named:

* :func:`weights_other_experts`: weights gathered at the experts a second TopK chose;
* :func:`weights_other_token`: weights gathered from the scores of the next token (a roll);
* :func:`negative_weights`: the raw top-k logits as weights (negative ones included);
* :func:`capacity_drop`: GShard/Switch capacity: a slot whose expert already has ``capacity``
  earlier tokens (a CumSum over the tokens) gets weight 0.
"""

from __future__ import annotations

import numpy as np

from onnx_moe_fuse.samples.handwritten_graph import Fused, Graph, HandwrittenLayer, Refused, normal
from onnx_moe_fuse.samples.handwritten_routers import routed_experts

__all__ = [
    "capacity_drop",
    "ernie_clamped",
    "negative_weights",
    "switch_argmax",
    "switch_top1",
    "weights_other_experts",
    "weights_other_token",
]

_DIMS = (32, 32, 8, 2)  # H, I, E, k


def _router(g: Graph, rng: np.random.Generator, x: str, e: int, name: str = "router") -> str:
    h = _DIMS[0]
    return g.op("MatMul", [x, g.init(f"{name}.weight", normal(rng, (h, e), h))], f"{name}_logits")


def _layer(g: Graph, rng, x: str, idx: str, weights: str, description: str, expected):
    h, i, e, k = _DIMS
    routed_experts(g, rng, x, idx, weights, (h, i, e, k))
    g.output("y", ["T", h])
    return HandwrittenLayer(g.model(21), description, expected)


def ernie_clamped(seed: int = 60) -> HandwrittenLayer:
    """ERNIE-4.5-MoE: biased selection of softmax probabilities, clamped renormalisation."""
    rng = np.random.default_rng(seed)
    h, i, e, k = _DIMS
    g = Graph("ernie_router")
    x = g.input("x", ["T", h])
    probs = g.op("Softmax", [_router(g, rng, x, e)], "gate_probs", axis=-1)
    bias = g.init("moe_statics.e_score_correction_bias", (rng.random(e) * 0.2).astype(np.float32))
    choice = g.op("Add", [probs, bias], "probs_for_choice")
    _, idx = g.op_multi("TopK", [choice, g.init("k", [k])], ["top_choice", "top_idx"], axis=-1)
    w = g.op("GatherElements", [probs, idx], "top_probs", axis=1)
    total = g.op("ReduceSum", [w, g.init("ax", [-1])], "top_sum", keepdims=1)
    eps = g.init("min_norm", np.array(1e-12, np.float32))
    clamped = g.op("Clip", [total, eps], "top_sum_clamped")
    weights = g.op("Div", [w, clamped], "routing_weights")
    return _layer(g, rng, x, idx, weights, "ERNIE-4.5: biased selection, clamp(sum) renorm",
                  Fused("MoE", {"k": k}))  # fmt: skip


def switch_top1(seed: int = 61) -> HandwrittenLayer:
    """Switch top-1: the expert of the largest probability, weighted by that probability."""
    rng = np.random.default_rng(seed)
    h, _, e, _ = _DIMS
    g = Graph("switch_router")
    x = g.input("x", ["T", h])
    probs = g.op("Softmax", [_router(g, rng, x, e)], "router_probs", axis=-1)
    top, idx = g.op_multi("TopK", [probs, g.init("one", [1])], ["max_prob", "expert_idx"], axis=-1)
    h, i, e, _ = _DIMS
    routed_experts(g, rng, x, idx, top, (h, i, e, 1))
    g.output("y", ["T", h])
    return HandwrittenLayer(
        g.model(21), "Switch top-1: weight = the largest probability", Fused("MoE", {"k": 1})
    )


def switch_argmax(seed: int = 66, keepdims: int = 0) -> HandwrittenLayer:
    """Switch top-1 as ``torch.max(probs, dim=-1)`` exports it: ArgMax + ReduceMax."""
    rng = np.random.default_rng(seed)
    h, i, e, _ = _DIMS
    g = Graph("switch_argmax_router")
    x = g.input("x", ["T", h])
    probs = g.op("Softmax", [_router(g, rng, x, e)], "router_probs", axis=-1)
    axes = g.init("last", [-1])
    idx = g.op("ArgMax", [probs], "expert_index", axis=-1, keepdims=keepdims)
    top = g.op("ReduceMax", [probs, axes], "max_prob", keepdims=keepdims)
    if not keepdims:
        idx = g.op("Unsqueeze", [idx, axes], "expert_index_k")
        top = g.op("Unsqueeze", [top, axes], "max_prob_k")
    routed_experts(g, rng, x, idx, top, (h, i, e, 1))
    g.output("y", ["T", h])
    return HandwrittenLayer(
        g.model(21),
        f"Switch top-1 via ArgMax + ReduceMax (keepdims={keepdims})",
        Fused("MoE", {"k": 1}),
    )


def weights_other_experts(seed: int = 62) -> HandwrittenLayer:
    """Trap: the weights are gathered at the experts of a second router's TopK."""
    rng = np.random.default_rng(seed)
    h, i, e, k = _DIMS
    g = Graph("other_experts_router")
    x = g.input("x", ["T", h])
    scores = g.op("Sigmoid", [_router(g, rng, x, e)], "scores")
    _, idx = g.op_multi("TopK", [scores, g.init("k", [k])], ["top_s", "top_idx"], axis=-1)
    other = g.op("Sigmoid", [_router(g, rng, x, e, "second")], "second_scores")
    _, idx2 = g.op_multi("TopK", [other, g.init("k2", [k])], ["top_o", "other_idx"], axis=-1)
    w = g.op("GatherElements", [scores, idx2], "weights_elsewhere", axis=1)
    return _layer(g, rng, x, idx, w, "trap: weights gathered at another TopK's experts",
                  Refused("routing", "not at the experts"))  # fmt: skip


def weights_other_token(seed: int = 63) -> HandwrittenLayer:
    """Trap: each token is weighted by the next token's scores (rows rolled by one)."""
    rng = np.random.default_rng(seed)
    h, i, e, k = _DIMS
    g = Graph("other_token_router")
    x = g.input("x", ["T", h])
    scores = g.op("Sigmoid", [_router(g, rng, x, e)], "scores")
    _, idx = g.op_multi("TopK", [scores, g.init("k", [k])], ["top_s", "top_idx"], axis=-1)
    big = np.iinfo(np.int64).max
    rest = g.op(
        "Slice", [scores, g.init("s1", [1]), g.init("e1", [big]), g.init("a1", [0])], "rest"
    )
    first = g.op(
        "Slice", [scores, g.init("s0", [0]), g.init("e0", [1]), g.init("a0", [0])], "first"
    )
    rolled = g.op("Concat", [rest, first], "scores_rolled", axis=0)
    w = g.op("GatherElements", [rolled, idx], "weights_next_token", axis=1)
    return _layer(g, rng, x, idx, w, "trap: weights from the next token's scores",
                  Refused("routing", "token axis"))  # fmt: skip


def negative_weights(seed: int = 64) -> HandwrittenLayer:
    """Trap: the top-k logits themselves weigh the experts (no softmax): they can be < 0."""
    rng = np.random.default_rng(seed)
    h, i, e, k = _DIMS
    g = Graph("raw_logit_router")
    x = g.input("x", ["T", h])
    vals, idx = g.op_multi(
        "TopK", [_router(g, rng, x, e), g.init("k", [k])], ["top_logits", "top_idx"], axis=-1
    )
    return _layer(g, rng, x, idx, vals, "trap: raw top-k logits as weights",
                  Refused("routing", "negative"))  # fmt: skip


def capacity_drop(seed: int = 65, capacity: int = 1) -> HandwrittenLayer:
    """Trap: GShard capacity: slots beyond ``capacity`` earlier tokens per expert weigh 0."""
    rng = np.random.default_rng(seed)
    h, i, e, k = _DIMS
    g = Graph("capacity_router")
    x = g.input("x", ["T", h])
    probs = g.op("Softmax", [_router(g, rng, x, e)], "probs", axis=-1)
    vals, idx = g.op_multi("TopK", [probs, g.init("k", [k])], ["top_p", "top_idx"], axis=-1)
    onehot = g.op("OneHot", [idx, g.init("depth", [e]), g.init("onoff", np.array([0.0, 1.0], np.float32))], "onehot", axis=-1)  # fmt: skip
    per_expert = g.op("ReduceSum", [onehot, g.init("slot_ax", [1])], "token_expert", keepdims=0)
    position = g.op("CumSum", [per_expert, g.init("token_ax", np.array(0, np.int64))], "position")
    keep = g.op("LessOrEqual", [position, g.init("capacity", np.array(float(capacity), np.float32))], "keep")  # fmt: skip
    keep_f = g.op("Cast", [keep], "keep_f", to=1)
    kept = g.op("GatherElements", [keep_f, idx], "slot_kept", axis=1)
    w = g.op("Mul", [vals, kept], "capacity_weights")
    return _layer(g, rng, x, idx, w, f"trap: capacity {capacity} per expert (CumSum over tokens)",
                  Refused("routing", "token axis"))  # fmt: skip
