"""Hand-written MoE layers whose expert weights or biases are laid out in other ways.

Part of the "meaning" set (:mod:`onnx_moe_fuse.samples.handwritten_meaning`, issue 18):

* :func:`bias_rank`: per-expert FC1/FC3/FC2 biases of another rank: ``[E, N]`` gathered by the
  ids then Unsqueeze-d to ``[T, k, 1, N]``, stored ``[E, 1, N]`` (the gather already has the
  row axis), or ``[E, N]`` gathered and added after the ``[T, k, N]`` reshape;
* :func:`int8_channel_fc3`: int8 codes (no zero point) per output channel behind
  DequantizeLinear, SwiGLU with separate gate (FC1) and up (FC3) projections;
* :func:`qwen3_flat_int4`: the plain Qwen3-30B-A3B-style int4 decomposition: rows flattened to
  ``[T*k, 1, H]``, every expert weight gathered by the flat index behind DequantizeLinear of int4
  codes (blocks of 32), the flat rows multiplied by the flat weights, then Reshape ``[T, k, H]``
  and ReduceSum. Sizes are a parameter (:data:`~.handwritten_dense.QWEN3_30B_A3B` is the real
  block, for ``benchmarks/``);
* :func:`gmm_swish_fc3`: opset 29, every projection a ``GroupedMatMul`` node, the activation
  ``Swish(gate) * up`` (SwiGLU with FC3).

Traps: a bias gathered by other indices (:func:`trap_bias_other_ids`), the up projection of
the int8 layer gathered by the other slot's expert (:func:`trap_int8_up_other_slot`), and the
Qwen3 combine pairing each row with a weight of another row (:func:`trap_qwen3_weights_slot_major`),
and the GroupedMatMul layer's FC2 run by the other slot's expert (:func:`trap_gmm_down_other_slot`).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from onnx_moe_fuse.samples.handwritten_dense import QWEN3_SMALL, Qwen3Sizes
from onnx_moe_fuse.samples.handwritten_graph import (
    Fused,
    Graph,
    HandwrittenLayer,
    Refused,
    normal,
)
from onnx_moe_fuse.samples.handwritten_meaning_act import moe_attrs

__all__ = [
    "BIAS_RANKS",
    "bias_rank",
    "trap_bias_other_ids",
    "int8_channel_fc3",
    "trap_int8_up_other_slot",
    "qwen3_flat_int4",
    "trap_qwen3_weights_slot_major",
    "gmm_swish_fc3",
    "trap_gmm_down_other_slot",
]

#: The bias layouts :func:`bias_rank` writes.
BIAS_RANKS = ("en_unsqueeze", "e1n", "after_reshape")
F32 = np.float32


def _router(g: Graph, rng, x: str, h: int, e: int, k: int, p: str = "") -> tuple[str, str]:
    logits = g.op("MatMul", [x, g.init(f"{p}router", normal(rng, (h, e), h))], f"{p}logits")
    probs = g.op("Softmax", [logits], f"{p}probs", axis=-1)
    vals, ids = g.op_multi("TopK", [probs, g.init(f"{p}k", [k])], [f"{p}vals", f"{p}ids"])
    total = g.op("ReduceSum", [vals, g.init(f"{p}axis_m1", [-1])], f"{p}vals_sum", keepdims=1)
    return g.op("Div", [vals, total], f"{p}weights"), ids


def _combine(g: Graph, per_slot: str, weights: str) -> str:
    w3 = g.op("Unsqueeze", [weights, g.init("w_unsq", [-1])], "weights_tk1")
    return g.op(
        "ReduceSum",
        [g.op("Mul", [per_slot, w3], "weighted"), g.init("slot_ax", [1])],
        "y",
        keepdims=0,
    )


def _swiglu(g: Graph, gate: str, up: str) -> str:
    silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], "gate_sigmoid")], "gate_silu")
    return g.op("Mul", [silu, up], "swiglu")


# -- bias ranks ---------------------------------------------------------------------------------


def _biased(g: Graph, lhs4: str, w: str, b: np.ndarray, ids: str, rank: str, n: int, p: str):
    """``lhs4 [T, k, 1, K] @ W[ids] + bias[ids]`` as ``[T, k, N]``, the bias laid out by ``rank``."""
    mm = g.op("MatMul", [lhs4, g.op("Gather", [w, ids], f"{p}_wsel", axis=0)], f"{p}_mm")
    if rank == "en_unsqueeze":
        bsel = g.op("Gather", [g.init(f"{p}.bias", b), ids], f"{p}_bsel", axis=0)  # [T, k, N]
        b4 = g.op("Unsqueeze", [bsel, g.init(f"{p}_b_axis", [2])], f"{p}_b4")
        return g.op("Squeeze", [g.op("Add", [mm, b4], f"{p}_biased"), g.init(f"{p}_sq", [2])],
                    f"{p}_out")  # fmt: skip
    if rank == "e1n":
        bias = g.init(f"{p}.bias", b[:, None, :])  # [E, 1, N]
        b4 = g.op("Gather", [bias, ids], f"{p}_b4", axis=0)  # [T, k, 1, N]
        return g.op("Squeeze", [g.op("Add", [b4, mm], f"{p}_biased"), g.init(f"{p}_sq", [2])],
                    f"{p}_out")  # fmt: skip
    if rank in ("after_reshape", "other_ids"):
        out = g.op("Reshape", [mm, g.init(f"{p}_tkn", [0, 0, n])], f"{p}_tkn_out")
        bias_ids = ids
        if rank == "other_ids":  # the trap: the next expert's bias
            e = b.shape[0]
            shifted = g.op("Add", [ids, g.init(f"{p}_one", np.array(1, np.int64))], f"{p}_ids1")
            bias_ids = g.op("Mod", [shifted, g.init(f"{p}_e", np.array(e, np.int64))], f"{p}_ids2")
        bsel = g.op("Gather", [g.init(f"{p}.bias", b), bias_ids], f"{p}_bsel", axis=0)
        return g.op("Add", [out, bsel], f"{p}_out")
    raise ValueError(f"unknown bias rank {rank!r}; choose among {BIAS_RANKS}")


def bias_rank(rank: str, seed: int = 200) -> HandwrittenLayer:
    """SwiGLU experts with FC1/FC3/FC2 biases laid out by ``rank`` (one of :data:`BIAS_RANKS`)."""
    rng = np.random.default_rng(seed)
    h, i, e, k = 32, 32, 6, 2
    g = Graph(f"bias_{rank}")
    x = g.input("x", ["T", h])
    weights, ids = _router(g, rng, x, h, e, k)
    x4 = g.op("Unsqueeze", [x, g.init("x_axes", [1, 2])], "x_t11h")
    x4 = g.op("Expand", [x4, g.init("x_rep", [1, k, 1, 1])], "x_tk1h")

    def fc(lhs: str, name: str, kdim: int, n: int) -> str:
        w = g.init(f"experts.{name}.weight", normal(rng, (e, kdim, n), kdim))
        b = (0.1 * rng.standard_normal((e, n))).astype(F32)
        return _biased(g, lhs, w, b, ids, rank, n, name)

    act = _swiglu(g, fc(x4, "gate", h, i), fc(x4, "up", h, i))
    a4 = g.op("Unsqueeze", [act, g.init("act_axis", [2])], "act_tk1i")
    _combine(g, fc(a4, "down", i, h), weights)
    g.output("y", ["T", h])
    if rank == "other_ids":
        return HandwrittenLayer(
            g.model(21),
            "trap: each slot's biases gathered by (ids + 1) mod E, not by its expert",
            Refused("fc1", "bias"),
        )
    how = {
        "en_unsqueeze": "[E, N] gathered by the ids then Unsqueeze-d to [T, k, 1, N]",
        "e1n": "stored [E, 1, N] and gathered to [T, k, 1, N]",
        "after_reshape": "[E, N] gathered and added after the Reshape to [T, k, N]",
    }[rank]
    return HandwrittenLayer(
        g.model(21),
        f"SwiGLU experts with FC1/FC3/FC2 biases {how}",
        Fused("MoE", moe_attrs(k, "swiglu")),
    )


def trap_bias_other_ids(seed: int = 201) -> HandwrittenLayer:
    """Trap: the biases of each slot gathered by ``(ids + 1) mod E``."""
    return bias_rank("other_ids", seed)


# -- 8-bit per-channel weights with FC3 -------------------------------------------------------


def _int8_channel(g: Graph, name: str, w: np.ndarray) -> str:
    """int8 codes ``[E, K, N]`` and one scale per expert and output column (no zero point)."""
    scale = (np.abs(w).max(axis=1, keepdims=True) / 127.0).astype(F32)  # [E, 1, N]
    codes = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    ins = [g.init(f"{name}_int8", codes), g.init(f"{name}_scale", scale)]
    return g.op("DequantizeLinear", ins, f"{name}_fp", axis=1, block_size=w.shape[1])


def int8_channel_fc3(seed: int = 202, up_ids_swapped: bool = False) -> HandwrittenLayer:
    """int8 per-channel DequantizeLinear weights, SwiGLU with separate gate and up (FC3)."""
    rng = np.random.default_rng(seed)
    h, i, e, k = 64, 32, 4, 2
    g = Graph("int8_fc3" if not up_ids_swapped else "int8_fc3_trap")
    x = g.input("tokens", ["n", h])
    weights, ids = _router(g, rng, x, h, e, k, p="gate_")
    wg = _int8_channel(g, "w_gate", normal(rng, (e, h, i), h))
    wu = _int8_channel(g, "w_up", normal(rng, (e, h, i), h))
    wd = _int8_channel(g, "w_down", normal(rng, (e, i, h), i))
    xs = g.op("Expand", [g.op("Unsqueeze", [x, g.const("u12", [1, 2])], "x4"),
                         g.const("rep", [1, k, 1, 1])], "xs")  # fmt: skip
    up_ids = ids
    if up_ids_swapped:  # the trap: slot j's up projection uses slot (1 - j)'s expert
        up_ids = g.op("Gather", [ids, g.const("slot_rev", [1, 0])], "ids_rev", axis=1)

    def proj(lhs: str, w: str, which: str, p: str) -> str:
        sel = g.op("Gather", [w, which], f"{p}_sel", axis=0)
        return g.op("Squeeze", [g.op("MatMul", [lhs, sel], f"{p}_mm"), g.const(f"{p}_s", [2])],
                    f"{p}_out")  # fmt: skip

    act = _swiglu(g, proj(xs, wg, ids, "g"), proj(xs, wu, up_ids, "u"))
    a4 = g.op("Unsqueeze", [act, g.const("a_ax", [2])], "act4")
    _combine(g, proj(a4, wd, ids, "d"), weights)
    g.output("y", ["n", h])
    if up_ids_swapped:
        return HandwrittenLayer(
            g.model(21),
            "trap: int8 SwiGLU whose up projection (FC3) is gathered by the other slot's expert",
            Refused("fc1", "expert"),
        )
    return HandwrittenLayer(
        g.model(21),
        "int8 per-channel DequantizeLinear weights (scale [E, 1, N], no zero point), SwiGLU "
        "with separate gate (FC1) and up (FC3)",
        Fused("QMoE", moe_attrs(k, "swiglu", expert_weight_bits=8, block_size=0)),
    )


def trap_int8_up_other_slot(seed: int = 203) -> HandwrittenLayer:
    """Trap: :func:`int8_channel_fc3` with the up projection gathered by the other slot's id."""
    return int8_channel_fc3(seed, up_ids_swapped=True)


