"""Hand-written MoE layers as users and exporters write whole models: Qwen3 and the dense forms.

Layers 9 and 10 of the hand-written catalogue (:mod:`onnx_moe_fuse.samples.handwritten`):

* :func:`qwen3_int4`: a Qwen3-30B-A3B-style int4 MoE block as a user decomposes it by hand
  (Softmax, TopK, ReduceSum/Div; tokens repeated k times by Unsqueeze/Expand/Reshape; Gather of
  DequantizeLinear weights by the flattened ids; MatMul; Split SwiGLU; Mul + ReduceSum). Sizes are
  parameters: the small default is for tests, :data:`QWEN3_30B_A3B` is the real block for the
  benchmark.
* :func:`dense_onehot`: every expert on every token, as optimum-onnx exports (one broadcast
  MatMul over the stacked weights ``[E, K, N]``), masked by a dense ``[T, E]`` weight matrix made
  from the top-k ids by ``OneHot``.
* :func:`dense_equal_loop`: onnxruntime Mobius's "dense fallback": one MLP per expert on every
  token, its weight ``ReduceSum(Mul(Cast(Equal(ids, e)), w))``, an Add chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from onnx_moe_fuse.samples.handwritten_graph import (
    Fused,
    Graph,
    HandwrittenLayer,
    normal,
    quantize_blocked,
)

__all__ = [
    "Qwen3Sizes",
    "QWEN3_SMALL",
    "QWEN3_30B_A3B",
    "qwen3_int4",
    "dense_onehot",
    "dense_equal_loop",
]


@dataclass(frozen=True)
class Qwen3Sizes:
    """Sizes of one Qwen3-MoE block: hidden, expert inter size, experts, top-k, int4 block."""

    hidden: int
    inter: int
    experts: int
    top_k: int
    block: int = 32


QWEN3_SMALL = Qwen3Sizes(hidden=256, inter=96, experts=16, top_k=4)
#: Qwen3-30B-A3B's MoE block (config.json: hidden_size 2048, moe_intermediate_size 768,
#: num_experts 128, num_experts_per_tok 8); int4 weights in blocks of 32.
QWEN3_30B_A3B = Qwen3Sizes(hidden=2048, inter=768, experts=128, top_k=8)


def _moe_attrs(k: int, **extra: object) -> dict[str, object]:
    attrs: dict[str, object] = {
        "k": k,
        "activation_type": "swiglu",
        "normalize_routing_weights": 1,
        "use_sparse_mixer": 0,
        "swiglu_fusion": 1,
    }
    attrs.update(extra)
    return attrs


def _int4_codes(rng: np.random.Generator, shape: tuple[int, ...], axis: int, block: int):
    """Random int4 codes and blocked scales along ``axis`` (drawn, not quantized: fast at 30B)."""
    codes = rng.integers(-8, 8, size=shape, dtype=np.int8).astype(ml_dtypes.int4)
    scale_shape = list(shape)
    scale_shape[axis] //= block
    fan_in = shape[axis]
    scale = (rng.uniform(0.5, 1.5, size=scale_shape) / (4.5 * np.sqrt(fan_in))).astype(np.float32)
    return codes, scale


def qwen3_int4(sizes: Qwen3Sizes = QWEN3_SMALL, seed: int = 30) -> HandwrittenLayer:
    """Qwen3-MoE block with int4 expert weights, written as a user decomposes it by hand."""
    rng = np.random.default_rng(seed)
    h, i, e, k, blk = sizes.hidden, sizes.inter, sizes.experts, sizes.top_k, sizes.block
    g = Graph("qwen3_moe_block")
    x = g.input("hidden_states", ["batch", "seq", h])
    flat = g.op("Reshape", [x, g.init("hidden_2d", [-1, h])], "hidden_flat")  # [T, H]
    router = g.init("mlp.gate.weight", normal(rng, (h, e), h))
    logits = g.op("MatMul", [flat, router], "router_logits")
    probs = g.op("Softmax", [logits], "routing_probs", axis=-1)
    top_w, top_i = g.op_multi(
        "TopK",
        [probs, g.init("num_experts_per_tok", [k])],
        ["routing_weights_topk", "selected_experts"],
        axis=-1,
        largest=1,
        sorted=1,
    )
    denom = g.op("ReduceSum", [top_w, g.init("reduce_last", [-1])], "routing_denom", keepdims=1)
    route_w = g.op("Div", [top_w, denom], "routing_weights")
    # each token repeated k times: rows r = t*k + j
    rep = g.op("Unsqueeze", [flat, g.init("axis1", [1])], "tokens_t1h")
    rep = g.op("Expand", [rep, g.init("expand_k", [1, k, 1])], "tokens_tkh")
    rows = g.op("Reshape", [rep, g.init("rows_shape", [-1, 1, h])], "token_rows")  # [T*k, 1, H]
    flat_ids = g.op("Reshape", [top_i, g.init("ids_flat", [-1])], "expert_ids_flat")
    gu_q, gu_s = _int4_codes(rng, (e, h, 2 * i), 1, blk)
    dn_q, dn_s = _int4_codes(rng, (e, i, h), 1, blk)
    gate_up = g.op(
        "DequantizeLinear",
        [g.init("experts.gate_up_proj.qweight", gu_q), g.init("experts.gate_up_proj.scales", gu_s)],
        "experts.gate_up_proj",
        axis=1,
        block_size=blk,
    )
    down = g.op(
        "DequantizeLinear",
        [g.init("experts.down_proj.qweight", dn_q), g.init("experts.down_proj.scales", dn_s)],
        "experts.down_proj",
        axis=1,
        block_size=blk,
    )
    w_gu = g.op("Gather", [gate_up, flat_ids], "gate_up_rows_w", axis=0)  # [T*k, H, 2I]
    gu = g.op("MatMul", [rows, w_gu], "gate_up_rows")  # [T*k, 1, 2I]
    gate, up = g.op_multi("Split", [gu, g.init("split_sizes", [i, i])], ["gate", "up"], axis=-1)
    act = g.op(
        "Mul",
        [g.op("Mul", [gate, g.op("Sigmoid", [gate], "gate_sig")], "gate_act"), up],
        "act_rows",
    )
    w_dn = g.op("Gather", [down, flat_ids], "down_rows_w", axis=0)  # [T*k, I, H]
    dn = g.op("MatMul", [act, w_dn], "down_rows")  # [T*k, 1, H]
    slots = g.op("Reshape", [dn, g.init("slots_shape", [-1, k, h])], "expert_out")  # [T, k, H]
    w3 = g.op("Unsqueeze", [route_w, g.init("axis_last", [-1])], "routing_weights_3d")
    weighted = g.op("Mul", [slots, w3], "expert_out_weighted")
    moe = g.op("ReduceSum", [weighted, g.init("slot_axis", [1])], "moe_out", keepdims=0)
    g.op("Reshape", [moe, g.op("Shape", [x], "hidden_shape")], "y")
    g.output("y", ["batch", "seq", h])
    return HandwrittenLayer(
        g.model(21),
        f"Qwen3-MoE int4 block (H {h}, I {i}, E {e}, k {k}, block {blk}) decomposed by hand: "
        "repeated token rows, Gather of DequantizeLinear weights by flat ids, Split SwiGLU",
        Fused("QMoE", _moe_attrs(k, expert_weight_bits=4, block_size=blk)),
    )


def _expert_weights(
    g: Graph, rng: np.random.Generator, name: str, shape: tuple[int, ...], weights: str
) -> str:
    """Stacked ``[E, K, N]`` weights: a float initializer, or int4 blocked-32 DequantizeLinear."""
    w = normal(rng, shape, shape[1])
    if weights == "float":
        return g.init(name, w)
    q, scale, _ = quantize_blocked(w, 1, 32, "int4")
    return g.op(
        "DequantizeLinear",
        [g.init(f"{name}_q", q), g.init(f"{name}_s", scale)],
        name,
        axis=1,
        block_size=32,
    )


def _fused_dense(k: int, weights: str) -> Fused:
    if weights == "float":
        return Fused("MoE", _moe_attrs(k))
    return Fused("QMoE", _moe_attrs(k, expert_weight_bits=4, block_size=32))


def dense_onehot(weights: str = "float", seed: int = 40) -> HandwrittenLayer:
    """All experts on all tokens (broadcast MatMul), masked by OneHot of the top-k ids.

    ``weights``: ``float`` or ``int4`` (blocked 32 DequantizeLinear).
    """
    rng = np.random.default_rng(seed)
    h, i, e, k = 64, 32, 8, 2
    g = Graph(f"dense_onehot_{weights}")
    x = g.input("x", ["T", h])
    logits = g.op("MatMul", [x, g.init("router.weight", normal(rng, (h, e), h))], "router_logits")
    probs = g.op("Softmax", [logits], "probs", axis=1)
    top_p, top_i = g.op_multi("TopK", [probs, g.const("k", [k])], ["top_p", "top_i"], axis=1)
    norm = g.op(
        "Div",
        [top_p, g.op("ReduceSum", [top_p, g.const("ax1", [1])], "top_sum", keepdims=1)],
        "top_w",
    )
    onehot = g.op(
        "OneHot",
        [
            top_i,
            g.const("depth", np.array(e, np.int64)),
            g.const("onoff", np.array([0.0, 1.0], np.float32)),
        ],
        "onehot",
        axis=-1,
    )  # [T, k, E]
    scattered = g.op(
        "Mul", [onehot, g.op("Unsqueeze", [norm, g.const("ax_last", [-1])], "w_tk1")], "w_tke"
    )
    dense_w = g.op("ReduceSum", [scattered, g.const("ax_k", [1])], "dense_weights", keepdims=0)
    wg = _expert_weights(g, rng, "experts.gate", (e, h, i), weights)
    wu = _expert_weights(g, rng, "experts.up", (e, h, i), weights)
    wd = _expert_weights(g, rng, "experts.down", (e, i, h), weights)
    gate = g.op("MatMul", [x, wg], "all_gate")  # [E, T, I]
    up = g.op("MatMul", [x, wu], "all_up")
    act = g.op(
        "Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate], "all_sig")], "all_silu"), up], "all_act"
    )
    down = g.op("MatMul", [act, wd], "all_down")  # [E, T, H]
    w_et1 = g.op(
        "Unsqueeze",
        [g.op("Transpose", [dense_w], "dense_w_et", perm=[1, 0]), g.const("ax2", [2])],
        "dense_w_et1",
    )
    g.op(
        "ReduceSum",
        [g.op("Mul", [down, w_et1], "all_weighted"), g.const("ax_e", [0])],
        "y",
        keepdims=0,
    )
    g.output("y", ["T", h])
    return HandwrittenLayer(
        g.model(21),
        f"dense all-experts form ({weights}; optimum-onnx style): broadcast MatMul over "
        "[E, K, N] weights, dense [T, E] weights from OneHot(top-k ids), Mul, ReduceSum over E",
        _fused_dense(k, weights),
    )


def dense_equal_loop(weights: str = "float", seed: int = 41) -> HandwrittenLayer:
    """Mobius's dense fallback: each expert's MLP on every token, masked by Equal(ids, e).

    ``weights``: ``float`` or ``int4`` (each expert's ``[K, N]`` weight a blocked-32
    DequantizeLinear along K).
    """
    rng = np.random.default_rng(seed)
    h, i, e, k = 64, 32, 4, 2
    g = Graph(f"dense_loop_{weights}")
    x = g.input("input", ["sequence_length", h])
    logits = g.op("MatMul", [x, g.init("gate_w", normal(rng, (h, e), h))], "gate_logits")
    probs = g.op("Softmax", [logits], "gate_probs", axis=-1)
    top_p, top_i = g.op_multi(
        "TopK", [probs, g.init("topk_k", [k])], ["topk_p", "topk_ids"], axis=-1
    )
    total = g.op("ReduceSum", [top_p, g.init("sum_ax", [-1])], "topk_total", keepdims=1)
    route_w = g.op("Div", [top_p, total], "topk_w")

    def weight(name: str, shape: tuple[int, int]) -> str:
        w = normal(rng, shape, shape[0])
        if weights == "float":
            return g.init(name, w)
        q, scale, _ = quantize_blocked(w, 0, 32, "int4")
        return g.op(
            "DequantizeLinear",
            [g.init(f"{name}.q", q), g.init(f"{name}.s", scale)],
            f"{name}.dq",
            axis=0,
            block_size=32,
        )

    acc = ""
    for ex in range(e):
        p = f"expert{ex}"
        gate = g.op("MatMul", [x, weight(f"{p}.gate", (h, i))], f"{p}_gate")
        up = g.op("MatMul", [x, weight(f"{p}.up", (h, i))], f"{p}_up")
        silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}_sig")], f"{p}_silu")
        down = g.op(
            "MatMul",
            [g.op("Mul", [silu, up], f"{p}_act"), weight(f"{p}.down", (i, h))],
            f"{p}_down",
        )
        hit = g.op("Equal", [top_i, g.init(f"{p}_id", np.array(ex, np.int64))], f"{p}_hit")
        mask = g.op("Cast", [hit], f"{p}_mask", to=1)
        w_e = g.op(
            "ReduceSum",
            [g.op("Mul", [mask, route_w], f"{p}_masked_w"), g.init(f"{p}_k_ax", [1])],
            f"{p}_w",
            keepdims=1,
        )  # [T, 1]
        contrib = g.op("Mul", [down, w_e], f"{p}_contrib")
        out = "output" if ex == e - 1 else f"acc{ex}"
        acc = contrib if not acc else g.op("Add", [acc, contrib], out)
    g.output("output", ["sequence_length", h])
    return HandwrittenLayer(
        g.model(21),
        f"dense fallback loop ({weights}; Mobius style): one MLP per expert on every token, "
        "weighted by ReduceSum(Cast(Equal(ids, e)) * w), Add chain",
        _fused_dense(k, weights),
    )
