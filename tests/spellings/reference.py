"""A numpy reference of a generated MoE layer, written from the layer's meaning alone.

It reads the case's spelling names and the float parameters the builder drew (weights as the
graph dequantizes them, in the logical ``[E, K, N]`` layout) and computes the layer token by
token in float64: router logits, the routing (softmax or sigmoid scores, a biased or
group-limited top-k, renormalisation, a routing factor), the selected experts' FFNs, the
weighted sum. It shares no code with ``onnx_moe_fuse`` (nor its oracles), so a fused model that
matches it matches the layer's meaning, not the fuser's reading of it.
"""

from __future__ import annotations

import numpy as np

from .axes import GATHER_ROUTINGS, SOFTMAX_SCORED, UNNORMALISED_ROUTINGS
from .case import LayerCase


def _softmax(v: np.ndarray) -> np.ndarray:
    z = np.exp(v - v.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-v))


def _top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """ONNX TopK(largest, sorted) on the last axis; ties go to the lower index."""
    idx = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(scores, idx, axis=-1), idx


def _group_limited(case: LayerCase, choice: np.ndarray) -> np.ndarray:
    """DeepSeek-V3's group limit: choice scores outside the ``topk_group`` best groups set to 0.

    A group's score is the sum of its two largest choice scores.
    """
    t, e = choice.shape
    grouped = choice.reshape(t, case.groups, e // case.groups)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # [T, G]
    _, best = _top_k(group_scores, case.topk_group)
    keep = np.zeros_like(group_scores, dtype=bool)
    np.put_along_axis(keep, best, True, axis=-1)
    return np.where(np.repeat(keep, e // case.groups, axis=-1), choice, 0.0)


def routing(
    case: LayerCase, logits: np.ndarray, params: dict[str, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The k routing weights and expert ids of every token (rows of ``logits`` ``[T, E]``).

    ``params`` holds what the builder drew for the routing (``routing_factor``,
    ``selection_bias``); the routings that have neither need none.
    """
    p = params or {}
    k, r = case.top_k, case.routing
    if r == "topk_softmax":
        vals, idx = _top_k(logits, k)
        return _softmax(vals), idx
    scores = _softmax(logits) if r in SOFTMAX_SCORED else _sigmoid(logits)
    if r in GATHER_ROUTINGS:  # chosen by the biased scores, weighted by the unbiased ones
        choice = scores + p["selection_bias"]
        if r == "grouped_topk":
            choice = _group_limited(case, choice)
        _, idx = _top_k(choice, k)
        vals = np.take_along_axis(scores, idx, axis=-1)
    else:
        vals, idx = _top_k(scores, k)
    if r in UNNORMALISED_ROUTINGS:
        return vals, idx
    total = vals.sum(axis=-1, keepdims=True)
    if r == "softmax_bias_clamp":
        return vals / np.maximum(total, 1e-12), idx
    if r in ("sigmoid_topk_renorm_scaled", "biased_selection", "grouped_topk"):
        total = total + 1e-20
    weights = vals / total
    return (weights * p["routing_factor"] if "routing_factor" in p else weights), idx


def _activation(case: LayerCase, p: dict[str, np.ndarray], e: int, t: np.ndarray) -> np.ndarray:
    """Expert ``e``'s FC1 and activation on one token ``t`` ``[H]``; returns ``[I]``."""
    act, i = case.activation, case.inter

    def fc(name: str) -> np.ndarray:  # one FC1 projection of token t by expert e, biased
        out = t @ p[f"{name}_weight"][e]
        return out + p[f"{name}_bias"][e] if f"{name}_bias" in p else out

    if act == "swiglu_separate":
        gate, up = fc("fc1_gate"), fc("fc1_up")
        return gate * _sigmoid(gate) * up
    h = fc("fc1")
    if act in ("swiglu_split", "swiglu_slice", "swiglu_exp"):
        gate, up = h[:i], h[i:]
        return gate * _sigmoid(gate) * up
    if act == "swiglu_strided":
        gate, up = h[0::2], h[1::2]
        return gate * _sigmoid(gate) * up
    if act == "swiglu_oss":
        gate, up = np.minimum(h[0::2], 7.0), np.clip(h[1::2], -7.0, 7.0)
        return gate * _sigmoid(1.702 * gate) * (up + 1.0)
    if act in ("swish", "silu_x_sigmoid", "silu_sigmoid_x", "silu_exp"):
        return h * _sigmoid(h)
    if act == "relu":
        return np.maximum(h, 0.0)
    assert act in ("gelu_tanh", "gelu_tanh_hand"), act
    return 0.5 * h * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (h + 0.044715 * h**3)))


def reference(case: LayerCase, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The layer's output for tokens ``x`` (``[T, H]`` or ``[B, S, H]``), as float64."""
    p = {name: a.astype(np.float64) for name, a in params.items()}
    tokens = x.astype(np.float64).reshape(-1, case.hidden)
    logits = tokens @ p["router_weight"]
    if "router_bias" in p:
        logits = logits + p["router_bias"]
    weights, ids = routing(case, logits, p)
    out = np.zeros_like(tokens)
    for row, t in enumerate(tokens):
        for w, e in zip(weights[row], ids[row], strict=True):
            y = _activation(case, p, int(e), t) @ p["fc2_weight"][e]
            out[row] += w * (y + p["fc2_bias"][e] if "fc2_bias" in p else y)
    return out.reshape(x.shape)
