"""Hand-built sorted MoE layers as torchtitan's and torchtune's ``MoE`` export (meaning tests).

:func:`histc_layer` writes the flat ids sorted by an ascending TopK (``argsort``), the
per-expert counts by torch's ``histc`` over the float ids as dynamo exports it (a validity
``Where``, ``Less`` against the bin edges, a sum over the rows, neighbouring differences), the
token rows gathered with ``GatherElements`` at ``order // k``, a ``Split`` by the counts, each
expert's own SwiGLU MLP, the segments concatenated, times the weights at the sorted rows (or,
``scale_before``, the rows times their weight before the experts, torchtune's
``scale_before_experts``), scatter-added at the tokens into zeros or into a shared expert's
output (``base``). Traps (:data:`SORTED_TRAPS`) compute something else and must be refused.
Tokens ``x [T, H]`` are the graph input (T symbolic), ``out`` the output.
"""

from __future__ import annotations

import numpy as np
import onnx

from tests.rewrites.canonical.experts.meaning_models import _G, EXPERTS, INTER, H

SORTED_TRAPS = (
    "histc_off_by_one",  # histc(min=-1, max=E-1): bin 0 is empty, bin E-1 holds two experts
    "scale_before_top2",  # the rows scaled by their weight at k = 2: one row, two scales
)


def _histc(g: _G, flat: str, lo: float) -> str:
    """torch.histc(ids.float(), bins=E, min=lo, max=lo+E) as dynamo writes it, int64 counts."""
    fl = g.op("Cast", [flat], to=onnx.TensorProto.FLOAT)
    hi = lo + EXPERTS
    inside = g.op(
        "And",
        [
            g.op("GreaterOrEqual", [fl, g.c(np.array([lo], np.float32))]),
            g.op("LessOrEqual", [fl, g.c(np.array([hi], np.float32))]),
        ],
    )
    valid = g.op("And", [inside, g.op("Not", [g.op("IsNaN", [fl])])])
    xv = g.op("Where", [valid, fl, g.c(np.array([-1.0], np.float32))])
    edges = (lo + np.arange(EXPERTS + 1)).astype(np.float32)
    edges[-1] = np.nextafter(edges[-1], np.float32(np.inf))  # the last bin holds max
    below = g.op("Less", [g.op("Unsqueeze", [xv, g.c(np.array([0]))]), g.c(edges.reshape(-1, 1))])
    cum = g.op(
        "ReduceSum",
        [g.op("Cast", [below], to=onnx.TensorProto.FLOAT), g.c(np.array([1]))],
        keepdims=0,
    )
    zero = g.c(np.array([0]))
    upper = g.op("Slice", [cum, g.c(np.array([1])), g.c(np.array([EXPERTS + 1])), zero])
    lower = g.op("Slice", [cum, zero, g.c(np.array([-1])), zero])
    return g.op("Cast", [g.op("Sub", [upper, lower])], to=onnx.TensorProto.INT64)


def histc_layer(
    trap: str | None = None,
    seed: int = 0,
    k: int = 2,
    scale_before: bool = False,
    base: bool = False,
    route_scale: float = 1.0,
) -> onnx.ModelProto:
    """The torchtitan / torchtune sorted layer (see the module)."""
    if trap == "scale_before_top2":
        k, scale_before = 2, True
    g = _G(seed)
    logits = g.op("MatMul", ["x", g.w(H, EXPERTS)])
    probs = g.op("Sigmoid" if k == 1 else "Softmax", [logits], **({} if k == 1 else {"axis": -1}))
    _, ids = g.op("TopK", [probs, g.c(np.array([k]))], 2)
    w = g.op("GatherElements", [probs, ids], axis=1)  # the scores at the ids, as both do
    if route_scale != 1.0:
        w = g.op("Mul", [w, g.c(np.array(route_scale, np.float32))])
    flat = g.op("Reshape", [ids, g.c(np.array([-1]))])
    sizes = _histc(g, flat, -1.0 if trap == "histc_off_by_one" else 0.0)
    _, order = g.op("TopK", [flat, g.op("Shape", [flat])], 2, largest=0, sorted=1)
    tok = g.op("Div", [order, g.c(np.array(k))])
    index = g.op("Expand", [g.op("Reshape", [tok, g.c(np.array([-1, 1]))]), g.c(np.array([1, H]))])
    rows = g.op("GatherElements", ["x", index], axis=0)
    ws = g.op("Gather", [g.op("Reshape", [w, g.c(np.array([-1]))]), order], axis=0)
    ws = g.op("Unsqueeze", [ws, g.c(np.array([-1]))])
    if scale_before:
        rows = g.op("Mul", [rows, ws])
    segments = g.op("Split", [rows, sizes], EXPERTS, axis=0)
    outs = []
    for seg in segments:
        gate, up = g.op("MatMul", [seg, g.w(H, INTER)]), g.op("MatMul", [seg, g.w(H, INTER)])
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        outs.append(g.op("MatMul", [act, g.w(INTER, H)]))
    y = g.op("Concat", outs, axis=0)
    if not scale_before:
        y = g.op("Mul", [y, ws])
    if base:
        into = g.op("MatMul", [g.op("Relu", [g.op("MatMul", ["x", g.w(H, INTER)])]), g.w(INTER, H)])
    else:
        into = g.op("Expand", [g.c(np.array(0.0, np.float32)), g.op("Shape", ["x"])])
    out = g.op("ScatterElements", [into, index, y], axis=0, reduction="add")
    return g.model(out, opset=18)
