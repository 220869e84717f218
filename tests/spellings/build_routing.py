"""The routing part of a generated MoE layer (split out of ``build.py``): scores, choice, weights.

Every routing is written as the model that uses it writes it (transformers' PyTorch, exported):

* the softmax routings of ``axes.SOFTMAX_ROUTINGS`` (Mixtral, Qwen-MoE, OLMoE);
* the value routings of ``axes.VALUE_ROUTINGS``: the k weights are the TopK's values of the
  scores, as they are (``sigmoid_topk``; ``argmax_top1``, Switch's ``max`` of the softmax,
  written as ``torch.max`` exports it: ArgMax + ReduceMax, keepdims drawn) or
  renormalised and times a constant routing factor (``sigmoid_topk_renorm_scaled``,
  ``softmax_topk_scaled``);
* the gather routings of ``axes.GATHER_ROUTINGS``: the TopK chooses by the scores plus a
  constant bias ``[E]`` and the weights are ``GatherElements(scores, ids)`` of the unbiased
  scores: DeepSeek-V3 / GLM-4.5 (``biased_selection``: sigmoid, renormalised with ``+ 1e-20``,
  times the factor), DeepSeek-V3's group-limited choice (``grouped_topk``: the biased scores
  viewed ``[*, G, E/G]``, each group scored by its top-2 sum, the top ``topk_group`` groups
  scattered into a mask, widened to ``[*, E]``, the rest filled with 0 by ``Where``, then the
  TopK), ERNIE-4.5 (``softmax_bias_clamp``: softmax, divided by ``Clip(sum, min=1e-12)``).

The bias and the factor are drawn from the case's seed (``Built.params``: ``selection_bias``,
``routing_factor``). The routing's mutations (``axes.MUTATIONS``) each change one place:
``softmax_axis`` / ``topk_axis`` the axis of the Softmax / the experts' TopK;
``weights_other_experts`` the k values reversed along k (value routings), or the gather's ids
from a second TopK over the unbiased scores (gather routings); ``weights_other_token`` the
values (or the gathered scores) rolled by one row along the token axis (Slice + Concat);
``negative_weight`` the TopK reading the raw logits (routings without renormalisation), else
the final weights minus 0.5; ``capacity_drop`` the weights times a keep mask of Switch's
expert capacity (one-hot of the ids, CumSum over the tokens, ``<= 1``, gathered per slot).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from onnx import TensorProto, helper

from .axes import GATHER_ROUTINGS, SOFTMAX_SCORED, UNNORMALISED_ROUTINGS
from .build import INT64_MAX, INT64_MIN

if TYPE_CHECKING:
    from .build import _Layer

SIGMOID_EPS = 1e-20  # DeepSeek-V3's denominator: sum + 1e-20
CLAMP_MIN = 1e-12  # ERNIE-4.5's norm_min: sum clamped below
CAPACITY = 1.0  # capacity_drop: one token per expert (along the token axis)
#: Routings with a constant routing factor on the renormalised weights.
FACTORED = frozenset(
    {"sigmoid_topk_renorm_scaled", "softmax_topk_scaled", "biased_selection", "grouped_topk"}
)


def routing(layer: _Layer, logits: str, rank: int) -> tuple[str, str]:
    """Write the routing on ``logits [*, E]``; returns (the weights ``[*, k]``, the ids)."""
    c, g, m = layer.case, layer.g, layer.mutation
    factor = None
    if c.routing in FACTORED:
        factor = np.float32(layer.rng.uniform(0.5, 3.0))  # DeepSeek-V3 2.5, GLM-4.5 1 or 2.5
        layer.params["routing_factor"] = np.array(factor, dtype=np.float32)
    if c.routing == "topk_softmax":
        vals, idx = _topk(layer, logits, c.top_k)
        vals = _other_values(layer, vals, rank)
        weights = g.node("Softmax", [vals], "routing_weights", axis=_softmax_axis(layer))
    elif c.routing in GATHER_ROUTINGS:
        weights, idx = _gathered(layer, logits, rank)
    else:
        raw = m == "negative_weight" and c.routing in UNNORMALISED_ROUTINGS
        scores = logits if raw else _scores(layer, logits)
        if c.routing == "argmax_top1" and m != "topk_axis":
            vals, idx = _argmax_max(layer, scores, rank)
        else:
            vals, idx = _topk(layer, scores, c.top_k)
        weights = _other_values(layer, vals, rank)
    weights = _post(layer, weights, factor)
    if m == "negative_weight" and c.routing not in UNNORMALISED_ROUTINGS:
        weights = g.node("Sub", [weights, g.f32(0.5)], "routing_weights_shifted")
    if m == "capacity_drop":
        weights = _capacity_drop(layer, weights, idx, rank)
    return weights, idx


def _argmax_max(layer: _Layer, scores: str, rank: int) -> tuple[str, str]:
    """Switch's ``torch.max(probs, dim=-1)``: ArgMax for the expert, ReduceMax for the weight.

    ``keepdims`` drawn: 0 (then ``Unsqueeze(-1)`` of both, as ``.unsqueeze(-1)``) or 1.
    """
    g = layer.g
    keep = int(layer.rng.integers(0, 2))
    idx = g.node("ArgMax", [scores], "expert_index", axis=-1, keepdims=keep)
    top = g.node("ReduceMax", [scores, g.i64(-1)], "max_prob", keepdims=keep)
    if not keep:
        idx = g.node("Unsqueeze", [idx, g.i64(-1)], "expert_index_k")
        top = g.node("Unsqueeze", [top, g.i64(-1)], "max_prob_k")
    return top, idx


def _softmax_axis(layer: _Layer) -> int:
    return 0 if layer.mutation == "softmax_axis" else -1


def _topk(layer: _Layer, scores: str, k: int, hint: str = "topk") -> tuple[str, str]:
    """The experts' TopK (``topk_axis``: along the tokens instead)."""
    axis = 0 if layer.mutation == "topk_axis" else -1
    k_name = layer.g.i64(k)
    return layer.g.node("TopK", [scores, k_name], hint, outputs=2, axis=axis, largest=1, sorted=1)


