"""Hand-written MoE layers whose activation or router softmax is written out in elementary ops.

Part of the "meaning" set (:mod:`onnx_moe_fuse.samples.handwritten_meaning`, issue 18): the
experts, selection and combine are the ordinary per-slot decomposition the fuser already knows;
only the piece under test is spelled by hand:

* :func:`silu_by_hand`: SiLU as ``h / (1 + Exp(-h))`` (no Sigmoid op);
* :func:`swiglu_by_hand`: SwiGLU with that SiLU, ``gate / (1 + Exp(-gate)) * up``;
* :func:`gelu_erf_by_hand`: exact GELU ``0.5 * h * (1 + Erf(h / sqrt 2))``: ORT's MoE ``gelu`` is
  the tanh approximation, so a correct fuser refuses it (part ``activation``);
* :func:`gelu_tanh_by_hand`: the tanh GELU ``0.5 h (1 + Tanh(sqrt(2/pi) (h + 0.044715 h^3)))``
  written with Pow, Mul, Add, Tanh;
* :func:`softmax_by_hand`: the router's softmax as ``Exp(z - ReduceMax(z)) / ReduceSum(...)``, or
  without the max subtraction;

and their traps, which compute something else and must be refused with the part named:
:func:`trap_silu_off` (``h / (1 + Exp(-1.01 h))``) and :func:`trap_softmax_token_axis` (the
softmax normalised over the tokens instead of the experts).
"""

from __future__ import annotations

import math

import numpy as np

from onnx_moe_fuse.samples.handwritten_graph import (
    Fused,
    Graph,
    HandwrittenLayer,
    Refused,
    normal,
)

__all__ = [
    "silu_by_hand",
    "swiglu_by_hand",
    "gelu_erf_by_hand",
    "gelu_tanh_by_hand",
    "softmax_by_hand",
    "trap_silu_off",
    "trap_softmax_token_axis",
]

F32 = np.float32


def moe_attrs(k: int, activation: str, normalize: int = 1, **extra: object) -> dict[str, object]:
    """The key attributes of the MoE/QMoE node a correct fuser emits for these layers."""
    attrs: dict[str, object] = {
        "k": k,
        "activation_type": activation,
        "normalize_routing_weights": normalize,
        "use_sparse_mixer": 0,
        "swiglu_fusion": 1 if activation == "swiglu" else 0,
    }
    attrs.update(extra)
    return attrs


def _slot_matmul(g: Graph, lhs4: str, w: str, ids: str, p: str) -> str:
    """``[T, k, 1, K] @ W[ids] [T, k, K, N]`` squeezed to ``[T, k, N]``."""
    sel = g.op("Gather", [w, ids], f"{p}.w_selected", axis=0)
    mm = g.op("MatMul", [lhs4, sel], f"{p}.mm")
    return g.op("Squeeze", [mm, g.init(f"{p}.squeeze_axes", [2])], f"{p}.out")


def _experts(g: Graph, x: str, ids: str, k: int, weights: dict[str, str], act) -> str:
    """Per-slot experts: FC1 (and FC3) on the repeated tokens, ``act``, FC2; ``[T, k, H]``.

    ``act(g, fc1)`` or ``act(g, fc1, fc3)`` builds the activation under test.
    """
    x4 = g.op("Unsqueeze", [x, g.init("tok_axes", [1, 2])], "tok_t11h")
    x4 = g.op("Expand", [x4, g.init("tok_repeat", [1, k, 1, 1])], "tok_tk1h")
    h1 = _slot_matmul(g, x4, weights["fc1"], ids, "fc1")
    if "fc3" in weights:
        a = act(g, h1, _slot_matmul(g, x4, weights["fc3"], ids, "fc3"))
    else:
        a = act(g, h1)
    a4 = g.op("Unsqueeze", [a, g.init("act_axis", [2])], "act_tk1i")
    return _slot_matmul(g, a4, weights["fc2"], ids, "fc2")


def _route(g: Graph, probs: str, k: int) -> tuple[str, str]:
    vals, ids = g.op_multi("TopK", [probs, g.init("top_k", [k])], ["top_p", "top_ids"], axis=-1)
    total = g.op("ReduceSum", [vals, g.init("sum_last", [-1])], "top_sum", keepdims=1)
    return g.op("Div", [vals, total], "route_w"), ids


