"""The router's softmax and the top-k weights' normalisation proved by behaviour.

Two regions of a router are recognised by probing, the way :mod:`.activation` recognises an
activation (cut out by :func:`.region.elementwise_region`, evaluated per op by
:mod:`.interpret`, compared with candidates in float64):

* :func:`softmax_logits`: what TopK reads, written out from the router logits
  (``Exp(x - ReduceMax(x)) / ReduceSum(...)``, with or without the max, ``Div`` or
  ``Mul(Reciprocal)``): the region back to its one source (the logits: the value made by an op
  that is not element-wise, or by an ``Add``/``Mul`` of a constant that varies over the experts,
  a router bias) must compute the softmax over the experts (last axis). Candidates for the near
  miss: that softmax, the softmax over the token axis, the identity, the sigmoid.
* :func:`weights_form`: the weights the combine multiplies by, written out from the TopK values:
  the renormalisation ``v / sum(v)`` (form ``renorm``), the softmax over the k slots
  (``softmax_k``) or the values as they are (``as_is``).

Probes: rows of logits or top-k values drawn from a fixed generator (normal at scales 1e-2 to
20, ties, one dominant expert, large negative offsets, signed zeros; top-k values positive, in
(0, 1], tiny ones included), shaped like the real value (rank ``r``, features last). Logits stay
within ±60 so a softmax written without the max (``exp(x) / sum(exp(x))``, which overflows past
88) is still recognised for the logits a router produces. Tolerance: :func:`.probes.deviation`'s
8 ulp, relative to each probability, times ``1 + log2(width)`` for the sum's rounding.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import (
    const_array,
    const_ints,
    static_last_dim,
    value_label,
)
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.moe.behaviour.interpret import OPS, Unsupported, evaluate
from onnx_moe_fuse.rewrites.moe.behaviour.probes import Deviation, atol_for, deviation, rtol_for
from onnx_moe_fuse.rewrites.moe.behaviour.region import Region, elementwise_region

__all__ = ["logits_probes", "softmax_logits", "weights_form"]

_F32 = np.dtype(np.float32)
_AFFINE = frozenset({"Add", "Sub", "Mul", "Div"})


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def logits_probes(width: int, seed: int = 0) -> np.ndarray:
    """Rows of router logits ``[rows, width]`` (float32) where softmax spellings part ways."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal((6, width)) * s for s in (1e-2, 1.0, 5.0, 20.0)]
    rows.append(np.zeros((1, width)))
    rows.append(np.full((1, width), -0.0))
    dominant = np.zeros((2, width))
    dominant[0, 0], dominant[1, -1] = 30.0, -30.0
    rows += [dominant, rng.standard_normal((3, width)) - 60.0, rng.standard_normal((3, width)) + 40]
    ties = rng.standard_normal((2, width)).round(0)
    rows.append(ties)
    return np.concatenate(rows).astype(np.float32)


def _values_probes(k: int, seed: int = 0) -> np.ndarray:
    """Rows of top-k values ``[rows, k]``: positive, in (0, 1], descending, tiny ones too."""
    rng = np.random.default_rng(seed)
    rows = [rng.uniform(0.0, 1.0, (12, k)), rng.uniform(0.0, 1e-3, (4, k)), np.full((2, k), 0.5)]
    tiny = np.full((2, k), 1e-30)
    tiny[:, 0] = 1.0
    rows.append(tiny)
    out = -np.sort(-np.concatenate(rows), axis=1)
    return np.maximum(out, 1e-38).astype(np.float32)


def _is_logits(value: ir.Value) -> bool:
    """The router logits: made by a non-element-wise op, or by a bias/scale varying over E."""
    node = value.producer()
    if node is None or node.op_type not in OPS or node.domain not in ("", "ai.onnx"):
        return True
    if node.op_type in _AFFINE:
        for v in node.inputs:
            arr = const_array(v) if v is not None else None
            if arr is not None and np.asarray(arr).size > 1:
                flat = np.asarray(arr).reshape(-1)
                if not np.all(flat == flat[0]):
                    return True
    return False


def _evaluate(region: Region, x: np.ndarray, rank: int, what: str) -> np.ndarray:
    lead = (x.shape[0],) + (1,) * (rank - 2)
    try:
        out = evaluate(
            region.nodes, {region.sources[0]: x.reshape(*lead, x.shape[1])}, region.constants
        )
    except (Unsupported, ValueError, IndexError, TypeError) as error:
        node = getattr(error, "node", None)
        raise Refusal(f"{what} cannot be evaluated: {error}", node or region.output) from None
    y = out[region.output]
    if y.shape != (*lead, x.shape[1]):
        raise Refusal(
            f"{what} '{value_label(region.output)}' has shape {list(y.shape)} on probes of shape "
            f"{[*lead, x.shape[1]]}: not one value per expert",
            region.output,
        )
    return y.reshape(x.shape)


