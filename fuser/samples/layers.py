"""Builders of one MoE layer in ONNX text form, from a :class:`LayerSpec`.

A layer is written in the pieces the fuser has to recognise:

* tokens: ``x [T, H]``, or ``x [B, S, H]`` reshaped to ``[-1, H]`` and back at the end;
* router: ``MatMul(tokens, router_weight [H, E])`` (``+ router_bias [E]``);
* routing, one of ``softmax_topk_renorm`` (Softmax, TopK, ``Div(v, ReduceSum(v))``),
  ``softmax_topk`` (Softmax, TopK, values used as they are), ``topk_softmax`` (TopK on the logits,
  Softmax over the k values), ``sigmoid_topk_renorm`` (Sigmoid instead of Softmax);
* experts, in one of two spellings: ``GroupedMatMul`` (opset 29) or its Gather/Expand/MatMul
  decomposition; weights float, or quantized behind ``DequantizeLinear``; optional per-expert bias;
* activation: SwiGLU from separate gate/up experts, gpt-oss's interleaved clamped SwiGLU, Gelu
  (tanh approximation, the ``Gelu`` op), or exact GELU spelled with ``Erf``;
* combine: ``ReduceSum(Mul(expert_out [M, k, H], Unsqueeze(weights, -1)), axes=[1])``;
* optionally a Qwen2-MoE shared expert (plain SwiGLU MLP times ``Sigmoid(MatMul(x, w [H, 1]))``)
  added to the MoE output.

Every random tensor is drawn from a numpy Generator seeded by ``LayerSpec.seed_key`` in one fixed
order, independent of the spelling, so a GroupedMatMul sample and its decomposed twin hold the
same weights.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx

from onnx_moe_fuse.samples.text_form import GraphText
from onnx_moe_fuse.samples.weights import (
    quantize_int4_blocked,
    quantize_uint8_asymmetric,
    quantize_uint8_channel,
)

__all__ = [
    "LayerSpec",
    "build_layer",
    "draw_params",
    "Routing",
    "Activation",
    "Spelling",
    "Weights",
]

Routing = Literal["softmax_topk_renorm", "softmax_topk", "topk_softmax", "sigmoid_topk_renorm"]
Activation = Literal["swiglu", "swiglu_oss", "gelu_tanh", "gelu_erf"]
Spelling = Literal["gmm", "dec"]
Weights = Literal["f32", "int4b32", "int4b128", "u8pc", "u8asym"]

GROUPED_MATMUL_OPSET = 29
DECOMPOSED_OPSET = 21  # blocked DequantizeLinear needs opset 21
IR_VERSION = 10  # int4 needs IR 10; ORT 1.32 loads it

_INT64_MAX = 9223372036854775807


@dataclass(frozen=True)
class LayerSpec:
    """Everything that defines one sample layer (weights come from ``seed_key``)."""

    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    routing: Routing
    activation: Activation
    spelling: Spelling
    weights: Weights
    seed_key: str
    router_bias: bool = False
    expert_bias: bool = False
    shared_inter: int = 0  # > 0: add a Qwen2-MoE shared expert of this width
    weights_as_inputs: bool = False  # expert weights are graph inputs, not initializers
    rank: int = 2
    squeeze_by_reshape: bool = False  # decomposed spelling drops the unit axis with Reshape
    fc1_scale: float = 1.0  # FC1 outputs have about this std (gpt-oss: large enough to clamp)

    @property
    def opset(self) -> int:
        """The default-domain opset the model declares."""
        return GROUPED_MATMUL_OPSET if self.spelling == "gmm" else DECOMPOSED_OPSET

    @property
    def fc1_width(self) -> int:
        """Output width N of each FC1 projection (gate and up are separate when swiglu)."""
        return 2 * self.inter if self.activation == "swiglu_oss" else self.inter

    @property
    def token_dims(self) -> tuple[str, ...]:
        """Symbolic dims of the token input, before H."""
        return ("T",) if self.rank == 2 else ("B", "S")


def _seed(key: str) -> int:
    return zlib.crc32(key.encode("utf-8"))


def draw_params(spec: LayerSpec) -> dict[str, np.ndarray]:
    """Draw the float parameters of ``spec`` (same values for both spellings)."""
    rng = np.random.default_rng(_seed(spec.seed_key))
    h, i, e = spec.hidden, spec.inter, spec.experts

    def normal(shape: tuple[int, ...], scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    p: dict[str, np.ndarray] = {}
    p["router_weight"] = normal((h, e), 1.0 / np.sqrt(h))
    p["router_bias"] = normal((e,), 0.5)
    fc1_std = spec.fc1_scale / np.sqrt(h)
    if spec.activation == "swiglu":
        p["fc1_gate_weight"] = normal((e, h, i), fc1_std)
        p["fc1_up_weight"] = normal((e, h, i), fc1_std)
    else:
        p["fc1_weight"] = normal((e, h, spec.fc1_width), fc1_std)
    p["fc2_weight"] = normal((e, i, h), 1.0 / np.sqrt(i))
    p["fc1_bias"] = normal((e, spec.fc1_width), 0.1)
    p["fc2_bias"] = normal((e, h), 0.1)
    if spec.shared_inter:
        s = spec.shared_inter
        p["shared_gate_weight"] = normal((h, s), 1.0 / np.sqrt(h))
        p["shared_up_weight"] = normal((h, s), 1.0 / np.sqrt(h))
        p["shared_down_weight"] = normal((s, h), 1.0 / np.sqrt(s))
        p["shared_expert_gate_weight"] = normal((h, 1), 1.0 / np.sqrt(h))
    return p


class _Layer:
    """Writes one layer into a :class:`GraphText`."""

    def __init__(self, spec: LayerSpec) -> None:
        self.spec = spec
        self.g = GraphText(spec.name)
        self.p = draw_params(spec)
        self.topk_indices = ""

    # -- weights ---------------------------------------------------------------------------
    def expert_weight(self, name: str) -> str:
        """Return the value holding float expert weights ``[E, K, N]`` (maybe via DQ)."""
        g, spec = self.g, self.spec
        w = self.p[name]
        if spec.weights_as_inputs:
            return g.add_input(f"float[{','.join(str(d) for d in w.shape)}]", name)
        if spec.weights == "f32":
            return g.add_initializer(name, w)
        k = w.shape[1]
        if spec.weights in ("int4b32", "int4b128"):
            block = 32 if spec.weights == "int4b32" else 128
            codes, scale = quantize_int4_blocked(w, block)
            q = g.add_initializer(f"{name}_quant", codes)
            s = g.add_initializer(f"{name}_scale", scale)
            return g.node("DequantizeLinear", [q, s], name, axis=1, block_size=block)
        if spec.weights == "u8pc":
            codes, scale, zp = quantize_uint8_channel(w)
        elif spec.weights == "u8asym":
            codes, scale, zp = quantize_uint8_asymmetric(w)
        else:  # pragma: no cover - Literal exhausted
            raise ValueError(spec.weights)
        q = g.add_initializer(f"{name}_quant", codes)
        s = g.add_initializer(f"{name}_scale", scale)
        z = g.add_initializer(f"{name}_zero_point", zp)
        return g.node("DequantizeLinear", [q, s, z], name, axis=1, block_size=k)

    # -- expert projections ----------------------------------------------------------------
    def fc(self, tag: str, x: str, per_slot: bool, w: str, b: str | None, k_in: int, n: int) -> str:
        """Project with the selected experts' weights; returns ``[M, k, n]``.

        ``x`` is ``[M, k_in]`` (every slot sees the token) or ``[M, k, k_in]`` (``per_slot``).
        """
        g, spec, idx = self.g, self.spec, self.topk_indices
        k = spec.top_k
        if spec.spelling == "gmm":
            bias = [b] if b else []
            if not per_slot:
                return g.node("GroupedMatMul", [x, w, idx, *bias], f"{tag}_out")
            rows = g.node("Reshape", [x, g.i64(-1, k_in)], f"{tag}_rows")
            row_idx = g.node("Reshape", [idx, g.i64(-1, 1)], f"{tag}_row_indices")
            out = g.node("GroupedMatMul", [rows, w, row_idx, *bias], f"{tag}_grouped")
            return g.node("Reshape", [out, g.i64(-1, k, n)], f"{tag}_out")
        selected = g.node("Gather", [w, idx], f"{tag}_selected_weight", axis=0)  # [M,k,K,N]
        if per_slot:
            lhs = g.node("Unsqueeze", [x, g.i64(2)], f"{tag}_lhs")  # [M,k,1,K]
        else:
            xu = g.node("Unsqueeze", [x, g.i64(1, 2)], f"{tag}_tokens")  # [M,1,1,K]
            lhs = g.node("Expand", [xu, g.i64(1, k, 1, 1)], f"{tag}_lhs")  # [M,k,1,K]
        mm = g.node("MatMul", [lhs, selected], f"{tag}_matmul")  # [M,k,1,N]
        if spec.squeeze_by_reshape:
            out = g.node("Reshape", [mm, g.i64(0, 0, n)], f"{tag}_proj")
        else:
            out = g.node("Squeeze", [mm, g.i64(2)], f"{tag}_proj")
        if b:
            bsel = g.node("Gather", [b, idx], f"{tag}_selected_bias", axis=0)  # [M,k,N]
            out = g.node("Add", [out, bsel], f"{tag}_out")
        return out

    # -- pieces ----------------------------------------------------------------------------
    def routing(self, logits: str) -> str:
        """Write the routing; sets ``self.topk_indices`` and returns the k weights ``[M, k]``."""
        g, spec = self.g, self.spec
        k = g.i64(spec.top_k)
        last = g.i64(-1)
        topk = dict(axis=-1, largest=1, sorted=1)
        if spec.routing == "topk_softmax":
            vals, idx = g.node_multi("TopK", [logits, k], ["topk_logits", "topk_indices"], **topk)
            self.topk_indices = idx
            return g.node("Softmax", [vals], "routing_weights", axis=-1)
        if spec.routing == "sigmoid_topk_renorm":
            probs = g.node("Sigmoid", [logits], "router_scores")
        else:
            probs = g.node("Softmax", [logits], "router_probs", axis=-1)
        vals, idx = g.node_multi("TopK", [probs, k], ["topk_probs", "topk_indices"], **topk)
        self.topk_indices = idx
        if spec.routing == "softmax_topk":
            return vals
        total = g.node("ReduceSum", [vals, last], "topk_sum", keepdims=1)
        return g.node("Div", [vals, total], "routing_weights")

    def experts(self, tokens: str) -> str:
        """Write FC1, activation and FC2; returns the per-slot expert outputs ``[M, k, H]``."""
        g, spec = self.g, self.spec
        h, i = spec.hidden, spec.inter
        b1 = g.add_initializer("fc1_bias", self.p["fc1_bias"]) if spec.expert_bias else None
        b2 = g.add_initializer("fc2_bias", self.p["fc2_bias"]) if spec.expert_bias else None
        if spec.activation == "swiglu":
            wg = self.expert_weight("fc1_gate_weight")
            wu = self.expert_weight("fc1_up_weight")
            gate = self.fc("fc1_gate", tokens, False, wg, None, h, i)
            up = self.fc("fc1_up", tokens, False, wu, None, h, i)
            sig = g.node("Sigmoid", [gate], "gate_sigmoid")
            silu = g.node("Mul", [gate, sig], "gate_silu")
            act = g.node("Mul", [silu, up], "swiglu")
        else:
            w1 = self.expert_weight("fc1_weight")
            fc1 = self.fc("fc1", tokens, False, w1, b1, h, spec.fc1_width)
            if spec.activation == "swiglu_oss":
                act = self.swiglu_oss(fc1)
            elif spec.activation == "gelu_tanh":
                act = g.node("Gelu", [fc1], "gelu", approximate="tanh")
            else:
                scaled = g.node("Div", [fc1, g.f32(1.4142135623730951)], "gelu_scaled")
                erf = g.node("Erf", [scaled], "gelu_erf")
                one_plus = g.node("Add", [erf, g.f32(1.0)], "gelu_one_plus")
                half = g.node("Mul", [fc1, g.f32(0.5)], "gelu_half")
                act = g.node("Mul", [half, one_plus], "gelu")
        w2 = self.expert_weight("fc2_weight")
        return self.fc("fc2", act, True, w2, b2, i, h)

    def swiglu_oss(self, fc1: str) -> str:
        """gpt-oss SwiGLU: even columns gate, odd columns up, clamp 7, alpha 1.702, beta 1."""
        g = self.g
        end, last, step = g.i64(_INT64_MAX), g.i64(-1), g.i64(2)
        gate = g.node("Slice", [fc1, g.i64(0), end, last, step], "gate")
        up = g.node("Slice", [fc1, g.i64(1), end, last, step], "up")
        limit = g.f32(7.0)
        gate_c = g.node("Clip", [gate, "", limit], "gate_clamped")
        up_c = g.node("Clip", [up, g.f32(-7.0), limit], "up_clamped")
        scaled = g.node("Mul", [gate_c, g.f32(1.702)], "gate_scaled")
        sig = g.node("Sigmoid", [scaled], "gate_sigmoid")
        glu = g.node("Mul", [gate_c, sig], "glu")
        up1 = g.node("Add", [up_c, g.f32(1.0)], "up_plus_one")
        return g.node("Mul", [up1, glu], "swiglu")

    def shared_expert(self, tokens: str) -> str:
        """Qwen2-MoE shared expert: SwiGLU MLP scaled by a sigmoid gate; returns ``[M, H]``."""
        g = self.g
        wg = g.add_initializer("shared_gate_weight", self.p["shared_gate_weight"])
        wu = g.add_initializer("shared_up_weight", self.p["shared_up_weight"])
        wd = g.add_initializer("shared_down_weight", self.p["shared_down_weight"])
        we = g.add_initializer("shared_expert_gate_weight", self.p["shared_expert_gate_weight"])
        gate = g.node("MatMul", [tokens, wg], "shared_gate")
        up = g.node("MatMul", [tokens, wu], "shared_up")
        sig = g.node("Sigmoid", [gate], "shared_gate_sigmoid")
        silu = g.node("Mul", [gate, sig], "shared_gate_silu")
        act = g.node("Mul", [silu, up], "shared_swiglu")
        down = g.node("MatMul", [act, wd], "shared_down")
        score = g.node("MatMul", [tokens, we], "shared_expert_score")
        gate_w = g.node("Sigmoid", [score], "shared_expert_weight")
        return g.node("Mul", [down, gate_w], "shared_out")

    # -- whole layer -----------------------------------------------------------------------
    def build(self) -> onnx.ModelProto:
        g, spec = self.g, self.spec
        h = spec.hidden
        dims = ",".join(spec.token_dims)
        x = g.add_input(f"float[{dims},{h}]", "x")
        tokens = x if spec.rank == 2 else g.node("Reshape", [x, g.i64(-1, h)], "tokens")
        wr = g.add_initializer("router_weight", self.p["router_weight"])
        logits = g.node("MatMul", [tokens, wr], "router_logits")
        if spec.router_bias:
            br = g.add_initializer("router_bias", self.p["router_bias"])
            logits = g.node("Add", [logits, br], "router_logits_biased")
        weights = self.routing(logits)
        per_slot = self.experts(tokens)
        w3 = g.node("Unsqueeze", [weights, g.i64(-1)], "routing_weights_3d")
        weighted = g.node("Mul", [per_slot, w3], "weighted_expert_out")
        last = "y" if spec.rank == 2 else "layer_out"
        moe_name = "moe_out" if spec.shared_inter else last
        moe = g.node("ReduceSum", [weighted, g.i64(1)], moe_name, keepdims=0)
        if spec.shared_inter:
            g.node("Add", [moe, self.shared_expert(tokens)], last)
        if spec.rank == 3:
            shape = g.node("Shape", [x], "x_shape")
            g.node("Reshape", [last, shape], "y")
        g.add_output(f"float[{dims},{h}]", "y")
        return g.to_model(spec.opset, IR_VERSION)


def build_layer(spec: LayerSpec) -> onnx.ModelProto:
    """Build the ONNX model of one sample layer."""
    return _Layer(spec).build()