# -- Qwen3-30B-A3B plain int4 decomposition -----------------------------------------------------


def _int4_codes(rng: np.random.Generator, shape: tuple[int, ...], block: int):
    """Random int4 codes and blocked scales along axis 1 (drawn, not quantized: fast at 30B)."""
    codes = rng.integers(-8, 8, size=shape, dtype=np.int8).astype(ml_dtypes.int4)
    scale_shape = (shape[0], shape[1] // block, shape[2])
    scale = (rng.uniform(0.5, 1.5, size=scale_shape) / (4.5 * np.sqrt(shape[1]))).astype(F32)
    return codes, scale


def qwen3_flat_int4(
    sizes: Qwen3Sizes = QWEN3_SMALL, seed: int = 204, slot_major_weights: bool = False
) -> HandwrittenLayer:
    """The plain Qwen3-MoE int4 decomposition: flat rows, flat weights, Reshape + ReduceSum."""
    rng = np.random.default_rng(seed)
    h, i, e, k, blk = sizes.hidden, sizes.inter, sizes.experts, sizes.top_k, sizes.block
    g = Graph("qwen3_moe_flat")
    x = g.input("hidden_states", ["batch", "sequence_length", h])
    flat = g.op("Reshape", [x, g.init("to_2d", [-1, h])], "x_2d")
    weights, ids = _router(g, rng, flat, h, e, k, p="mlp.gate.")
    rep = g.op("Expand", [g.op("Unsqueeze", [flat, g.init("ax1", [1])], "x_t1h"),
                          g.init("rep_k", [1, k, 1])], "x_tkh")  # fmt: skip
    rows = g.op("Reshape", [rep, g.init("rows_3d", [-1, 1, h])], "rows")  # [T*k, 1, H]
    flat_ids = g.op("Reshape", [ids, g.init("ids_1d", [-1])], "flat_ids")

    def expert_w(name: str, shape: tuple[int, int, int]) -> str:
        q, s = _int4_codes(rng, shape, blk)
        ins = [g.init(f"mlp.experts.{name}.qweight", q), g.init(f"mlp.experts.{name}.scales", s)]
        w = g.op("DequantizeLinear", ins, f"mlp.experts.{name}", axis=1, block_size=blk)
        return g.op("Gather", [w, flat_ids], f"{name}_rows_w", axis=0)

    gate = g.op("MatMul", [rows, expert_w("gate_proj", (e, h, i))], "gate_rows")
    up = g.op("MatMul", [rows, expert_w("up_proj", (e, h, i))], "up_rows")
    down = g.op("MatMul", [_swiglu(g, gate, up), expert_w("down_proj", (e, i, h))], "down_rows")
    w_src = weights
    if slot_major_weights:  # the trap: flat weights in slot-major order (row j*T + t)
        w_src = g.op("Transpose", [weights], "weights_kt", perm=[1, 0])
    flat_w = g.op("Reshape", [w_src, g.init("w_rows", [-1, 1, 1])], "flat_weights")
    weighted = g.op("Mul", [down, flat_w], "weighted_rows")  # [T*k, 1, H]
    slots = g.op("Reshape", [weighted, g.init("tkh", [-1, k, h])], "weighted_slots")
    moe = g.op("ReduceSum", [slots, g.init("slot_axis", [1])], "moe_2d", keepdims=0)
    g.op("Reshape", [moe, g.op("Shape", [x], "x_shape")], "y")
    g.output("y", ["batch", "sequence_length", h])
    if slot_major_weights:
        return HandwrittenLayer(
            g.model(21),
            "trap: Qwen3 flat int4 layer whose flat weights are slot-major (Transpose first), "
            "so row t*k + j is weighted by another token's or slot's weight",
            Refused("combine", "weight"),
        )
    return HandwrittenLayer(
        g.model(21),
        f"Qwen3-MoE int4 (H {h}, I {i}, E {e}, k {k}, block {blk}), plain decomposition: rows "
        "[T*k, 1, H], weights gathered by the flat ids, flat rows times flat weights, Reshape "
        "[T, k, H], ReduceSum",
        Fused("QMoE", moe_attrs(k, "swiglu", expert_weight_bits=4, block_size=blk)),
    )


def trap_qwen3_weights_slot_major(seed: int = 205) -> HandwrittenLayer:
    """Trap: :func:`qwen3_flat_int4` with the flat weights taken slot-major."""
    return qwen3_flat_int4(QWEN3_SMALL, seed, slot_major_weights=True)


# -- opset 29: GroupedMatMul + Swish * FC3 ------------------------------------------------------


def gmm_swish_fc3(seed: int = 206, down_other_slot: bool = False) -> HandwrittenLayer:
    """GroupedMatMul projections (opset 29), activation ``Swish(gate) * up``.

    ``down_other_slot`` (the trap): FC2's row ids are the slots' ids reversed, so slot j's
    activation goes through slot (1 - j)'s expert.
    """
    rng = np.random.default_rng(seed)
    h, i, e, k = 32, 48, 6, 2
    g = Graph("gmm_swish" if not down_other_slot else "gmm_swish_trap")
    x = g.input("x", ["M", h])
    weights, ids = _router(g, rng, x, h, e, k)
    gate = g.op("GroupedMatMul", [x, g.init("w_gate", normal(rng, (e, h, i), h)), ids], "gate")
    up = g.op("GroupedMatMul", [x, g.init("w_up", normal(rng, (e, h, i), h)), ids], "up")
    act = g.op("Mul", [g.op("Swish", [gate], "gate_swish", alpha=1.0), up], "act")  # [M, k, I]
    rows = g.op("Reshape", [act, g.init("act_rows_shape", [-1, i])], "act_rows")
    down_ids = ids
    if down_other_slot:
        down_ids = g.op("Gather", [ids, g.init("slots_reversed", [1, 0])], "ids_rev", axis=1)
    row_ids = g.op("Reshape", [down_ids, g.init("row_ids_shape", [-1, 1])], "row_ids")
    wd = g.init("w_down", normal(rng, (e, i, h), i))
    down = g.op("GroupedMatMul", [rows, wd, row_ids], "down_rows")  # [M*k, 1, H]
    per_slot = g.op("Reshape", [down, g.init("slots_shape", [-1, k, h])], "down_slots")
    _combine(g, per_slot, weights)
    g.output("y", ["M", h])
    if down_other_slot:
        return HandwrittenLayer(
            g.model(29),
            "trap: opset-29 GroupedMatMul layer whose FC2 takes the other slot's expert",
            Refused("fc2", "expert"),
        )
    return HandwrittenLayer(
        g.model(29),
        "opset 29: GroupedMatMul gate, up and down projections, activation Swish(gate) * up",
        Fused("MoE", moe_attrs(k, "swiglu")),
    )


def trap_gmm_down_other_slot(seed: int = 207) -> HandwrittenLayer:
    """Trap: :func:`gmm_swish_fc3` with FC2 run by the other slot's expert."""
    return gmm_swish_fc3(seed, down_other_slot=True)