def _combine(g: Graph, per_slot: str, weights: str, out: str) -> str:
    w3 = g.op("Unsqueeze", [weights, g.init("w_axis", [2])], "route_w3")
    prod = g.op("Mul", [per_slot, w3], "weighted_slots")
    return g.op("ReduceSum", [prod, g.init("slot_axis", [1])], out, keepdims=0)


def _layer(name: str, act, gated: bool, dims, seed: int, softmax=None) -> Graph:
    """The shared skeleton: router (Softmax op unless ``softmax`` spells it), experts, combine."""
    rng = np.random.default_rng(seed)
    h, i, e, k = dims
    g = Graph(name)
    x = g.input("x", ["T", h])
    logits = g.op("MatMul", [x, g.init("router.weight", normal(rng, (h, e), h))], "logits")
    probs = softmax(g, logits) if softmax else g.op("Softmax", [logits], "probs", axis=-1)
    weights, ids = _route(g, probs, k)
    w = {"fc1": g.init("experts.fc1", normal(rng, (e, h, i), h))}
    if gated:
        w["fc3"] = g.init("experts.fc3", normal(rng, (e, h, i), h))
    w["fc2"] = g.init("experts.fc2", normal(rng, (e, i, h), i))
    _combine(g, _experts(g, x, ids, k, w, act), weights, "y")
    g.output("y", ["T", h])
    return g


def _silu(g: Graph, v: str, p: str, beta: float = 1.0) -> str:
    """``v / (1 + Exp(-beta * v))``: the logistic written out, one Constant per engineer habit."""
    neg = g.op("Neg", [v], f"{p}_neg")
    if beta != 1.0:
        neg = g.op("Mul", [neg, g.const(f"{p}_beta", np.array(beta, F32))], f"{p}_neg_scaled")
    ex = g.op("Exp", [neg], f"{p}_exp")
    den = g.op("Add", [g.const(f"{p}_one", np.array(1.0, F32)), ex], f"{p}_den")
    return g.op("Div", [v, den], f"{p}_silu")


# -- activations --------------------------------------------------------------------------------


def silu_by_hand(seed: int = 180) -> HandwrittenLayer:
    """Element-wise SiLU experts, SiLU as ``h / (1 + Exp(-h))``."""
    dims = (32, 48, 6, 2)
    g = _layer("silu_by_hand", lambda g, h: _silu(g, h, "act"), False, dims, seed)
    return HandwrittenLayer(
        g.model(21),
        "element-wise SiLU experts, SiLU written as h / (1 + Exp(-h))",
        Fused("MoE", moe_attrs(dims[3], "silu")),
    )


def swiglu_by_hand(seed: int = 181) -> HandwrittenLayer:
    """SwiGLU with separate gate (FC1) and up (FC3): ``gate / (1 + Exp(-gate)) * up``."""
    dims = (32, 40, 5, 3)

    def act(g: Graph, gate: str, up: str) -> str:
        return g.op("Mul", [_silu(g, gate, "gate"), up], "glu")

    g = _layer("swiglu_by_hand", act, True, dims, seed)
    return HandwrittenLayer(
        g.model(21),
        "SwiGLU with separate gate and up, SiLU written as gate / (1 + Exp(-gate))",
        Fused("MoE", moe_attrs(dims[3], "swiglu")),
    )


def gelu_erf_by_hand(seed: int = 182) -> HandwrittenLayer:
    """Exact GELU ``0.5 * h * (1 + Erf(h / sqrt 2))``: not the tanh GELU ORT's MoE computes."""
    dims = (48, 32, 4, 2)

    def act(g: Graph, h: str) -> str:
        scaled = g.op("Div", [h, g.const("sqrt2", np.array(math.sqrt(2.0), F32))], "h_sqrt2")
        erf = g.op("Erf", [scaled], "h_erf")
        one_plus = g.op("Add", [erf, g.const("one", np.array(1.0, F32))], "erf_plus_one")
        half_h = g.op("Mul", [h, g.const("half", np.array(0.5, F32))], "half_h")
        return g.op("Mul", [half_h, one_plus], "gelu")

    g = _layer("gelu_erf", act, False, dims, seed)
    return HandwrittenLayer(
        g.model(21),
        "exact GELU written by hand: 0.5 * h * (1 + Erf(h / sqrt 2))",
        Refused("activation", "exact gelu"),
    )


