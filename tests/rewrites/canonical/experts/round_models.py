"""Hand-built MoE layers whose routers are not a plain TopK of the scores (issue 18, "rounds").

:func:`rounds_layer` selects in two argmax rounds as PhiMoE's sparse mixer does: expert 1 the
``ArgMax`` of the logits, expert 2 the ``ArgMax`` of the logits with expert 1 scattered to
``-inf``; each weight a softmax gathered at its round's expert; the experts per slot (the flat
decomposition). :func:`grouped_layer` routes as DeepSeek-V3's gate: sigmoid scores, a selection
bias, the groups ranked by their best score, the other groups masked to ``-inf`` by ``Where``,
the weights gathered from the unbiased scores, renormalised and scaled; the experts in the
dynamo loop form (``NonZero`` per expert, the accumulator read, added to and written back).
``trap`` makes the layer compute something else (:data:`ROUND_TRAPS`, :data:`GROUPED_TRAPS`);
each must be refused. Tokens ``x [T, H]`` are the graph input, ``out`` the output.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.rewrites.canonical.experts.meaning_models import _G, EXPERTS, INTER, H, _silu_by_hand

ROUND_TRAPS = (
    "unmasked",  # round 2 reads the logits again: both rounds pick the same expert
    "zero_fill",  # round 2 masks the first choice with 0, not -inf (it may be picked again)
    "weights_swapped",  # the weights concatenated in the other round order
)
GROUPED_TRAPS = ("logit_weights",)  # the weights gathered from the raw (signed) logits


def _experts_per_slot(g: _G, w: str, ids: str, k: int) -> str:
    """Tokens repeated per slot, each slot's expert gathered by the flat ids, summed over k."""
    flat_ids = g.op("Reshape", [ids, g.c(np.array([-1]))])
    tiled = g.op("Tile", [g.op("Unsqueeze", ["x", g.c(np.array([1]))]), g.c(np.array([1, k, 1]))])
    x3 = g.op("Unsqueeze", [g.op("Reshape", [tiled, g.c(np.array([-1, H]))]), g.c(np.array([1]))])
    h = g.op("MatMul", [x3, g.op("Gather", [g.w(EXPERTS, H, 2 * INTER), flat_ids], axis=0)])
    gate, up = g.op("Split", [h, g.c(np.array([INTER, INTER]))], 2, axis=-1)
    a = g.op("Mul", [_silu_by_hand(g, gate), up])
    y = g.op("MatMul", [a, g.op("Gather", [g.w(EXPERTS, INTER, H), flat_ids], axis=0)])
    weighted = g.op("Mul", [y, g.op("Reshape", [w, g.c(np.array([-1, 1, 1]))])])
    per_slot = g.op("Reshape", [weighted, g.c(np.array([-1, k, H]))])
    return g.op("ReduceSum", [per_slot, g.c(np.array([1]))], keepdims=0)


def rounds_layer(trap: str | None = None, seed: int = 0) -> onnx.ModelProto:
    """Two argmax rounds (PhiMoE's sparse mixer, eval), softmax weights per round."""
    g = _G(seed)
    logits = g.op("MatMul", ["x", g.w(H, EXPERTS)])
    first = g.op("ArgMax", [logits], axis=-1, keepdims=1)
    w0 = g.op("GatherElements", [g.op("Softmax", [logits], axis=-1), first], axis=-1)
    fill = -np.inf if trap != "zero_fill" else 0.0
    fills = g.op(
        "ConstantOfShape",
        [g.op("Shape", [first])],
        value=numpy_helper.from_array(np.array([fill], np.float32)),
    )
    masked = g.op("ScatterElements", [logits, first, fills], axis=-1)
    scores2 = logits if trap == "unmasked" else masked
    second = g.op("ArgMax", [scores2], axis=-1, keepdims=1)
    w1 = g.op("GatherElements", [g.op("Softmax", [scores2], axis=-1), second], axis=-1)
    ids = g.op("Concat", [first, second], axis=-1)
    order = [w1, w0] if trap == "weights_swapped" else [w0, w1]
    w = g.op("Concat", order, axis=-1)
    return g.model(_experts_per_slot(g, w, ids, 2), opset=18)


