"""A numpy reference of a generated MoE layer, written from the layer's meaning alone.

It reads the case's spelling names and the float parameters the builder drew (weights as the
graph dequantizes them, in the logical ``[E, K, N]`` layout) and computes the layer token by
token in float64: router logits, softmax routing, top-k, the selected experts' FFNs, the
weighted sum. It shares no code with ``onnx_moe_fuse`` (nor its oracles), so a fused model that
matches it matches the layer's meaning, not the fuser's reading of it.
"""

from __future__ import annotations

import numpy as np

from .strategies import LayerCase


def _softmax(v: np.ndarray) -> np.ndarray:
    z = np.exp(v - v.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-v))


def _top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """ONNX TopK(largest, sorted) on the last axis; ties go to the lower index."""
    idx = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(scores, idx, axis=-1), idx


def routing(case: LayerCase, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The k routing weights and expert ids of every token (rows of ``logits`` ``[T, E]``)."""
    k = case.top_k
    if case.routing == "topk_softmax":
        vals, idx = _top_k(logits, k)
        return _softmax(vals), idx
    vals, idx = _top_k(_softmax(logits), k)
    if case.routing == "softmax_topk_raw":
        return vals, idx
    return vals / vals.sum(axis=-1, keepdims=True), idx


def _activation(case: LayerCase, p: dict[str, np.ndarray], e: int, t: np.ndarray) -> np.ndarray:
    """Expert ``e``'s FC1 and activation on one token ``t`` ``[H]``; returns ``[I]``."""
    act, i = case.activation, case.inter
    if act == "swiglu_separate":
        gate, up = t @ p["fc1_gate_weight"][e], t @ p["fc1_up_weight"][e]
        return gate * _sigmoid(gate) * up
    h = t @ p["fc1_weight"][e]
    if act in ("swiglu_split", "swiglu_slice"):
        gate, up = h[:i], h[i:]
        return gate * _sigmoid(gate) * up
    if act == "swiglu_strided":
        gate, up = h[0::2], h[1::2]
        return gate * _sigmoid(gate) * up
    if act == "swiglu_oss":
        gate, up = np.minimum(h[0::2], 7.0), np.clip(h[1::2], -7.0, 7.0)
        return gate * _sigmoid(1.702 * gate) * (up + 1.0)
    if act in ("swish", "silu_x_sigmoid", "silu_sigmoid_x"):
        return h * _sigmoid(h)
    if act == "relu":
        return np.maximum(h, 0.0)
    assert act == "gelu_tanh", act
    return 0.5 * h * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (h + 0.044715 * h**3)))


def reference(case: LayerCase, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The layer's output for tokens ``x`` (``[T, H]`` or ``[B, S, H]``), as float64."""
    p = {name: a.astype(np.float64) for name, a in params.items()}
    tokens = x.astype(np.float64).reshape(-1, case.hidden)
    logits = tokens @ p["router_weight"]
    if "router_bias" in p:
        logits = logits + p["router_bias"]
    weights, ids = routing(case, logits)
    out = np.zeros_like(tokens)
    for row, t in enumerate(tokens):
        for w, e in zip(weights[row], ids[row], strict=True):
            out[row] += w * (_activation(case, p, int(e), t) @ p["fc2_weight"][e])
    return out.reshape(x.shape)
