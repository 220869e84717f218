"""Hand-built loops over the experts that select each expert's tokens by ``(idx == e).any(-1)``.

Written after makeMoE's ``SparseMoE`` (AviSoori1x/makeMoE, the notebook's first version) on
``[T, H]`` tokens: the router's top-k logits put into a ``[T, E]`` tensor whose other columns hold
a fill, softmaxed over every expert (``gating``); per expert ``e`` the tokens whose slots hold
``e`` (``NonZero`` of the token mask), a ReLU FFN with biases, the rows weighted by
``gating[rows, e]`` and added into the accumulator by a read-back index_put (GatherND, Add,
ScatterND).

Router spellings (``router``): ``scatter`` (``full(-inf).scatter(-1, idx, topk_logits)``),
``where`` (``Where(topk_mask, logits, -inf)``, the mask a scatter of ones), ``where_not``
(``logits.masked_fill(~topk_mask, -inf)``), ``zeros``
(the softmax of the k logits scattered into zeros: the dense weights), ``fill``
(a finite fill ``-1e4`` with logits of order 1e4: see :data:`FILL`). Mask spellings (``mask``):
``any`` (``Cast -> ReduceMax -> Cast(bool)``, dynamo's ``.any(-1)``), ``sum_gt`` (``ReduceSum
> 0``), ``sum_eq`` (``ReduceSum == 1``). Traps (:data:`CHOSEN_TRAPS`) compute something else.
"""

from __future__ import annotations

import numpy as np
import onnx

from tests.rewrites.canonical.experts.meaning_models import _G, EXPERTS, INTER, H

K = 2
#: A fill of the unselected columns that is not ``-inf``, and the spread of router logits
#: centred on it: exp(-1e4 - max) is 0 in float32 only while the selected logits stay above
#: -1e4 + 88; logits of order -1e4 make the unselected columns take part of the softmax. The
#: layer is still the contract: its weights are read at the ids, whatever they sum to.
FILL, SPREAD = -1e4, 20.0

CHOSEN_TRAPS = (
    "other_column",  # expert e's rows weighed by gating[:, e + 1]: another expert's weight
    "same_mask_twice",  # expert 1's branch masks idx == 0: expert 0 added twice, 1 never
    "every_token",  # ReduceSum > -1: every token, whether it chose the expert or not
    "not_chosen",  # ReduceSum == 0: the tokens that did not choose the expert
    "capacity_cut",  # makeMoE.py's nonzero(mask)[:capacity]: the rows past 2 are dropped
    "scatter_k_minus_1",  # only the first k-1 top logits scattered: the last slot weighs 0
)


def _mask(g: _G, ids: str, e: int, mask: str, trap: str | None) -> str:
    eq = g.op("Equal", [ids, g.c(np.array(e, np.int64))])
    as_int = g.op("Cast", [eq], to=onnx.TensorProto.INT64)
    axes = g.c(np.array([-1]))
    if mask == "any" and trap not in ("every_token", "not_chosen"):
        return g.op(
            "Cast", [g.op("ReduceMax", [as_int, axes], keepdims=0)], to=onnx.TensorProto.BOOL
        )
    total = g.op("ReduceSum", [as_int, axes], keepdims=0)
    if trap == "every_token":
        return g.op("Greater", [total, g.c(np.array(-1, np.int64))])
    if trap == "not_chosen":
        return g.op("Equal", [total, g.c(np.array(0, np.int64))])
    if mask == "sum_eq":
        return g.op("Equal", [total, g.c(np.array(1, np.int64))])
    return g.op("Greater", [total, g.c(np.array(0, np.int64))])


def _gating(g: _G, router: str, trap: str | None = None) -> tuple[str, str]:
    """``(gating [T, E], ids [T, k])``."""
    scale = SPREAD if router == "fill" else 1.0
    logits = g.op(
        "MatMul", ["x", g.c((g.rng.standard_normal((H, EXPERTS)) * scale / 4).astype(np.float32))]
    )
    shift = FILL if router == "fill" else 0.0  # logits about the fill: it takes part of the mass
    bias = g.rng.standard_normal(EXPERTS) * 0.1 + shift
    logits = g.op("Add", [logits, g.c(bias.astype(np.float32))])
    vals, ids = g.op("TopK", [logits, g.c(np.array([K]))], 2)
    shape = g.op("Shape", [logits])
    if router in ("where", "where_not"):
        zeros = g.op("Expand", [g.c(np.array(0.0, np.float32)), shape])
        ones = g.op("Expand", [g.c(np.array(1.0, np.float32)), g.op("Shape", [ids])])
        chosen = g.op(
            "Cast", [g.op("ScatterElements", [zeros, ids, ones], axis=1)], to=onnx.TensorProto.BOOL
        )
        minus_inf = g.c(np.array(-np.inf, np.float32))
        if router == "where_not":  # masked_fill(logits, ~topk_mask, -inf)
            sparse = g.op("Where", [g.op("Not", [chosen]), minus_inf, logits])
        else:
            sparse = g.op("Where", [chosen, logits, minus_inf])
    elif router == "zeros":  # the softmax of the k logits scattered into zeros
        w = g.op("Softmax", [vals], axis=-1)
        zeros = g.op("Expand", [g.c(np.array(0.0, np.float32)), shape])
        return g.op("ScatterElements", [zeros, ids, w], axis=-1), ids
    else:
        fill = FILL if router == "fill" else -np.inf
        full = g.op("Expand", [g.c(np.array(fill, np.float32)), shape])
        at, put = ids, vals
        if trap == "scatter_k_minus_1":
            lo, hi, axis = g.c(np.array([0])), g.c(np.array([K - 1])), g.c(np.array([1]))
            at, put = (g.op("Slice", [v, lo, hi, axis]) for v in (ids, vals))
        sparse = g.op("ScatterElements", [full, at, put], axis=-1)
    return g.op("Softmax", [sparse], axis=-1), ids


def chosen_layer(
    router: str = "scatter", mask: str = "any", trap: str | None = None, seed: int = 0
) -> onnx.ModelProto:
    """The makeMoE-style loop (see the module)."""
    g = _G(seed)
    gating, ids = _gating(g, router, trap)
    acc = g.op("Expand", [g.c(np.array(0.0, np.float32)), g.op("Shape", ["x"])])
    for e in range(EXPERTS):
        tested = 0 if trap == "same_mask_twice" and e == 1 else e
        token_mask = _mask(g, ids, tested, mask, trap)
        rows = g.op("Transpose", [g.op("NonZero", [token_mask])], perm=[1, 0])  # [R, 1]
        if trap == "capacity_cut":
            zero = g.c(np.array([0]))
            rows = g.op("Slice", [rows, zero, g.c(np.array([2])), zero])
        picked = g.op("GatherND", ["x", rows])
        hidden = g.op(
            "Relu", [g.op("Add", [g.op("MatMul", [picked, g.w(H, INTER)]), g.w(1, INTER)])]
        )
        y = g.op("Add", [g.op("MatMul", [hidden, g.w(INTER, H)]), g.w(1, H)])
        column = (tested + 1) % EXPERTS if trap == "other_column" else tested
        weight = g.op("Gather", [gating, g.c(np.array(column, np.int64))], axis=1)
        weight = g.op("Unsqueeze", [g.op("GatherND", [weight, rows]), g.c(np.array([1]))])
        update = g.op("Add", [g.op("GatherND", [acc, rows]), g.op("Mul", [y, weight])])
        acc = g.op("ScatterND", [acc, rows, update])
    return g.model(acc, opset=18)