def gelu_tanh_by_hand(seed: int = 183) -> HandwrittenLayer:
    """tanh GELU ``0.5 h (1 + Tanh(sqrt(2/pi) (h + 0.044715 h^3)))`` with Pow, Mul, Add, Tanh."""
    dims = (32, 64, 6, 2)

    def act(g: Graph, h: str) -> str:
        cube = g.op("Pow", [h, g.init("three", np.array(3.0, F32))], "h_cubed")
        inner = g.op("Mul", [cube, g.init("gelu_coeff", np.array(0.044715, F32))], "h3_scaled")
        inner = g.op("Add", [h, inner], "gelu_inner")
        c = np.array(math.sqrt(2.0 / math.pi), F32)
        th = g.op("Tanh", [g.op("Mul", [g.init("sqrt_2_over_pi", c), inner], "tanh_arg")], "th")
        one_plus = g.op("Add", [g.init("one_f", np.array(1.0, F32)), th], "one_plus_tanh")
        half = g.op("Mul", [g.init("half_f", np.array(0.5, F32)), h], "h_half")
        return g.op("Mul", [half, one_plus], "gelu_tanh")

    g = _layer("gelu_tanh", act, False, dims, seed)
    return HandwrittenLayer(
        g.model(21),
        "tanh GELU written by hand: 0.5 h (1 + Tanh(sqrt(2/pi) (h + 0.044715 h^3)))",
        Fused("MoE", moe_attrs(dims[3], "gelu")),
    )


def trap_silu_off(seed: int = 184) -> HandwrittenLayer:
    """Trap: ``h / (1 + Exp(-1.01 h))``, a SiLU-like activation off by a constant."""
    dims = (32, 48, 6, 2)
    g = _layer("silu_off", lambda g, h: _silu(g, h, "act", beta=1.01), False, dims, seed)
    return HandwrittenLayer(
        g.model(21),
        "trap: h / (1 + Exp(-1.01 h)), not SiLU (beta 1.01)",
        Refused("activation", "activation"),
    )


# -- the router's softmax -----------------------------------------------------------------------


def _softmax(max_subtracted: bool, axis: int):
    def build(g: Graph, z: str) -> str:
        axes = g.const("sm_axes", [axis])
        if max_subtracted:
            top = g.op("ReduceMax", [z, axes], "logits_max", keepdims=1)
            z = g.op("Sub", [z, top], "logits_shifted")
        ez = g.op("Exp", [z], "logits_exp")
        total = g.op("ReduceSum", [ez, axes], "exp_sum", keepdims=1)
        return g.op("Div", [ez, total], "router_probs")

    return build


def _swiglu(g: Graph, gate: str, up: str) -> str:
    sig = g.op("Sigmoid", [gate], "gate_sig")
    return g.op("Mul", [g.op("Mul", [gate, sig], "gate_silu"), up], "glu")


def softmax_by_hand(max_subtracted: bool = True, seed: int = 185) -> HandwrittenLayer:
    """Router softmax ``Exp(z - ReduceMax(z)) / ReduceSum(Exp(...))`` (or without the max)."""
    dims = (32, 32, 8, 2)
    g = _layer("softmax_by_hand", _swiglu, True, dims, seed, softmax=_softmax(max_subtracted, -1))
    form = "Exp(z - ReduceMax(z)) / ReduceSum" if max_subtracted else "Exp(z) / ReduceSum(Exp(z))"
    return HandwrittenLayer(
        g.model(21),
        f"router softmax written by hand as {form}, top-2 renormalised, SwiGLU experts",
        Fused("MoE", moe_attrs(dims[3], "swiglu")),
    )


def trap_softmax_token_axis(seed: int = 186) -> HandwrittenLayer:
    """Trap: the hand-written softmax normalised over the tokens (axis 0), not the experts."""
    dims = (32, 32, 8, 2)
    g = _layer("softmax_tokens", _swiglu, True, dims, seed, softmax=_softmax(True, 0))
    return HandwrittenLayer(
        g.model(21),
        "trap: router softmax written by hand over the token axis (axis 0)",
        Refused("routing", "token axis"),
    )