def _grouped_router(g: _G, trap: str | None, groups: int = 2, k: int = 2) -> tuple[str, str]:
    """DeepSeek-V3's gate: sigmoid, selection bias, top-1 group of ``groups``, -inf elsewhere."""
    logits = g.op("MatMul", ["x", g.w(H, EXPERTS)])
    scores = g.op("Sigmoid", [logits])
    biased = g.op("Add", [scores, g.c(g.rng.standard_normal(EXPERTS).astype(np.float32) * 0.1)])
    grouped = g.op("Reshape", [biased, g.c(np.array([-1, groups, EXPERTS // groups]))])
    best = g.op("ReduceMax", [grouped, g.c(np.array([-1]))], keepdims=0)  # [T, G]
    top_group = g.op("TopK", [best, g.c(np.array([1]))], 2)[1]
    ones = g.op("Expand", [g.c(np.array(1.0, np.float32)), g.op("Shape", [best])])
    zeros = g.op(
        "ConstantOfShape",
        [g.op("Shape", [top_group])],
        value=numpy_helper.from_array(np.zeros(1, np.float32)),
    )
    other_groups = g.op("ScatterElements", [ones, top_group, zeros], axis=1)
    mask = g.op("Cast", [g.op("Unsqueeze", [other_groups, g.c(np.array([-1]))])], to=9)
    minus_inf = g.c(np.array([-np.inf], np.float32))
    kept = g.op("Where", [mask, minus_inf, grouped])
    flat = g.op("Reshape", [kept, g.c(np.array([-1, EXPERTS]))])
    ids = g.op("TopK", [flat, g.c(np.array([k]))], 2)[1]
    source = logits if trap == "logit_weights" else scores
    picked = g.op("GatherElements", [source, ids], axis=1)
    total = g.op("ReduceSum", [picked, g.c(np.array([-1]))], keepdims=1)
    w = g.op("Mul", [g.op("Div", [picked, total]), g.c(np.array(2.5, np.float32))])
    return w, ids


def grouped_layer(
    trap: str | None = None, seed: int = 0, static_tokens: int | None = None
) -> onnx.ModelProto:
    """DeepSeek-V3's gate, the experts in the loop form; ``static_tokens`` fixes T (zeros const)."""
    g = _G(seed)
    w, ids = _grouped_router(g, trap)
    w3 = g.op("Unsqueeze", [w, g.c(np.array([-1]))])
    if static_tokens is None:
        acc = g.op("Expand", [g.c(np.array(0.0, np.float32)), g.op("Shape", ["x"])])
    else:  # a static export's zeros_like(x): a [T, H] constant (T == E reads like a stack)
        acc = g.c(np.zeros((static_tokens, H), np.float32))
    for e in range(EXPERTS):
        pairs = g.op("Transpose", [g.op("NonZero", [g.op("Equal", [ids, g.c(np.array(e))])])])
        ends = [(g.c(np.array([c])), g.c(np.array([c + 1]))) for c in (0, 1)]
        t1, j1 = (g.op("Slice", [pairs, lo, hi, g.c(np.array([1]))]) for lo, hi in ends)
        weight = g.op("GatherND", [w3, g.op("Concat", [t1, j1], axis=-1)])
        rows = g.op("GatherND", ["x", t1])
        gate = g.op("Gemm", [rows, g.w(INTER, H)], transB=1)
        up = g.op("Gemm", [rows, g.w(INTER, H)], transB=1)
        y = g.op("Gemm", [g.op("Mul", [_silu_by_hand(g, gate), up]), g.w(H, INTER)], transB=1)
        added = g.op("Add", [g.op("GatherND", [acc, t1]), g.op("Mul", [weight, y])])
        acc = g.op("ScatterND", [acc, t1, added])
    model = g.model(acc, opset=18)
    if static_tokens is not None:
        for v in (*model.graph.input, *model.graph.output):
            v.CopyFrom(helper.make_tensor_value_info(v.name, TensorProto.FLOAT, [static_tokens, H]))
    return model
