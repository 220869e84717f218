"""Hand-written MoE layers behind asymmetric DequantizeLinear weights, by bit width and block.

What quantisers outside this project write: min/max (asymmetric) codes with a zero point per
block or per output channel, signed (``int4``/``int8``) or unsigned (``uint4``/``uint8``), any
block size from 16 to 256, or unsigned codes with no zero-point input at all (which ONNX reads
as zero point 0, the lowest code). The layer is the per-slot SwiGLU form (Gather of the stacked
experts, Unsqueeze/Expand, MatMul, Squeeze), written with plain ``onnx.helper`` nodes
(:class:`~.handwritten_graph.Graph`); the names follow the other DequantizeLinear layers
(``gate.qweight``, ``gate.scales``, ``gate.qzeros``, ``router``).

What a correct fuser does on ORT CPU (the default target), the ``expected`` of each layer: a
QMoE with explicit zero-point inputs, except block-wise 8-bit weights, which ONNX Runtime's CPU
QMoE computes with int8 activations (not exact): those are refused.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from onnx_moe_fuse.samples.handwritten_graph import Fused, Graph, HandwrittenLayer, Refused, normal

__all__ = ["QUANT_KINDS", "dq_asymmetric", "quantize_asymmetric"]

#: kind -> (bits, signed, storage dtype)
QUANT_KINDS: dict[str, tuple[int, bool, object]] = {
    "int4": (4, True, ml_dtypes.int4),
    "uint4": (4, False, ml_dtypes.uint4),
    "int8": (8, True, np.int8),
    "uint8": (8, False, np.uint8),
}


def quantize_asymmetric(
    w: np.ndarray, axis: int, block: int, kind: str, zero_point: str = "asymmetric"
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Min/max-quantize ``w`` in blocks of ``block`` along ``axis``: ``(q, scale, zp)``.

    ``scale = (max - min) / (2**bits - 1)`` per block and ``zp = round(-min / scale)``, so a
    block's range maps onto the whole code range; signed kinds store codes and zero points
    shifted down by ``2**(bits - 1)``. ``zero_point``: ``"asymmetric"`` (the above),
    ``"symmetric"`` (``scale = max|w| / (2**(bits-1) - 1)``, the zero point ``2**(bits-1)``,
    stored as 0 for signed kinds) or ``"none"`` (unsigned kinds only: codes ``round(w /
    scale)`` with ``scale = max|w| / (2**bits - 1)``, negative values clipped to code 0, and no
    zero point returned: ONNX reads a missing one as 0).
    """
    bits, signed, dtype = QUANT_KINDS[kind]
    axis = axis % w.ndim
    n = w.shape[axis]
    if n % block:
        raise ValueError(f"axis {axis} of size {n} is not a multiple of the block {block}")
    moved = np.moveaxis(w.astype(np.float64), axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], n // block, block)
    top = (1 << bits) - 1
    if zero_point == "asymmetric":
        lo = np.minimum(blocks.min(axis=-1), 0.0)
        hi = np.maximum(blocks.max(axis=-1), 0.0)
        scale = ((hi - lo) / top).astype(np.float32)
        scale = np.where(scale == 0, np.float32(1), scale)
        zp = np.clip(np.rint(-lo / scale), 0, top)
    elif zero_point == "symmetric":
        scale = (np.abs(blocks).max(axis=-1) / ((1 << (bits - 1)) - 1)).astype(np.float32)
        scale = np.where(scale == 0, np.float32(1), scale)
        zp = np.full(scale.shape, float(1 << (bits - 1)))
    else:
        if signed:
            raise ValueError("only unsigned codes mean something without a zero point")
        scale = (np.abs(blocks).max(axis=-1) / top).astype(np.float32)
        scale = np.where(scale == 0, np.float32(1), scale)
        zp = np.zeros(scale.shape)
    codes = np.clip(np.rint(blocks / scale[..., None].astype(np.float64)) + zp[..., None], 0, top)
    shift = 1 << (bits - 1) if signed else 0
    q = np.moveaxis((codes - shift).reshape(moved.shape), -1, axis).astype(np.int16).astype(dtype)
    scale = np.moveaxis(scale, -1, axis)
    z = np.moveaxis(zp - shift, -1, axis).astype(np.int16).astype(dtype)
    return q, scale, (None if zero_point == "none" else z)


