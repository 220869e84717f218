"""Routing inputs for a fused MoE/QMoE node from any top-k selection and its final weights.

A layer's router is whatever the model wrote (softmax, sigmoid, biased or grouped top-k, routing
factors): what the fused node needs is only the selection ``idx [..., k]`` (int64 expert ids,
distinct in a row, from a TopK) and the final per-selected weights ``w [..., k]`` (float,
non-negative) that multiply the experts' outputs, ``out[t] = sum_j w[t, j] *
expert_{idx[t, j]}(x_t)``. This module builds, as onnx-ir nodes through the ``op`` builder a
rule's ``rewrite`` receives (onnxscript's ``RewriterContext``; a ``TapeRewriterContext`` in
tests), the fused node's routing inputs that reproduce that sum exactly, in one of two
constructions (:data:`CONSTRUCTIONS`):

* ``router_weights`` (QMoE where the kernel takes input 14): ``router_probs`` = ones scattered
  into zeros ``[T, E]`` at ``idx`` (its top-k is exactly ``idx``: k ones, the rest 0, so ties
  among the selected cannot matter), ``router_weights`` = ``w / m`` scattered into zeros at
  ``idx`` (``m`` the row's largest weight), ``normalize_routing_weights = 0``, and the fused
  output multiplied per token by ``scale = m``. The division is there because ORT 1.32 CPU's
  QMoE skips every selected expert whose final weight is <= 1e-8 (measured: 1e-8f skipped, the
  next float32 up used; an absolute threshold, whatever the other weights): with ``w`` as it
  is, a layer whose weights are all small (1e-10, a routing factor) would output 0. Scaled,
  only weights <= 1e-8 of the row's largest are skipped (a relative error <= 1e-8 each). When
  the weights sum to one (``weights_sum_to_one``) ``w`` goes in as it is, without a scale: its
  largest weight is >= 1/k, so the same bound holds within a factor k.
* ``logits`` (float MoE, and targets where ``router_weights`` is not established):
  ``router_probs`` = ``max(log(w / m), LOG_FLOOR)`` scattered into :data:`UNSELECTED` at
  ``idx``, with ``m`` the row's largest weight (so ORT's own ``x - max`` is exact and the largest
  weight's logit is 0), ``normalize_routing_weights = 1``: ORT's softmax (over all E for MoE,
  over the top k for QMoE) then top-k then renormalisation gives ``w_j / sum_j w_j``, and the
  fused output is multiplied per token by ``scale = sum_j w[t, j]`` (``[..., 1]``), left out
  when the caller knows the weights sum to one. The floor keeps a zero weight selected
  (``LOG_FLOOR > UNSELECTED``) and makes it contribute exactly 0 (``exp(LOG_FLOOR)`` is 0 in
  float16 and float32); a row of zeros gets uniform softmax weights times a scale of 0, so 0.

A caller knows the weights sum to one when the proof of the router shows they are a softmax's
output renormalised over the selected k: ``Softmax -> TopK -> Div(ReduceSum)`` or
``TopK -> Softmax`` over the k values (the rows of ``docs/rules.md``'s routing forms that map to
``normalize_routing_weights=1``). Sigmoid routers, routing factors and biased selection give no
such guarantee: pass ``weights_sum_to_one=False`` (the default) there.

Which construction a (target, op) uses is data (:data:`ROUTER_WEIGHTS_SOURCES`,
:func:`construction_for`): ``router_weights`` only where the op's contract has the input
(:data:`onnx_moe_fuse.contract.ops.QMOE`'s input list) and its semantics were measured on the
target: ORT 1.32 CPU QMoE (``/work/shared/notes/semantics.md``: select by the top-k of
router_probs, weight by the gathered router_weights, renormalised only with
``normalize_routing_weights=1``). ORT CUDA and onnxruntime-webgpu: not established, so the
``logits`` construction.

The nodes need a default-domain opset >= 15 (``Shape`` with ``end``; ``ReduceSum`` with an axes
input); ``ReduceMax`` takes its axes as an input from opset 18 and as an attribute before, which
:func:`build_routing`'s ``opset`` argument picks.

:func:`selection_refusal` checks a concrete selection and weights (the verifier's and the tests'
gate: negative or non-finite weights, duplicate or out-of-range experts are not expressible);
:func:`value_refusal` checks the graph values' dtypes and shapes before building. The numpy
twins :func:`reference_routing` (and :func:`reference_output_weights`, the weights ORT then
applies) compute the same arithmetic for tests and the verifier. Error bounds: ``docs/routing.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from onnx_moe_fuse.contract.ops import CONTRIB_OPS, MOE, QMOE
from onnx_moe_fuse.contract.targets import Target, as_target

__all__ = [
    "CONSTRUCTIONS",
    "LOGITS",
    "LOG_FLOOR",
    "ROUTER_WEIGHTS",
    "ROUTER_WEIGHTS_SOURCES",
    "UNSELECTED",
    "RoutingArrays",
    "RoutingInputs",
    "build_routing",
    "construction_for",
    "construction_source",
    "reference_output_weights",
    "reference_routing",
    "selection_refusal",
    "takes_router_weights",
    "value_refusal",
]

#: The construction feeding ``router_probs`` + ``router_weights`` (QMoE input 14).
ROUTER_WEIGHTS = "router_weights"
#: The construction feeding log-weights as ``router_probs`` (any MoE/QMoE), with a rescale.
LOGITS = "logits"
CONSTRUCTIONS: tuple[str, ...] = (ROUTER_WEIGHTS, LOGITS)

#: The lowest logit a selected expert gets (a zero weight's): exp of it is 0 in float16/32.
LOG_FLOOR = -1.0e4
#: The logit of every expert not selected: below :data:`LOG_FLOOR`, so never selected, and
#: representable in float16 (whose largest finite value is 65504).
UNSELECTED = -3.0e4

#: ``(target, op) -> source`` for each pair whose kernel is known to take ``router_weights``
#: with the semantics :data:`ROUTER_WEIGHTS` relies on. Every other pair: not established.
ROUTER_WEIGHTS_SOURCES: dict[tuple[str, str], str] = {
    ("ort-cpu", QMOE.name): (
        "ORT 1.32 CPU (measured, /work/shared/notes/semantics.md: QMoE input 14 router_weights; "
        "top-k of router_probs selects, the gathered router_weights weigh, renormalised only "
        "with normalize_routing_weights=1; tests/rewrites/moe/test_routing_construction.py)"
    ),
}

_NOT_ESTABLISHED = "not established, logits construction"


def _target_name(target: Target | str) -> str:
    return as_target(target).name


def takes_router_weights(op: str, target: Target | str) -> bool:
    """Whether a fused ``op`` node on ``target`` takes ``router_weights`` as measured.

    True only when the op's contract has the input (``contract.ops``) and the pair is in
    :data:`ROUTER_WEIGHTS_SOURCES`. ``KeyError`` for an op the contract does not know.
    """
    contract = CONTRIB_OPS[op]
    name = _target_name(target)
    return "router_weights" in contract.input_names and (name, op) in ROUTER_WEIGHTS_SOURCES


def construction_for(op: str, target: Target | str) -> str:
    """:data:`ROUTER_WEIGHTS` where :func:`takes_router_weights`, else :data:`LOGITS`."""
    if op not in (MOE.name, QMOE.name):
        raise KeyError(f"{op} has no routing (MoE and QMoE do)")
    return ROUTER_WEIGHTS if takes_router_weights(op, target) else LOGITS


def construction_source(op: str, target: Target | str) -> str:
    """Where :func:`construction_for`'s answer comes from, in words."""
    name = _target_name(target)
    if takes_router_weights(op, name):
        return ROUTER_WEIGHTS_SOURCES[(name, op)]
    if "router_weights" not in CONTRIB_OPS[op].input_names:
        return f"{op} has no router_weights input (contract.ops), logits construction"
    return f"{name} {op} router_weights: {_NOT_ESTABLISHED}"