def _closest(
    what: str, region: Region, y: np.ndarray, x: np.ndarray, candidates: dict, accept: str
) -> tuple[str, Deviation]:
    width = x.shape[1]
    rtol = rtol_for(_F32) * (1 + math.log2(max(width, 1)))
    results = {}
    for name, c in candidates.items():
        results[name] = deviation(y, c, np.abs(c), rtol, atol_for(_F32))
    if results[accept].agrees:
        return accept, results[accept]
    name, d = min(results.items(), key=lambda t: t[1].rank)
    row = d.at // width
    if d.agrees:
        raise Refusal(
            f"{what} '{value_label(region.output)}' computes {name} (every probe agrees), not "
            f"{accept}",
            region.output,
        )
    raise Refusal(
        f"{what} '{value_label(region.output)}' computes none of {', '.join(candidates)} within "
        f"float rounding: the closest, {name}, is {abs(d.model - d.candidate):.3g} off "
        f"({d.worst:.3g} times the tolerance; {d.failing:.0%} of the probes disagree) at probe "
        f"row {row} (values {np.array2string(x[row][:4], precision=4)}...), where the region "
        f"gives {d.model:.7g} and {name} {d.candidate:.7g}",
        region.output,
    )


def softmax_logits(scores: ir.Value, rank: int) -> tuple[ir.Value, Region]:
    """The router logits whose softmax over the experts ``scores`` is, and the region between.

    A Refusal (part unset: the caller's) names the closest candidate when the region is no
    such softmax, or why it cannot be probed.
    """
    what = "the router scores"
    region = elementwise_region(scores, _is_logits, what)
    if region is None or len(region.sources) != 1:
        raise Refusal(
            f"{what} '{value_label(scores)}' are not computed from one value of router logits",
            scores,
        )
    logits = region.sources[0]
    width = static_last_dim(logits) or static_last_dim(scores)
    if width is None:
        raise Refusal(
            f"{what}: the number of experts of '{value_label(logits)}' is not static", logits
        )
    x = logits_probes(width)
    y = _evaluate(region, x, rank, what)
    x64 = x.astype(np.float64)
    candidates = {
        "the softmax over the experts": _softmax(x64, 1),
        "the softmax over the tokens": _softmax(x64, 0) if rank == 2 else np.ones_like(x64),
        "the sigmoid": 1.0 / (1.0 + np.exp(-x64)),
        "the identity": x64,
    }
    _closest(what, region, y, x, candidates, "the softmax over the experts")
    return logits, region


def weights_form(weights: ir.Value, rank: int) -> tuple[ir.Node, str, Region] | None:
    """``(topk, form, region)`` when ``weights`` are made from a TopK's values alone.

    ``form``: ``renorm`` (divided by their sum), ``softmax_k`` or ``as_is``. None when the
    region does not start at one TopK's values (other weights: ``moe.selected_weights``); a
    Refusal naming the closest candidate when it does but computes none of the three.
    """
    what = "the routing weights"

    def is_values(v: ir.Value) -> bool:
        node = v.producer()
        return node is not None and node.op_type == "TopK" and v is node.outputs[0]

    try:
        region = elementwise_region(weights, is_values, what)
    except Refusal:
        return None
    if region is None or len(region.sources) != 1 or not region.nodes:
        return None
    topk = region.sources[0].producer()
    assert topk is not None
    k_values = const_ints(topk.inputs[1]) if len(topk.inputs) > 1 else None
    if not k_values or len(k_values) != 1 or k_values[0] < 1:
        return None
    k = k_values[0]
    x = _values_probes(k)
    y = _evaluate(region, x, rank, what)
    x64 = x.astype(np.float64)
    candidates = {
        "renorm": x64 / x64.sum(axis=1, keepdims=True),
        "softmax_k": _softmax(x64, 1),
        "as_is": x64,
    }
    for form in candidates:
        try:
            _closest(what, region, y, x, candidates, form)
        except Refusal:
            continue
        return topk, form, region
    _closest(what, region, y, x, candidates, "renorm")  # raises, naming the closest
    raise AssertionError("unreachable")
