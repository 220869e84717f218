"""The dense layers' parameters and their numpy reference (split out of ``dense_models``).

A :class:`DenseSpec` says which dense layer :func:`dense_models.build_dense` writes;
:func:`draw_weights` draws its float parameters from the spec's seed (int4 weights as the graph
dequantizes them), and :func:`reference` computes the layer in float64 numpy, from the meaning
of the dense form (``out = sum_e dense[:, e] * FFN_e(x)``), not from the ONNX graph.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

import numpy as np

from onnx_moe_fuse.samples.weights import quantize_int4_blocked

Form = Literal["unrolled", "onehot", "scatter", "equal"]
RouterInput = Literal["tokens", "second_input", "reversed_tokens"]
Activation = Literal["swiglu", "swiglu_oss", "relu", "gelu"]
OSS_ALPHA, OSS_LIMIT = 1.702, 7.0
BLOCK = 16


@dataclass(frozen=True)
class DenseSpec:
    """One dense layer; every random tensor comes from ``seed``."""

    form: Form = "unrolled"
    activation: Activation = "swiglu"
    renorm: bool = True
    int4: bool = False
    nbits: bool = False  # unrolled only: experts are com.microsoft.MatMulNBits (Mobius)
    variant: bool = False  # the other spellings: operand orders, keepdims=0, Add tree, Expand
    bias: bool = False
    experts: int = 4
    top_k: int = 2
    hidden: int = 32
    inter: int = 16
    seed: int = 0
    # near misses
    mask_from_other_topk: bool = False
    odd_expert_activation: int | None = None  # this expert uses another activation
    missing_expert: int | None = None  # this expert (MLP, mask, term) is left out
    einsum_combine: bool = False  # onehot / equal: Einsum("te,eth->th", dense, Y)
    topk_axis: int = -1  # 0: the TopK selects among the tokens (not a layer)
    router_input: RouterInput = "tokens"  # what the router MatMul reads
    weights_input: bool = False  # stacked forms: FC1's weights are a graph input
    topk_softmax_axis: int | None = None  # weights Softmax(TopK(logits) values, axis) instead

    @property
    def key(self) -> int:
        """The seed of the weight generator (every field counts)."""
        return zlib.crc32(repr(self).encode())


def draw_weights(spec: DenseSpec) -> dict[str, np.ndarray]:
    """The float parameters: router ``[H, E]``, stacked experts ``[E, K, N]``, biases."""
    rng = np.random.default_rng(spec.key)
    e, h, i = spec.experts, spec.hidden, spec.inter

    def normal(shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    p = {"router": normal((h, e), 1.0), "router2": normal((h, e), 1.0)}
    names = ("gate", "up") if spec.activation == "swiglu" else ("fc1",)
    width, std = (2 * i, 4.0) if spec.activation == "swiglu_oss" else (i, 1.0)  # oss: clamps
    for n in names:
        p[n] = normal((e, h, width), std / np.sqrt(h))
        p[f"{n}_bias"] = normal((e, width), 0.1)
    p["down"] = normal((e, i, h), 1.0 / np.sqrt(i))
    p["down_bias"] = normal((e, h), 0.1)
    if spec.int4 or spec.nbits:  # the model computes with the dequantized weights: so does numpy
        for n in (*names, "down"):
            codes, scale = quantize_int4_blocked(p[n], BLOCK)
            p[f"{n}_q"], p[f"{n}_s"] = codes, scale
            k = p[n].shape[1]
            p[n] = codes.astype(np.float32) * np.repeat(scale, BLOCK, axis=1)[:, :k]
    return p


def _activation(kind: str, gate: np.ndarray, up: np.ndarray | None) -> np.ndarray:
    if kind == "swiglu":
        return gate / (1.0 + np.exp(-gate)) * up
    if kind == "swiglu_tanh":
        return gate * np.tanh(gate) * up
    if kind.startswith("swiglu_oss"):  # gpt-oss: strided halves, clamped, alpha, up + 1
        alpha = OSS_ALPHA if kind == "swiglu_oss" else 1.0
        g = np.minimum(gate[..., ::2], OSS_LIMIT)
        lin = np.clip(gate[..., 1::2], -OSS_LIMIT, OSS_LIMIT)
        return g / (1.0 + np.exp(-alpha * g)) * (lin + 1.0)
    if kind == "relu":
        return np.maximum(gate, 0.0)
    c = np.sqrt(2.0 / np.pi)
    return 0.5 * gate * (1.0 + np.tanh(c * (gate + 0.044715 * gate**3)))


def reference(spec: DenseSpec, x: np.ndarray) -> np.ndarray:
    """numpy: the dense layer of ``spec`` on tokens ``x [T, H]`` (float64).

    Not for the router and weight mutations (``topk_axis``, ``router_input``,
    ``weights_input``): they are built only to be refused.
    """
    assert spec.topk_axis == -1 and spec.router_input == "tokens" and not spec.weights_input
    assert spec.topk_softmax_axis in (None, -1, 1)  # -1: the renormalised top-k probabilities
    p = {k: v.astype(np.float64) for k, v in draw_weights(spec).items() if v.dtype == np.float32}
    x = x.astype(np.float64)

    def topk(router):
        logits = x @ router
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        idx = np.argsort(-probs, axis=-1, kind="stable")[:, : spec.top_k]
        return idx, np.take_along_axis(probs, idx, -1)

    idx, vals = topk(p["router"])
    renorm = spec.renorm or spec.topk_softmax_axis is not None
    w = vals / vals.sum(-1, keepdims=True) if renorm else vals
    if spec.mask_from_other_topk:
        idx, _ = topk(p["router2"])
    out = np.zeros_like(x)
    for e in range(spec.experts):
        if e == spec.missing_expert:
            continue
        kind = (
            odd_activation(spec.activation) if e == spec.odd_expert_activation else spec.activation
        )

        def b(n: str, e: int = e) -> np.ndarray | float:
            return p[f"{n}_bias"][e] if spec.bias else 0.0

        if spec.activation == "swiglu":
            gate, up = x @ p["gate"][e] + b("gate"), x @ p["up"][e] + b("up")
        else:
            gate, up = x @ p["fc1"][e] + b("fc1"), None
        y = _activation(kind, gate, up) @ p["down"][e] + b("down")
        dense_w = ((idx == e) * w).sum(-1, keepdims=True)
        out += dense_w * y
    return out


def odd_activation(kind: str) -> str:
    """Another activation for the odd expert (same FC1 inputs)."""
    return {
        "swiglu": "swiglu_tanh",
        "swiglu_oss": "swiglu_oss_alpha1",
        "relu": "gelu",
        "gelu": "relu",
    }[kind]