def _dq(
    g: Graph,
    rng: np.random.Generator,
    name: str,
    shape: tuple[int, int, int],
    kind: str,
    block: int | None,
    zero_point: str,
) -> str:
    """``DequantizeLinear`` of random ``[E, K, N]`` weights quantized along K."""
    e, kk, n = shape
    # an offset per output channel, so that the ranges are lopsided and the zero points vary
    w = normal(rng, shape, kk) + normal(rng, (e, 1, n), 4)
    q, scale, zp = quantize_asymmetric(w, 1, kk if block is None else block, kind, zero_point)
    ins = [g.init(f"{name}.qweight", q), g.init(f"{name}.scales", scale)]
    if zp is not None:
        ins.append(g.init(f"{name}.qzeros", zp))
    size = kk if block is None else block
    return g.op("DequantizeLinear", ins, f"{name}.weight", axis=1, block_size=size)


def dq_asymmetric(
    kind: str, block: int | None, zero_point: str = "asymmetric", seed: int = 60
) -> HandwrittenLayer:
    """SwiGLU experts behind ``DequantizeLinear`` weights of any kind, block and zero point.

    ``kind``: ``int4``, ``uint4``, ``int8``, ``uint8``; ``block``: 16 ... 256 along K, or None
    for one scale (and zero point) per expert and output channel (``block_size = K``);
    ``zero_point``: ``"asymmetric"``, ``"symmetric"`` or ``"none"`` (no zero-point input:
    unsigned kinds, zero point 0), see :func:`quantize_asymmetric`.
    """
    rng = np.random.default_rng(seed)
    inter = 32 if block is None else max(32, block)
    h, i, e, k = 2 * inter, inter, 4, 2
    g = Graph(f"dq_asym_{kind}")
    x = g.input("x", ["T", h])
    logits = g.op("MatMul", [x, g.init("router", normal(rng, (h, e), h))], "logits")
    probs = g.op("Softmax", [logits], "probs", axis=-1)
    vals, idx = g.op_multi("TopK", [probs, g.init("k", [k])], ["top_vals", "top_idx"], axis=-1)
    total = g.op("ReduceSum", [vals, g.init("sum_axis", [-1])], "top_sum", keepdims=1)
    weights = g.op("Div", [vals, total], "route_w")
    x4 = g.op("Unsqueeze", [x, g.init("token_axes", [1, 2])], "x4")
    x4 = g.op("Expand", [x4, g.init("bcast", [1, k, 1, 1])], "x_slots")
    per: list[str] = []
    for name in ("gate", "up"):
        w = _dq(g, rng, name, (e, h, i), kind, block, zero_point)
        mm = g.op("MatMul", [x4, g.op("Gather", [w, idx], f"{name}_w", axis=0)], f"{name}_mm")
        per.append(g.op("Squeeze", [mm, g.init(f"{name}_drop", [2])], f"{name}_proj"))
    gate, up = per
    act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate], "gsig")], "gsilu"), up], "act")
    wd = _dq(g, rng, "down", (e, i, h), kind, block, zero_point)
    a4 = g.op("Unsqueeze", [act, g.init("act_axis", [2])], "act4")
    mm = g.op("MatMul", [a4, g.op("Gather", [wd, idx], "down_w", axis=0)], "down_mm")
    down = g.op("Squeeze", [mm, g.init("down_drop", [2])], "down_proj")
    w3 = g.op("Unsqueeze", [weights, g.init("w_axis", [-1])], "w3")
    weighted = g.op("Mul", [down, w3], "weighted")
    g.op("ReduceSum", [weighted, g.init("k_axis", [1])], "y", keepdims=0)
    g.output("y", ["T", h])
    bits = QUANT_KINDS[kind][0]
    granularity = "per channel" if block is None else f"blocked {block}"
    zps = {
        "asymmetric": "asymmetric zero points",
        "symmetric": "symmetric zero points",
        "none": "no zero point (0)",
    }[zero_point]
    description = f"{kind} DequantizeLinear weights, {zps}, {granularity}"
    if bits == 8 and block is not None:
        expected: Fused | Refused = Refused("target", "8-bit weights in blocks")
    else:
        expected = Fused(
            "QMoE",
            {
                "k": k,
                "activation_type": "swiglu",
                "expert_weight_bits": bits,
                # H = 2 I: per-channel projections have different single blocks, so block 0
                "block_size": 0 if block is None else block,
            },
        )
    return HandwrittenLayer(g.model(21), description, expected)