def _scores(layer: _Layer, logits: str) -> str:
    """The router scores ``[*, E]``: a Softmax over the experts, or a Sigmoid."""
    if layer.case.routing in SOFTMAX_SCORED:
        return layer.g.node("Softmax", [logits], "router_probs", axis=_softmax_axis(layer))
    return layer.g.node("Sigmoid", [logits], "router_scores")


def _reverse_slots(layer: _Layer, value: str, hint: str) -> str:
    g = layer.g
    return g.node("Slice", [value, g.i64(-1), g.i64(INT64_MIN), g.i64(-1), g.i64(-1)], hint)


def _roll_tokens(layer: _Layer, value: str, rank: int, hint: str) -> str:
    """``value`` rolled by one row along the token axis: row t holds row t + 1's (the last 0's)."""
    g, axis = layer.g, rank - 2
    rest = g.node("Slice", [value, g.i64(1), g.i64(INT64_MAX), g.i64(axis)], f"{hint}_rest")
    first = g.node("Slice", [value, g.i64(0), g.i64(1), g.i64(axis)], f"{hint}_first")
    return g.node("Concat", [rest, first], hint, axis=axis)


def _other_values(layer: _Layer, vals: str, rank: int) -> str:
    """The TopK's values, or (mutations) those of other slots or of the next token."""
    if layer.mutation == "weights_other_experts":
        return _reverse_slots(layer, vals, "topk_values_reversed")
    if layer.mutation == "weights_other_token":
        return _roll_tokens(layer, vals, rank, "topk_values_next_token")
    return vals


def _gathered(layer: _Layer, logits: str, rank: int) -> tuple[str, str]:
    """Chosen by the biased (and group-masked) scores, weighted by the unbiased ones."""
    c, g, m = layer.case, layer.g, layer.mutation
    bias = (layer.rng.standard_normal(c.experts_count) * 0.1).astype(np.float32)
    layer.params["selection_bias"] = bias
    scores = _scores(layer, logits)
    choice = g.node("Add", [scores, g.init("e_score_correction_bias", bias)], "scores_for_choice")
    if c.routing == "grouped_topk":
        choice = _group_masked(layer, choice, rank)
    _, idx = _topk(layer, choice, c.top_k)
    gather_ids = idx
    if m == "weights_other_experts":  # the ids of the unbiased choice
        _, gather_ids = _topk(layer, scores, c.top_k, "unbiased_topk")
    source = scores
    if m == "weights_other_token":
        source = _roll_tokens(layer, scores, rank, "scores_next_token")
    weights = g.node("GatherElements", [source, gather_ids], "topk_weight", axis=-1)
    return weights, idx