# -- checks ------------------------------------------------------------------------------------


def selection_refusal(idx: npt.ArrayLike, w: npt.ArrayLike, num_experts: int) -> str | None:
    """Why a concrete selection ``idx [..., k]`` with weights ``w [..., k]`` is not expressible.

    None when it is: ``idx`` integer in ``[0, E)`` with distinct experts per row, ``w`` of the
    same shape, finite and non-negative. The reason names the problem and the first row.
    """
    i = np.asarray(idx)
    a = np.asarray(w)
    if not np.issubdtype(i.dtype, np.integer):
        return f"the selection must hold integer expert ids, got dtype {i.dtype}"
    if not (np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16"):
        # (ml_dtypes' bfloat16 is no numpy floating subtype, but a float all the same)
        return f"the weights must be floating point, got dtype {a.dtype}"
    if i.ndim < 2 or i.shape != a.shape:
        return f"selection {i.shape} and weights {a.shape} must share one shape [..., k]"
    if num_experts < 1 or i.shape[-1] > num_experts:
        return f"k = {i.shape[-1]} selected of {num_experts} experts"
    flat_i = i.reshape(-1, i.shape[-1])
    flat_w = a.reshape(-1, a.shape[-1])
    bad = np.argwhere((flat_i < 0) | (flat_i >= num_experts))
    if bad.size:
        r, c = bad[0]
        return f"expert id {flat_i[r, c]} in row {r} is outside [0, {num_experts})"
    srt = np.sort(flat_i, axis=1)
    dup = np.argwhere(srt[:, 1:] == srt[:, :-1])
    if dup.size:
        r, c = dup[0]
        return f"row {r} selects expert {srt[r, c]} twice (a top-k selects distinct experts)"
    bad = np.argwhere(~np.isfinite(flat_w))
    if bad.size:
        r, c = bad[0]
        return f"weight {flat_w[r, c]} in row {r} is not finite"
    bad = np.argwhere(flat_w < 0)
    if bad.size:
        r, c = bad[0]
        return (
            f"weight {flat_w[r, c]} in row {r} is negative: MoE/QMoE weigh experts by "
            f"non-negative weights only"
        )
    return None


_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def value_refusal(idx: ir.Value, w: ir.Value, num_experts: int) -> str | None:
    """Why graph values ``idx``/``w`` cannot feed :func:`build_routing` (dtypes, shapes); or None.

    Unknown dtypes or shapes pass (the caller's proof gives them); known ones must be int64 ids,
    float16/bfloat16/float32 weights, one rank >= 2 with equal static dims, ``k <= E``.
    Non-negativity and distinct ids are the router proof's to show (a TopK's indices are
    distinct).
    """
    if idx.dtype is not None and idx.dtype != ir.DataType.INT64:
        return f"the selection {idx.name!r} is {idx.dtype}, not int64 expert ids"
    if w.dtype is not None and w.dtype not in _FLOATS:
        return f"the weights {w.name!r} are {w.dtype}, not float32, float16 or bfloat16"
    if idx.shape is not None and w.shape is not None:
        if len(idx.shape) != len(w.shape) or len(idx.shape) < 2:
            return f"selection {idx.shape} and weights {w.shape} must share one rank >= 2"
        for a, b in zip(idx.shape, w.shape, strict=True):
            if isinstance(a, int) and isinstance(b, int) and a != b:
                return f"selection {idx.shape} and weights {w.shape} differ"
    k = idx.shape[-1] if idx.shape is not None and len(idx.shape) else None
    if isinstance(k, int) and k > num_experts:
        return f"k = {k} selected of {num_experts} experts"
    return None


# -- the graph construction --------------------------------------------------------------------


@dataclass(frozen=True)
class RoutingInputs:
    """The fused node's routing inputs built by :func:`build_routing`.

    ``router_probs [T, E]`` and ``router_weights [T, E]`` (None for :data:`LOGITS`) feed the
    node's inputs of those names; ``normalize_routing_weights`` is its attribute; ``scale``
    (``[..., 1]``, the shape of ``w`` with ``k`` -> 1: the row sum for logits, the row maximum
    for router_weights; None when the weights sum to one) multiplies the fused output
    (:meth:`rescaled`).
    """

    construction: str
    router_probs: ir.Value
    router_weights: ir.Value | None
    normalize_routing_weights: int
    scale: ir.Value | None

    def inputs(self) -> dict[str, ir.Value]:
        """``{input name: value}`` for ``ContribOp.input_list``."""
        out = {"router_probs": self.router_probs}
        if self.router_weights is not None:
            out["router_weights"] = self.router_weights
        return out

    def attributes(self) -> dict[str, int]:
        """The routing attributes the fused node carries."""
        return {"normalize_routing_weights": self.normalize_routing_weights}

    def rescaled(self, op: Any, output: ir.Value) -> ir.Value:
        """The fused node's ``output`` times :attr:`scale` (``output`` itself when None).

        ``output`` must have the leading shape of ``w`` (the layer's tokens, ``[..., H]``).
        """
        if self.scale is None:
            return output
        return op.Mul(output, self.scale)


def _scalar(op: Any, value: float, dtype: ir.DataType) -> ir.Value:
    return op.Constant(value=ir.tensor(np.array(value, dtype=dtype.numpy())))


def _ints(op: Any, values: list[int]) -> ir.Value:
    return op.Constant(value=ir.tensor(np.array(values, dtype=np.int64)))


def _filled(op: Any, like: ir.Value, value: float, dtype: ir.DataType, last: ir.Value | None):
    """A tensor of ``like``'s shape (its last dim replaced by ``last`` when given) filled."""
    shape = op.Shape(like) if last is None else op.Concat(op.Shape(like, end=-1), last, axis=0)
    return op.ConstantOfShape(shape, value=ir.tensor(np.array([value], dtype=dtype.numpy())))


def build_routing(
    op: Any,
    idx: ir.Value,
    w: ir.Value,
    num_experts: int,
    construction: str,
    *,
    dtype: ir.DataType | None = None,
    weights_sum_to_one: bool = False,
    rank: int | None = None,
    opset: int = 18,
) -> RoutingInputs:
    """Build the fused node's routing inputs for ``idx``/``w`` with ``op`` (a node builder).

    ``op``: onnxscript's ``RewriterContext`` as a rule's ``rewrite`` receives it (``op.Mul``,
    ``op.Constant``, ...; any builder with that interface). ``idx [..., k]`` int64 and
    ``w [..., k]``: the layer's selection and final weights (the caller proves the weights
    non-negative and the ids distinct: :func:`selection_refusal` checks concrete arrays).
    ``dtype``: the weights' (and so router inputs') element type, default ``w.dtype``; the
    fused node needs it to be the activations' dtype (cast ``w`` first otherwise).
    ``rank``: the rank of ``idx`` where ``idx.shape`` does not say; the router inputs are
    reshaped to ``[-1, E]`` unless it is 2. ``weights_sum_to_one``: the caller proved each row
    of ``w`` sums to one, so no rescale (either construction). ``opset``: the
    graph's default-domain opset (>= 15).
    """
    if construction not in CONSTRUCTIONS:
        raise ValueError(f"construction must be one of {CONSTRUCTIONS}, got {construction!r}")
    if opset < 15:
        raise ValueError(f"the routing construction needs opset >= 15, got {opset}")
    dtype = w.dtype if dtype is None else dtype
    if dtype is None:
        raise ValueError(f"the dtype of the weights {w.name!r} is unknown: pass dtype")
    reason = value_refusal(idx, w, num_experts)
    if reason is not None:
        raise ValueError(reason)
    if rank is None and idx.shape is not None:
        rank = len(idx.shape)
    experts = _ints(op, [num_experts])

    def flat(v: ir.Value) -> ir.Value:
        return v if rank == 2 else op.Reshape(v, _ints(op, [-1, num_experts]))

    def peak_and_ratio() -> tuple[ir.Value, ir.Value]:
        if opset >= 18:
            peak = op.ReduceMax(w, _ints(op, [-1]), keepdims=1)
        else:
            peak = op.ReduceMax(w, axes=[-1], keepdims=1)
        # a row of zeros divides by the smallest normal number instead of 0 (0 / tiny = 0)
        tiny = float(np.finfo(dtype.numpy()).tiny)
        return peak, op.Div(w, op.Max(peak, _scalar(op, tiny, dtype)))

    if construction == ROUTER_WEIGHTS:
        zeros = _filled(op, idx, 0.0, dtype, experts)
        ones = _filled(op, idx, 1.0, dtype, None)
        probs = op.ScatterElements(zeros, idx, ones, axis=-1)
        if weights_sum_to_one:
            scale, updates = None, w
        else:
            scale, updates = peak_and_ratio()
        weights = op.ScatterElements(zeros, idx, updates, axis=-1)
        return RoutingInputs(ROUTER_WEIGHTS, flat(probs), flat(weights), 0, scale)

    _, ratio = peak_and_ratio()
    logits = op.Max(op.Log(ratio), _scalar(op, LOG_FLOOR, dtype))
    background = _filled(op, idx, UNSELECTED, dtype, experts)
    probs = op.ScatterElements(background, idx, logits, axis=-1)
    scale = None if weights_sum_to_one else op.ReduceSum(w, _ints(op, [-1]), keepdims=1)
    return RoutingInputs(LOGITS, flat(probs), None, 1, scale)


# -- the numpy reference -----------------------------------------------------------------------


@dataclass(frozen=True)
class RoutingArrays:
    """:class:`RoutingInputs` as numpy arrays (:func:`reference_routing`)."""

    construction: str
    router_probs: np.ndarray
    router_weights: np.ndarray | None
    normalize_routing_weights: int
    scale: np.ndarray | None


def reference_routing(
    idx: npt.ArrayLike,
    w: npt.ArrayLike,
    num_experts: int,
    construction: str,
    *,
    weights_sum_to_one: bool = False,
) -> RoutingArrays:
    """The arithmetic of :func:`build_routing` in numpy, in ``w``'s dtype, router as ``[T, E]``.

    ``ValueError`` with :func:`selection_refusal`'s reason for an inexpressible selection.
    """
    if construction not in CONSTRUCTIONS:
        raise ValueError(f"construction must be one of {CONSTRUCTIONS}, got {construction!r}")
    reason = selection_refusal(idx, w, num_experts)
    if reason is not None:
        raise ValueError(reason)
    a = np.asarray(w)
    dt = a.dtype
    i = np.asarray(idx).astype(np.int64).reshape(-1, a.shape[-1])
    a = a.reshape(-1, a.shape[-1])
    shape = (a.shape[0], num_experts)
    peak = a.max(axis=1, keepdims=True)
    ratio = (a / np.maximum(peak, np.finfo(dt).tiny).astype(dt)).astype(dt)
    if construction == ROUTER_WEIGHTS:
        probs = np.zeros(shape, dt)
        np.put_along_axis(probs, i, np.ones_like(a), axis=1)
        weights = np.zeros(shape, dt)
        np.put_along_axis(weights, i, a if weights_sum_to_one else ratio, axis=1)
        scale = None if weights_sum_to_one else peak
        return RoutingArrays(ROUTER_WEIGHTS, probs, weights, 0, scale)
    with np.errstate(divide="ignore"):
        logits = np.maximum(np.log(ratio), dt.type(LOG_FLOOR)).astype(dt)
    probs = np.full(shape, UNSELECTED, dt)
    np.put_along_axis(probs, i, logits, axis=1)
    scale = None if weights_sum_to_one else a.sum(axis=1, keepdims=True, dtype=dt)
    return RoutingArrays(LOGITS, probs, None, 1, scale)


def reference_output_weights(arrays: RoutingArrays, idx: npt.ArrayLike) -> np.ndarray:
    """The weights ``[T, k]`` ORT applies at ``idx`` for ``arrays``, rescale included (float64).

    ORT's routing as measured (semantics.md): ``router_weights`` gathered at the selection
    (normalize 0); logits: softmax over the selected logits renormalised (the unselected ones
    underflow to 0); either times ``scale``. QMoE's skipping of final weights <= 1e-8 is not
    modelled (``docs/routing.md`` bounds it). Equal to ``w`` up to the float rounding of the
    construction: the tests bound the difference.
    """
    i = np.asarray(idx).astype(np.int64)
    i = i.reshape(-1, i.shape[-1])
    if arrays.router_weights is not None:
        p = np.take_along_axis(arrays.router_weights.astype(np.float64), i, axis=1)
    else:
        sel = np.take_along_axis(arrays.router_probs.astype(np.float64), i, axis=1)
        p = np.exp(sel - sel.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
    if arrays.scale is not None:
        p = p * arrays.scale.astype(np.float64)
    return p
