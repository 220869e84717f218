"""Hand-written sparse MoE layers: top-k experts per token, weights gathered per slot.

Layers 1 to 8 of the hand-written catalogue (:mod:`onnx_moe_fuse.samples.handwritten`): the
GroupedMatMul function body inlined, Swish activations, Einsum experts, output-major weights with
an in-graph Transpose, explicit DequantizeLinear zero points, static-shape Reshapes, a Reciprocal
renormalisation and batched-MatMul combines. Each is written the way a different engineer would:
names, node order, initializers vs ``Constant`` nodes and dim_param vs static dims vary.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from onnx_moe_fuse.samples.handwritten_graph import (
    Fused,
    Graph,
    HandwrittenLayer,
    normal,
    quantize_blocked,
)

__all__ = [
    "grouped_matmul_body",
    "swish_silu",
    "swish_swiglu",
    "einsum_experts",
    "output_major_transpose",
    "dq_zero_points",
    "static_shapes",
    "reciprocal_renorm",
    "batched_matmul_combine",
]

Const = Callable[[str, object], str]


def _moe(k: int, activation: str, normalize: int = 1, **extra: object) -> dict[str, object]:
    attrs: dict[str, object] = {
        "k": k,
        "activation_type": activation,
        "normalize_routing_weights": normalize,
        "use_sparse_mixer": 0,
        "swiglu_fusion": 1 if activation == "swiglu" else 0,
    }
    attrs.update(extra)
    return attrs


def _softmax_topk_renorm(g: Graph, c: Const, logits: str, k: int, p: str) -> tuple[str, str]:
    """Softmax over experts, top-k, divide by the sum of the k values; ``(weights, ids)``."""
    probs = g.op("Softmax", [logits], f"{p}probs", axis=-1)
    vals, ids = g.op_multi("TopK", [probs, c(f"{p}k", [k])], [f"{p}topk_vals", f"{p}topk_ids"])
    total = g.op("ReduceSum", [vals, c(f"{p}sum_axes", [-1])], f"{p}topk_sum", keepdims=1)
    return g.op("Div", [vals, total], f"{p}weights"), ids


def _project(g: Graph, c: Const, tokens: str, w: str, ids: str, k: int, n: int, p: str) -> str:
    """Every slot's token times its expert's ``[K, N]`` weight: ``[T, k, N]`` (decomposition)."""
    sel = g.op("Gather", [w, ids], f"{p}_w_sel", axis=0)
    lhs = g.op("Unsqueeze", [tokens, c(f"{p}_ax12", [1, 2])], f"{p}_x4")
    lhs = g.op("Expand", [lhs, c(f"{p}_bcast", [1, k, 1, 1])], f"{p}_x_slots")
    mm = g.op("MatMul", [lhs, sel], f"{p}_mm")
    return g.op("Squeeze", [mm, c(f"{p}_ax2", [2])], f"{p}_out")


def _project_slots(g: Graph, c: Const, act: str, w: str, ids: str, p: str) -> str:
    """Each slot's own activation times its expert's weight: ``[T, k, N]`` (decomposition)."""
    sel = g.op("Gather", [w, ids], f"{p}_w_sel", axis=0)
    lhs = g.op("Unsqueeze", [act, c(f"{p}_ax2u", [2])], f"{p}_a4")
    mm = g.op("MatMul", [lhs, sel], f"{p}_mm")
    return g.op("Squeeze", [mm, c(f"{p}_ax2", [2])], f"{p}_out")


def _combine(g: Graph, c: Const, per_slot: str, weights: str, out: str) -> str:
    w3 = g.op("Unsqueeze", [weights, c("combine_ax", [-1])], "weights_3d")
    weighted = g.op("Mul", [per_slot, w3], "weighted")
    return g.op("ReduceSum", [weighted, c("slot_axis", [1])], out, keepdims=0)


def _swiglu(g: Graph, gate: str, up: str, p: str = "") -> str:
    sig = g.op("Sigmoid", [gate], f"{p}gate_sigmoid")
    silu = g.op("Mul", [gate, sig], f"{p}gate_silu")
    return g.op("Mul", [silu, up], f"{p}swiglu")


# -- 1. GroupedMatMul's function body, inlined -------------------------------------------------


def _gmm_body(g: Graph, x: str, w: str, idx: str, p: str) -> str:
    """GroupedMatMul(x [M, K], w [G, K, N], idx [M, S]) -> [M, S, N], as its body spells it."""
    sel = g.op("Gather", [w, idx], f"{p}__selected_weights", axis=0)  # [M, S, K, N]
    x4 = g.op("Unsqueeze", [x, g.const(f"{p}__axes_1_2", [1, 2])], f"{p}__x_unsq")
    m = g.op("Shape", [x], f"{p}__m", start=0, end=1)
    s = g.op("Shape", [idx], f"{p}__s", start=1, end=2)
    kdim = g.op("Shape", [x], f"{p}__kdim", start=1, end=2)
    one = g.const(f"{p}__one", [1])
    shape = g.op("Concat", [m, s, one, kdim], f"{p}__expand_shape", axis=0)
    xe = g.op("Expand", [x4, shape], f"{p}__x_expanded")  # [M, S, 1, K]
    mm = g.op("MatMul", [xe, sel], f"{p}__product")  # [M, S, 1, N]
    return g.op("Squeeze", [mm, g.const(f"{p}__axis_2", [2])], f"{p}__output")


def grouped_matmul_body(seed: int = 1) -> HandwrittenLayer:
    """Mixtral-style SwiGLU experts, each projection the inlined GroupedMatMul body."""
    rng = np.random.default_rng(seed)
    h, i, e, k = 64, 48, 8, 2
    g = Graph("gmm_inlined")
    x = g.input("x", ["M", h])
    logits = g.op("MatMul", [x, g.init("gate.weight", normal(rng, (h, e), h))], "router_logits")
    weights, idx = _softmax_topk_renorm(g, g.init, logits, k, "route_")
    wg = g.init("experts.w1", normal(rng, (e, h, i), h))
    wu = g.init("experts.w3", normal(rng, (e, h, i), h))
    wd = g.init("experts.w2", normal(rng, (e, i, h), i))
    gate = _gmm_body(g, x, wg, idx, "GroupedMatMul_0")
    up = _gmm_body(g, x, wu, idx, "GroupedMatMul_1")
    act = _swiglu(g, gate, up)
    rows = g.op("Reshape", [act, g.init("rows_shape", [-1, i])], "act_rows")
    row_ids = g.op("Reshape", [idx, g.init("row_ids_shape", [-1, 1])], "row_ids")
    down = _gmm_body(g, rows, wd, row_ids, "GroupedMatMul_2")  # [M*k, 1, H]
    per_slot = g.op("Reshape", [down, g.init("slots_shape", [-1, k, h])], "down_slots")
    _combine(g, g.init, per_slot, weights, "y")
    g.output("y", ["M", h])
    return HandwrittenLayer(
        g.model(21),
        "SwiGLU experts written as GroupedMatMul's inlined function body "
        "(Gather, Unsqueeze, Shape/Concat Expand shape, MatMul, Squeeze)",
        Fused("MoE", _moe(k, "swiglu")),
    )


# -- 2. Swish (opset 24) ----------------------------------------------------------------------


def swish_silu(seed: int = 2) -> HandwrittenLayer:
    """An element-wise SiLU expert MLP, SiLU written as the ``Swish`` op (alpha 1)."""
    rng = np.random.default_rng(seed)
    h, i, e, k = 32, 64, 6, 2
    g = Graph("swish_mlp")
    x = g.input("hidden", ["tokens", h])
    w1 = g.init("fc1", normal(rng, (e, h, i), h))
    w2 = g.init("fc2", normal(rng, (e, i, h), i))
    logits = g.op("MatMul", [x, g.init("router", normal(rng, (h, e), h))], "scores")
    weights, idx = _softmax_topk_renorm(g, g.const, logits, k, "")
    h1 = _project(g, g.const, x, w1, idx, k, i, "fc1")
    act = g.op("Swish", [h1], "silu", alpha=1.0)
    out = _project_slots(g, g.const, act, w2, idx, "fc2")
    _combine(g, g.const, out, weights, "out")
    g.output("out", ["tokens", h])
    return HandwrittenLayer(
        g.model(24),
        "element-wise SiLU experts, SiLU as Swish(alpha=1) (opset 24)",
        Fused("MoE", _moe(k, "silu")),
    )


def swish_swiglu(seed: int = 3) -> HandwrittenLayer:
    """SwiGLU as ``Mul(Swish(gate), up)`` with separate gate and up experts."""
    rng = np.random.default_rng(seed)
    h, i, e, k = 32, 40, 5, 3
    g = Graph("swish_swiglu")
    x = g.input("x", ["T", h])
    logits = g.op("MatMul", [x, g.init("router_w", normal(rng, (h, e), h))], "logits")
    weights, idx = _softmax_topk_renorm(g, g.init, logits, k, "r_")
    gate = _project(g, g.init, x, g.init("gate_proj", normal(rng, (e, h, i), h)), idx, k, i, "g")
    up = _project(g, g.init, x, g.init("up_proj", normal(rng, (e, h, i), h)), idx, k, i, "u")
    act = g.op("Mul", [g.op("Swish", [gate], "gate_swish", alpha=1.0), up], "glu")
    out = _project_slots(g, g.init, act, g.init("down_proj", normal(rng, (e, i, h), i)), idx, "d")
    _combine(g, g.init, out, weights, "y")
    g.output("y", ["T", h])
    return HandwrittenLayer(
        g.model(24), "SwiGLU as Swish(gate) * up (opset 24)", Fused("MoE", _moe(k, "swiglu"))
    )


# -- 3. Einsum experts ----------------------------------------------------------------------


def einsum_experts(seed: int = 4) -> HandwrittenLayer:
    """Expert GEMMs as ``Einsum("tkh,tkhi->tki")`` on gathered weights; Einsum combine too."""
    rng = np.random.default_rng(seed)
    h, i, e, k = 48, 32, 8, 2
    g = Graph("einsum_moe")
    x = g.input("x", ["T", h])
    logits = g.op("MatMul", [x, g.init("wr", normal(rng, (h, e), h))], "router_logits")
    weights, idx = _softmax_topk_renorm(g, g.const, logits, k, "")
    slots = g.op("Unsqueeze", [x, g.const("one_axis", [1])], "x_t1h")
    slots = g.op("Expand", [slots, g.const("tkh_shape", [1, k, 1])], "x_tkh")
    wg = g.op("Gather", [g.init("w_gate", normal(rng, (e, h, i), h)), idx], "wg_tkhi", axis=0)
    wu = g.op("Gather", [g.init("w_up", normal(rng, (e, h, i), h)), idx], "wu_tkhi", axis=0)
    gate = g.op("Einsum", [slots, wg], "gate_tki", equation="tkh,tkhi->tki")
    up = g.op("Einsum", [slots, wu], "up_tki", equation="tkh,tkhi->tki")
    act = _swiglu(g, gate, up)
    wd = g.op("Gather", [g.init("w_down", normal(rng, (e, i, h), i)), idx], "wd_tkih", axis=0)
    down = g.op("Einsum", [act, wd], "down_tkh", equation="tki,tkih->tkh")
    g.op("Einsum", [weights, down], "y", equation="tk,tkh->th")
    g.output("y", ["T", h])
    return HandwrittenLayer(
        g.model(21),
        "SwiGLU experts as Einsum tkh,tkhi->tki on Gathered weights, combined by Einsum tk,tkh->th",
        Fused("MoE", _moe(k, "swiglu")),
    )


# -- 4. output-major weights ------------------------------------------------------------------


def output_major_transpose(seed: int = 5) -> HandwrittenLayer:
    """Weights stored ``[E, N, K]`` (PyTorch Linear layout), ``Transpose(0, 2, 1)`` in-graph."""
    rng = np.random.default_rng(seed)
    h, i, e, k = 64, 32, 4, 2
    g = Graph("linear_layout")
    x = g.input("x", ["batch_tokens", h])
    wg = g.init("experts.gate_proj.weight", normal(rng, (e, i, h), h))
    wu = g.init("experts.up_proj.weight", normal(rng, (e, i, h), h))
    wd = g.init("experts.down_proj.weight", normal(rng, (e, h, i), i))
    wg_t = g.op("Transpose", [wg], "gate_kn", perm=[0, 2, 1])
    wu_t = g.op("Transpose", [wu], "up_kn", perm=[0, 2, 1])
    wd_t = g.op("Transpose", [wd], "down_kn", perm=[0, 2, 1])
    logits = g.op("MatMul", [x, g.const("router.weight", normal(rng, (h, e), h))], "logits")
    weights, idx = _softmax_topk_renorm(g, g.const, logits, k, "")
    act = _swiglu(
        g,
        _project(g, g.const, x, wg_t, idx, k, i, "gate"),
        _project(g, g.const, x, wu_t, idx, k, i, "up"),
    )
    out = _project_slots(g, g.const, act, wd_t, idx, "down")
    _combine(g, g.const, out, weights, "y")
    g.output("y", ["batch_tokens", h])
    return HandwrittenLayer(
        g.model(21),
        "output-major [E, N, K] expert weights, Transpose(perm=[0,2,1]) before the Gather",
        Fused("MoE", _moe(k, "swiglu")),
    )


# -- 5. explicit DequantizeLinear zero points -------------------------------------------------


def _dq(g: Graph, name: str, w: np.ndarray, kind: str, block: int | None) -> str:
    """``DequantizeLinear(q, scale, zp)`` of ``w [E, K, N]`` along K; ``block=None``: per channel."""
    size = w.shape[1] if block is None else block
    q, scale, zp = quantize_blocked(w, 1, size, kind)
    # the int4 zero point (all 0) comes as a Constant node, the others as initializers
    zero_point = (g.const if kind == "int4" else g.init)(f"{name}.qzeros", zp)
    ins = [g.init(f"{name}.qweight", q), g.init(f"{name}.scales", scale), zero_point]
    return g.op("DequantizeLinear", ins, f"{name}.weight", axis=1, block_size=size)


def dq_zero_points(kind: str, block: int | None, seed: int = 6) -> HandwrittenLayer:
    """SwiGLU experts behind DequantizeLinear with an explicit (symmetric) zero point tensor.

    ``kind``: ``int4`` (zp 0), ``uint4`` (zp 8), ``uint8`` (zp 128); ``block``: 32, or None for
    one scale per expert and output channel (``block_size = K``).
    """
    rng = np.random.default_rng(seed)
    h, i, e, k = 64, 96, 4, 2
    g = Graph(f"dq_{kind}")
    x = g.input("x", ["T", h])
    logits = g.op("MatMul", [x, g.init("router", normal(rng, (h, e), h))], "logits")
    weights, idx = _softmax_topk_renorm(g, g.init, logits, k, "")
    wg = _dq(g, "gate", normal(rng, (e, h, i), h), kind, block)
    wu = _dq(g, "up", normal(rng, (e, h, i), h), kind, block)
    wd = _dq(g, "down", normal(rng, (e, i, h), i), kind, block)
    act = _swiglu(
        g, _project(g, g.init, x, wg, idx, k, i, "g"), _project(g, g.init, x, wu, idx, k, i, "u")
    )
    _combine(g, g.init, _project_slots(g, g.init, act, wd, idx, "d"), weights, "y")
    g.output("y", ["T", h])
    bits = 8 if kind == "uint8" else 4
    zp = {"int4": 0, "uint4": 8, "uint8": 128}[kind]
    # H != I, so per-channel projections have different single blocks: QMoE block_size 0
    block_size = 0 if block is None else block
    granularity = "per channel" if block is None else f"blocked {block}"
    return HandwrittenLayer(
        g.model(21),
        f"{kind} DequantizeLinear weights, explicit zero point {zp}, {granularity}",
        Fused("QMoE", _moe(k, "swiglu", expert_weight_bits=bits, block_size=block_size)),
    )


# -- 6. static shapes ---------------------------------------------------------------------------


def static_shapes(seed: int = 7) -> HandwrittenLayer:
    """``x [2, 8, 64]`` with concrete Reshape targets everywhere (``[16, 2, 64]``...)."""
    rng = np.random.default_rng(seed)
    b, s, h, i, e, k = 2, 8, 64, 32, 8, 2
    t = b * s
    g = Graph("static_moe")
    x = g.input("hidden_states", [b, s, h])
    tokens = g.op("Reshape", [x, g.const("flat_shape", [t, h])], "tokens")
    logits = g.op("MatMul", [tokens, g.init("router", normal(rng, (h, e), h))], "logits")
    weights, idx = _softmax_topk_renorm(g, g.const, logits, k, "")

    def fc1(w: str, p: str) -> str:
        sel = g.op("Gather", [w, idx], f"{p}_sel", axis=0)  # [16, 2, 64, 32]
        x4 = g.op("Unsqueeze", [tokens, g.const(f"{p}_axes", [1, 2])], f"{p}_x4")
        x4 = g.op("Expand", [x4, g.const(f"{p}_expand", [t, k, 1, h])], f"{p}_xe")
        mm = g.op("MatMul", [x4, sel], f"{p}_mm")  # [16, 2, 1, 32]
        return g.op("Reshape", [mm, g.const(f"{p}_drop", [t, k, i])], f"{p}_out")

    act = _swiglu(
        g,
        fc1(g.init("w_gate", normal(rng, (e, h, i), h)), "gate"),
        fc1(g.init("w_up", normal(rng, (e, h, i), h)), "up"),
    )
    sel = g.op("Gather", [g.init("w_down", normal(rng, (e, i, h), i)), idx], "down_sel", axis=0)
    a4 = g.op("Reshape", [act, g.const("act_4d", [t, k, 1, i])], "act_4d_v")
    mm = g.op("MatMul", [a4, sel], "down_mm")
    down = g.op("Reshape", [mm, g.const("down_3d", [t, k, h])], "down_out")
    moe = _combine(g, g.const, down, weights, "moe_flat")
    g.op("Reshape", [moe, g.const("out_shape", [b, s, h])], "y")
    g.output("y", [b, s, h])
    return HandwrittenLayer(
        g.model(21),
        "static shapes everywhere: x [2, 8, 64], Reshapes to [16, 2, 32], [16, 2, 1, 32], "
        "[16, 2, 64]",
        Fused("MoE", _moe(k, "swiglu")),
    )


# -- 7. Reciprocal renormalisation --------------------------------------------------------------


def reciprocal_renorm(seed: int = 8) -> HandwrittenLayer:
    """Routing weights ``Mul(Reciprocal(ReduceSum(v)), v)``; ReLU experts."""
    rng = np.random.default_rng(seed)
    h, i, e, k = 32, 48, 6, 3
    g = Graph("reciprocal")
    x = g.input("x", ["T", h])
    logits = g.op("MatMul", [x, g.init("router", normal(rng, (h, e), h))], "logits")
    probs = g.op("Softmax", [logits], "probs", axis=1)
    vals, idx = g.op_multi("TopK", [probs, g.init("top_k", [k])], ["top_p", "top_i"], axis=1)
    total = g.op("ReduceSum", [vals, g.init("last", [1])], "top_sum", keepdims=1)
    weights = g.op("Mul", [g.op("Reciprocal", [total], "inv_sum"), vals], "top_w")
    h1 = _project(g, g.init, x, g.init("w1", normal(rng, (e, h, i), h)), idx, k, i, "fc1")
    act = g.op("Relu", [h1], "relu")
    out = _project_slots(g, g.init, act, g.init("w2", normal(rng, (e, i, h), i)), idx, "fc2")
    _combine(g, g.init, out, weights, "y")
    g.output("y", ["T", h])
    return HandwrittenLayer(
        g.model(21),
        "ReLU experts, weights renormalised by Mul(Reciprocal(ReduceSum(v)), v)",
        Fused("MoE", _moe(k, "relu")),
    )


# -- 8. batched-MatMul combine --------------------------------------------------------------------


def batched_matmul_combine(drop: str, seed: int = 9) -> HandwrittenLayer:
    """Combine ``MatMul(Unsqueeze(w, 1) [T, 1, k], out [T, k, H])``, then Squeeze or Reshape."""
    rng = np.random.default_rng(seed)
    h, i, e, k = 32, 32, 4, 2
    g = Graph(f"bmm_combine_{drop}")
    x = g.input("x", ["num_tokens", h])
    logits = g.op("MatMul", [x, g.init("router", normal(rng, (h, e), h))], "logits")
    weights, idx = _softmax_topk_renorm(g, g.const, logits, k, "")
    act = _swiglu(
        g,
        _project(g, g.const, x, g.init("wg", normal(rng, (e, h, i), h)), idx, k, i, "g"),
        _project(g, g.const, x, g.init("wu", normal(rng, (e, h, i), h)), idx, k, i, "u"),
    )
    out = _project_slots(g, g.const, act, g.init("wd", normal(rng, (e, i, h), i)), idx, "d")
    row = g.op("Unsqueeze", [weights, g.const("row_axis", [1])], "weights_row")  # [T, 1, k]
    mixed = g.op("MatMul", [row, out], "mixed")  # [T, 1, H]
    if drop == "squeeze":
        g.op("Squeeze", [mixed, g.const("drop_axis", [1])], "y")
    else:
        g.op("Reshape", [mixed, g.const("drop_shape", [-1, h])], "y")
    g.output("y", ["num_tokens", h])
    return HandwrittenLayer(
        g.model(21),
        f"combine by batched MatMul of the [T, 1, k] weights and [T, k, H] outputs, then {drop}",
        Fused("MoE", _moe(k, "swiglu")),
    )