def _group_masked(layer: _Layer, choice: str, rank: int) -> str:
    """DeepSeek-V3's group limit: the choice scores outside the top groups filled with 0."""
    c, g = layer.case, layer.g
    e, groups = c.experts_count, c.groups
    size = e // groups
    lead = [-1] if rank == 2 else [0, 0]
    grouped = g.node("Reshape", [choice, g.i64(*lead, groups, size)], "scores_grouped")
    top2, _ = g.node("TopK", [grouped, g.i64(2)], "group_top2", outputs=2, axis=-1, sorted=1)
    group_scores = g.node("ReduceSum", [top2, g.i64(-1)], "group_scores", keepdims=0)
    _, group_idx = g.node(
        "TopK", [group_scores, g.i64(c.topk_group)], "group_topk", outputs=2, axis=-1, sorted=0
    )
    zero = helper.make_tensor("value", TensorProto.FLOAT, [1], [0.0])
    zeros = g.node(
        "ConstantOfShape", [g.node("Shape", [group_scores], "group_shape")], "group_zeros",
        value=zero,
    )  # fmt: skip
    ones = g.node("Expand", [g.f32(1.0), g.node("Shape", [group_idx], "idx_shape")], "group_ones")
    group_mask = g.node("ScatterElements", [zeros, group_idx, ones], "group_mask", axis=-1)
    mask = g.node("Unsqueeze", [group_mask, g.i64(-1)], "group_mask_1")
    mask = g.node("Expand", [mask, g.i64(1, 1, size)], "expert_mask_grouped")
    mask = g.node("Reshape", [mask, g.i64(*lead, e)], "score_mask")
    dropped = g.node("Not", [g.node("Cast", [mask], "score_keep", to=TensorProto.BOOL)], "drop")
    return g.node("Where", [dropped, g.f32(0.0), choice], "scores_masked")


def _post(layer: _Layer, weights: str, factor: np.float32 | None) -> str:
    """Renormalise the k per-selected values (and scale them) as the routing says."""
    c, g = layer.case, layer.g
    r = c.routing
    if r in UNNORMALISED_ROUTINGS or r == "topk_softmax":
        return weights
    total = g.node("ReduceSum", [weights, g.i64(-1)], "topk_sum", keepdims=1)
    if r == "softmax_topk_reciprocal":
        inv = g.node("Reciprocal", [total], "topk_sum_inv")
        return g.node("Mul", [weights, inv], "routing_weights")
    if r == "softmax_bias_clamp":
        clamped = g.node("Clip", [total, g.f32(CLAMP_MIN)], "topk_sum_clamped")
        return g.node("Div", [weights, clamped], "routing_weights")
    if r in ("sigmoid_topk_renorm_scaled", "biased_selection", "grouped_topk"):
        total = g.node("Add", [total, g.f32(SIGMOID_EPS)], "denominator")
    weights = g.node(
        "Div", [weights, total], "routing_weights_norm" if factor else "routing_weights"
    )
    if factor is None:
        return weights
    return g.node("Mul", [weights, g.f32(float(factor))], "routing_weights")


def _capacity_drop(layer: _Layer, weights: str, idx: str, rank: int) -> str:
    """Switch's token dropping: the weight of a slot past its expert's capacity becomes 0."""
    c, g = layer.case, layer.g
    values = g.init("onehot_values", np.array([0.0, 1.0], dtype=np.float32))
    onehot = g.node("OneHot", [idx, g.i64(c.experts_count), values], "expert_index", axis=-1)
    hits = g.node("ReduceSum", [onehot, g.i64(-2)], "expert_hits", keepdims=0)  # [*, E]
    axis = g.init("token_axis", np.array(rank - 2, dtype=np.int64))
    priority = g.node("CumSum", [hits, axis], "token_priority")
    keep = g.node("LessOrEqual", [priority, g.f32(CAPACITY)], "expert_capacity_mask")
    keep = g.node("Cast", [keep], "expert_capacity_keep", to=TensorProto.FLOAT)
    slot_keep = g.node("GatherElements", [keep, idx], "slot_keep", axis=-1)
    return g.node("Mul", [weights, slot_keep], "routing_weights_kept")
