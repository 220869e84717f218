"""The proofs behind the MoE layer rules: from a structural match to a :class:`LayerPlan`.

:func:`analyse_layer` reads the values bound by a ``moe_layer`` pattern and proves, step by step,
that one ``com.microsoft.MoE`` or ``QMoE`` node computes exactly what the matched layer computes.
Every step either adds facts to the plan or raises :class:`Refusal` with a plain-words reason that
names the value or node at fault (these reasons are what ``--explain`` prints). It is a pure
function of the graph and the bindings: the rules call it from ``check`` and again from
``rewrite``, and keep nothing between the two calls.

Steps, in order (the first failing one gives the reason):

1. rank: the token rank ``r`` (2 for ``[T, H]``, 3 for ``[B, S, H]``);
2. routing: TopK over the last axis, ``largest=1``, constant ``k``; the routing form
   (softmax -> top-k -> renormalised, softmax -> top-k as they are, top-k -> softmax) and so
   ``router_probs`` and ``normalize_routing_weights``; sigmoid or raw scores are refused;
3. combine: Unsqueeze/ReduceSum (or MatMul) axes, ``keepdims=0``;
4. experts: each projection's spelling (GroupedMatMul or Gather/Expand/MatMul), its axes and
   Reshape targets proved symbolically, the same TopK indices everywhere, constant weights
   (float, or DequantizeLinear of int4/uint4/int8/uint8 with symmetric zero points), optional
   constant biases, consistent sizes ``E, H, I``;
5. activation: relu / tanh gelu / silu / identity / SwiGLU (gate and linear column selections,
   clamp limit, alpha, beta); exact (Erf) GELU is refused;
6. target: MoE for float weights, QMoE for quantized ones (renormalised routing, relu or SwiGLU
   only), within the requested ops;
7. escapes: the router probabilities and the dequantized weights are used by the layer only.

Steps 1 to 3 and the projections' spellings are per layer form: this module proves the per-slot
form (projections ``[*, k, N]``, :func:`analyse_layer`); :mod:`._moe_rows_analysis` proves the
flattened-rows form of torch.onnx ``batched_mm`` exports with the same routing, weight and bias
steps. Both hand the proved parts to :func:`finish_layer` (sizes, activation, target, escapes).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from ._graph_facts import (
    Dim,
    Refusal,
    attr_float,
    attr_int,
    attr_str,
    const_array,
    const_float,
    const_ints,
    default_opset,
    label,
    lead_dims,
    node_axes,
    normalize_axes,
    product,
    reshape_dims,
    static_last_dim,
    static_rank,
    value_label,
)

__all__ = [
    "ExpertWeights",
    "FC1_PROJECTIONS",
    "LayerPlan",
    "QMOE_ACTIVATIONS",
    "Refusal",
    "Routing",
    "WEIGHT_LAYOUTS",
    "analyse_layer",
    "bound_node",
    "expert_bias",
    "expert_weights",
    "finish_layer",
    "part",
    "refusal_part",
    "refuse",
    "routing_form",
    "with_bias",
]

#: Activations this project's QMoE kernels take (the issue: "ReLU or SwiGLU").
QMOE_ACTIVATIONS = frozenset({"relu", "swiglu"})
#: Activations ORT's CPU MoE runs.
MOE_ACTIVATIONS = frozenset({"relu", "gelu", "silu", "identity", "swiglu"})
_FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
_QUANT_TYPES = {
    ir.DataType.INT4: (4, True),
    ir.DataType.UINT4: (4, False),
    ir.DataType.INT8: (8, True),
    ir.DataType.UINT8: (8, False),
}


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """One expert projection's weights in GroupedMatMul's K-major layout ``[E, K, N]``.

    Float weights keep ``array``; quantized ones keep unsigned QMoE ``codes`` (value =
    ``(code - 2**(bits-1)) * scale``), ``scales`` ``[E, blocks, N]`` and ``block``, the block
    size along K the source declares (0 when it declares none, or one partial block).
    """

    role: str
    value: ir.Value
    shape: tuple[int, int, int]
    dtype: ir.DataType
    array: np.ndarray | None = None
    codes: np.ndarray | None = None
    scales: np.ndarray | None = None
    bits: int = 0
    block: int = 0
    bias: np.ndarray | None = None
    source_nodes: tuple[ir.Node, ...] = ()

    @property
    def per_channel(self) -> bool:
        """True when the scales can be one per expert and output channel (a single block)."""
        return self.scales is not None and self.scales.shape[1] == 1

    @property
    def quantized(self) -> bool:
        """True for DequantizeLinear weights."""
        return self.codes is not None

    def describe(self) -> str:
        """E.g. ``int4 blocked 32`` or ``float``."""
        if not self.quantized:
            return "float"
        if self.block and not self.per_channel:
            return f"{self.bits}-bit blocked {self.block}"
        if self.block:
            return f"{self.bits}-bit per channel (one block of {self.block})"
        return f"{self.bits}-bit per channel"


@dataclass(frozen=True, eq=False)
class LayerPlan:
    """Everything the rewrite needs to emit one fused node (computed, never stored)."""

    op: str
    root: ir.Node
    topk: ir.Node
    tokens: ir.Value
    router_probs: ir.Value
    rank: int
    num_experts: int
    k: int
    hidden: int
    inter: int
    normalize: int
    activation: str
    fc1: tuple[ExpertWeights, ...]
    fc1_columns: np.ndarray
    fc2: ExpertWeights
    alpha: float = 1.0
    beta: float = 0.0
    limit: float | None = None
    bits: int = 0
    block: int = 0
    layer_nodes: tuple[ir.Node, ...] = field(default=())

    @property
    def quantized(self) -> bool:
        """True when the layer becomes a QMoE."""
        return self.op == "QMoE"

    def attributes(self) -> dict[str, Any]:
        """Every attribute of the emitted node, written explicitly."""
        swiglu = self.activation == "swiglu"
        attrs: dict[str, Any] = {
            "k": int(self.k),
            "activation_type": self.activation,
            "normalize_routing_weights": int(self.normalize),
            "use_sparse_mixer": 0,
            "swiglu_fusion": 1 if swiglu else 0,
            "activation_alpha": float(self.alpha),
            "activation_beta": float(self.beta),
            "swiglu_limit": float(self.limit) if self.limit is not None else math.inf,
        }
        if self.quantized:
            attrs["expert_weight_bits"] = int(self.bits)
            attrs["block_size"] = int(self.block)
        return attrs


# ---------------------------------------------------------------------------------------------


def refuse(reason: str, *sources: ir.Node | ir.Value | None) -> Refusal:
    """A :class:`Refusal` with ``reason``, naming the nodes/values given (None ones skipped)."""
    return Refusal(reason, *[s for s in sources if s is not None])


#: The parts of a layer a refusal can name, in the order a layer proof checks them.
PARTS = ("tokens", "routing", "fc1", "activation", "fc2", "combine", "weights", "target", "region")


@contextmanager
def part(name: str) -> Iterator[None]:
    """Tag a :class:`Refusal` raised inside with the layer ``part`` it is about.

    The innermost tag wins, so a shared step (``routing_form``) tags its own refusals and a
    caller's broader tag does not overwrite them. Reports and ``--explain`` print the part.
    """
    assert name in PARTS, name
    try:
        yield
    except Refusal as refusal:
        if getattr(refusal, "part", None) is None:
            refusal.part = name  # type: ignore[attr-defined]
        raise


def refusal_part(refusal: Refusal) -> str | None:
    """The layer part a refusal names (None for one raised outside any :func:`part`)."""
    return getattr(refusal, "part", None)


def bound_node(b: Mapping[str, Any], name: str) -> ir.Node | None:
    """The producer of the value bound to ``name``, or None."""
    v = b.get(name)
    return v.producer() if isinstance(v, ir.Value) else None


def _is_last_axis(axis: int | None, rank: int) -> bool:
    return axis is not None and axis in (-1, rank - 1)


# -- 1. rank -----------------------------------------------------------------------------------


def _token_rank(b: Mapping[str, Any]) -> int:
    tokens: ir.Value = b["tokens"]
    for v in (tokens, b.get("router_scores"), b.get("topk_values"), b.get("layer_out")):
        r = static_rank(v)
        if r is not None:
            break
    else:
        r = None
    if r is None:
        # the combine's non-negative ReduceSum axis names the k axis, r - 1
        root = bound_node(b, "layer_out")
        if root is not None and root.op_type == "ReduceSum":
            axes = node_axes(root)
            if axes and len(axes) == 1 and axes[0] >= 0:
                r = axes[0] + 1
    if r is None:
        raise refuse(
            f"cannot tell the rank of the tokens '{value_label(tokens)}' (no declared shape and "
            "no constant that fixes it)",
            tokens,
        )
    if r not in (2, 3):
        raise refuse(
            f"the tokens '{value_label(tokens)}' have rank {r}; MoE/QMoE take [tokens, H] or "
            "[batch, seq, H]",
            tokens,
        )
    return r


# -- 2. routing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Routing:
    """The proved routing: the TopK, k, what MoE/QMoE read as router_probs, the normalisation."""

    topk: ir.Node
    k: int
    router_probs: ir.Value
    normalize: int
    internal_scores: ir.Node | None  # the Softmax that becomes part of the fused node


def routing_form(b: Mapping[str, Any], r: int, opset: int) -> Routing:
    """Step 2: the routing TopK over the experts of rank-``r`` scores and its weight form."""
    with part("routing"):
        return _routing_form(b, r, opset)


def _routing_form(b: Mapping[str, Any], r: int, opset: int) -> Routing:
    topk_values: ir.Value = b["topk_values"]
    topk = topk_values.producer()
    assert topk is not None
    if topk.outputs[1] is not b.get("topk_indices"):
        raise refuse("the routing TopK's indices are not bound", topk)
    if not _is_last_axis(attr_int(topk, "axis", -1), r):
        raise refuse(
            f"TopK '{label(topk)}' selects along axis {attr_int(topk, 'axis', -1)}, not over the "
            "experts (last axis)",
            topk,
        )
    if attr_int(topk, "largest", 1) != 1:
        raise refuse(f"TopK '{label(topk)}' takes the smallest values (largest=0)", topk)
    k_values = const_ints(b.get("topk_k"))
    if not k_values or len(k_values) != 1 or k_values[0] < 1:
        raise refuse(f"TopK '{label(topk)}' has no constant k >= 1", topk)
    k = k_values[0]

    scores: ir.Value = b["router_scores"]
    producer = scores.producer()
    form = b.get("weight_form")
    if form == "softmax_k":
        sm = bound_node(b, "routing_weights")
        if sm is None or not _is_last_axis(attr_int(sm, "axis", -1 if opset >= 13 else 1), r):
            raise refuse(
                f"the Softmax over the top-k values '{label(sm)}' is not over the k axis", sm
            )
        # Softmax over the k selected scores == MoE/QMoE's top-k of router_probs with the k
        # weights renormalised, whatever produced the scores.
        return Routing(topk, k, scores, 1, None)

    if producer is not None and producer.op_type == "Sigmoid":
        raise refuse(
            f"sigmoid routing: the top-k scores come from Sigmoid '{label(producer)}', not Softmax; "
            "MoE and QMoE softmax the router logits and cannot express sigmoid scores (that "
            "needs router_weights)",
            producer,
        )
    if producer is None or producer.op_type != "Softmax":
        what = "a graph input" if producer is None else f"{producer.op_type} '{label(producer)}'"
        raise refuse(
            f"the top-k weights are not softmax probabilities: TopK '{label(topk)}' reads "
            f"'{value_label(scores)}' ({what}) and its values are combined "
            + ("after renormalising" if form != "as_is" else "as they are"),
            topk,
        )
    if not _is_last_axis(attr_int(producer, "axis", -1 if opset >= 13 else 1), r):
        raise refuse(f"Softmax '{label(producer)}' is not over the experts (last axis)", producer)
    logits = producer.inputs[0]
    assert logits is not None
    if form in ("renorm_div", "renorm_reciprocal"):
        s = bound_node(b, "renorm_sum")
        if s is None:
            raise refuse("the renormalising ReduceSum is missing", topk)
        axes = node_axes(s)
        if axes is None or len(axes) != 1 or not _is_last_axis(axes[0], r):
            raise refuse(
                f"ReduceSum '{label(s)}' does not sum the k routing weights (axes {axes})", s
            )
        if attr_int(s, "keepdims", 1) != 1:
            raise refuse(f"ReduceSum '{label(s)}' drops the summed axis (keepdims=0)", s)
        return Routing(topk, k, logits, 1, producer)
    if form == "as_is":
        return Routing(topk, k, logits, 0, producer)
    raise refuse(f"unknown routing form {form!r}", topk)


# -- 3. combine --------------------------------------------------------------------------------


def _combine(b: Mapping[str, Any], r: int, combine: str, hidden: int) -> ir.Node:
    out: ir.Value = b["layer_out"]
    root = out.producer()
    assert root is not None
    unsq = bound_node(b, "routing_weights_unsq")
    assert unsq is not None
    if combine == "reduce_sum":
        axes = node_axes(unsq)
        if axes is None or normalize_axes(axes, r + 1) != [r]:
            raise refuse(
                f"Unsqueeze '{label(unsq)}' does not add a trailing axis to the routing weights "
                f"(axes {axes})",
                unsq,
            )
        axes = node_axes(root)
        if axes is None or normalize_axes(axes, r + 1) != [r - 1]:
            raise refuse(
                f"ReduceSum '{label(root)}' does not sum over the k axis (axes {axes})", root
            )
        if attr_int(root, "keepdims", 1) != 0:
            raise refuse(f"ReduceSum '{label(root)}' keeps the k axis (keepdims=1)", root)
        return root
    # MatMul combine: Unsqueeze(w, k-1 axis) [*, 1, k] @ expert_out [*, k, H] -> [*, 1, H]
    axes = node_axes(unsq)
    if axes is None or normalize_axes(axes, r + 1) != [r - 1]:
        raise refuse(
            f"Unsqueeze '{label(unsq)}' does not make the routing weights a row vector per token "
            f"(axes {axes})",
            unsq,
        )
    if root.op_type == "Squeeze":
        axes = node_axes(root)
        if axes is None or normalize_axes(axes, r + 1) != [r - 1]:
            raise refuse(f"Squeeze '{label(root)}' does not drop the unit axis (axes {axes})", root)
        return root
    shape = const_ints(root.inputs[1])
    lead = lead_dims(b["tokens"], r - 1)
    h = Dim.of(hidden)
    got = None if shape is None else reshape_dims([*lead, Dim.of(1), h], shape)
    if got != [*lead, h]:
        raise refuse(
            f"Reshape '{label(root)}' (shape {shape}) does not drop the unit axis of the combine "
            f"(from {_dims([*lead, Dim.of(1), h])} it must make {_dims([*lead, h])})",
            root,
        )
    return root


def _dims(dims: list[Dim]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


# -- 4. experts --------------------------------------------------------------------------------


#: Stacked expert weight layouts: ``"kn"`` is ``[E, K, N]`` (GroupedMatMul, Gather + MatMul with
#: the rows on the left), ``"nk"`` is ``[E, N, K]`` (output-major, as MoE/QMoE store them and as
#: torch's ``bmm(W[ids], x[..., None])`` reads them).
WEIGHT_LAYOUTS = ("kn", "nk")


def expert_weights(role: str, w: ir.Value | None, layout: str = "kn") -> ExpertWeights:
    """Prove ``w`` constant stacked expert weights in ``layout``; return them K-major.

    Float weights must be an initializer or a Constant; quantized ones a standard
    ``DequantizeLinear`` of constants (see :func:`_dequantized`). Whatever ``layout`` the source
    uses, the result is in GroupedMatMul's ``[E, K, N]`` (an ``"nk"`` source is transposed).
    """
    assert layout in WEIGHT_LAYOUTS
    if w is None:
        raise refuse(f"{role} expert weights are missing")
    if w.is_graph_input():
        raise refuse(
            f"{role} expert weights not constant: '{value_label(w)}' is a graph input, so they "
            "cannot be repacked into the fused layout at fusion time",
            w,
        )
    arr = const_array(w)
    if arr is not None:
        if arr.ndim != 3:
            raise refuse(
                f"{role} expert weights '{value_label(w)}' are not [E, {', '.join(layout.upper())}]",
                w,
            )
        dtype = ir.DataType.from_numpy(arr.dtype)
        if dtype not in _FLOAT_TYPES:
            raise refuse(
                f"{role} expert weights '{value_label(w)}' have type {dtype.name}; MoE takes "
                "float32/float16",
                w,
            )
        if layout == "nk":
            arr = arr.transpose(0, 2, 1)
        return ExpertWeights(role, w, tuple(arr.shape), dtype, array=arr)  # type: ignore[arg-type]
    node = w.producer()
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        what = "a graph input" if node is None else f"computed by {node.op_type} '{label(node)}'"
        raise refuse(
            f"{role} expert weights not constant: '{value_label(w)}' is {what}, so they cannot "
            "be repacked into the fused layout at fusion time",
            w,
        )
    return _dequantized(role, w, node, layout)


def _dequantized(role: str, w: ir.Value, dq: ir.Node, layout: str) -> ExpertWeights:
    """Quantized weights ``DequantizeLinear(q, scale, zero_point?)``, K-major codes and scales.

    An ``"nk"`` source (``q`` ``[E, N, K]``) is read as its K-major transpose: ``q`` and 3-D
    scales swap their last two axes and the DequantizeLinear axis 1 / 2 is read as 2 / 1.
    """
    x_v = dq.inputs[0]
    s_v = dq.inputs[1] if len(dq.inputs) > 1 else None
    z_v = dq.inputs[2] if len(dq.inputs) > 2 else None
    q, s = const_array(x_v), const_array(s_v)
    z = const_array(z_v) if z_v is not None else None
    if q is None or s is None or (z_v is not None and z is None):
        raise refuse(
            f"{role} quantized weights not constant: an input of DequantizeLinear '{label(dq)}' "
            "is not an initializer",
            dq,
        )
    qtype = x_v.dtype if x_v is not None and x_v.dtype is not None else None
    if qtype is None:
        qtype = ir.DataType.from_numpy(q.dtype)
    if qtype not in _QUANT_TYPES:
        raise refuse(
            f"{role} weights are {qtype.name} behind DequantizeLinear '{label(dq)}'; QMoE takes "
            "int4/uint4/int8/uint8",
            dq,
        )
    bits, signed = _QUANT_TYPES[qtype]
    dims = ", ".join(layout.upper())
    if q.ndim != 3:
        raise refuse(f"{role} quantized weights of '{label(dq)}' are not [E, {dims}]", dq)
    axis = attr_int(dq, "axis", 1)
    assert axis is not None
    if not -3 <= axis < 3:
        raise refuse(f"DequantizeLinear '{label(dq)}' has axis {axis} on rank-3 weights", dq)
    ax = axis % 3  # from here on, in K-major terms: 0 experts, 1 K, 2 N
    if layout == "nk":
        q = q.transpose(0, 2, 1)
        s = s.transpose(0, 2, 1) if s.ndim == 3 else s
        ax = (0, 2, 1)[ax]
    e, kk, n = q.shape
    out_dtype = attr_int(dq, "output_dtype", 0) or 0
    dtype = ir.DataType(out_dtype) if out_dtype else ir.DataType.from_numpy(s.dtype)
    if dtype not in _FLOAT_TYPES or ir.DataType.from_numpy(s.dtype) != dtype:
        raise refuse(f"{role} scales of '{label(dq)}' are {s.dtype}; QMoE takes float scales", dq)
    block = attr_int(dq, "block_size", 0) or 0
    if block:
        if ax != 1:
            raise refuse(
                f"{role} weights are blocked along axis {axis} by '{label(dq)}'; QMoE blocks "
                f"along the reduction axis K (axis {1 if layout == 'kn' else 2} of [E, {dims}])",
                dq,
            )
        if s.shape != (e, -(-kk // block), n):
            raise refuse(f"{role} scales of '{label(dq)}' have shape {s.shape}", dq)
        scales = s
        if kk % block:
            if block < kk:
                raise refuse(
                    f"{role} block size {block} does not divide K = {kk} ('{label(dq)}')", dq
                )
            block = 0  # one partial block over K: one scale per expert and output channel
    elif s.ndim == 0 or s.size == 1:
        scales = np.broadcast_to(s.reshape(1, 1, 1), (e, 1, n))
    elif s.ndim == 1:
        if ax == 2 and s.shape == (n,):
            scales = np.broadcast_to(s.reshape(1, 1, n), (e, 1, n))
        elif ax == 0 and s.shape == (e,):
            scales = np.broadcast_to(s.reshape(e, 1, 1), (e, 1, n))
        else:
            raise refuse(
                f"{role} weights have one scale per input channel (axis {axis}) in "
                f"'{label(dq)}'; QMoE scales are per output channel or blocked along K",
                dq,
            )
    else:
        raise refuse(f"{role} scales of '{label(dq)}' have shape {s.shape}", dq)
    sym = 0 if signed else 1 << (bits - 1)
    if z is None:
        zp_ok = signed
        zp_text = "none (which means 0)"
    else:
        zp_ok = bool(np.all(np.asarray(z).astype(np.int64) == sym))
        bad = np.asarray(z).astype(np.int64)
        bad = bad[bad != sym]
        zp_text = f"e.g. {int(bad.reshape(-1)[0])}" if bad.size else str(sym)
    if not zp_ok:
        raise refuse(
            f"asymmetric zero point: {role} weights ({qtype.name}, DequantizeLinear "
            f"'{label(dq)}') have zero points {zp_text}, not the symmetric {sym}; the QMoE "
            "kernels take symmetric weights only",
            dq,
        )
    codes = (q.astype(np.int16) - sym + (1 << (bits - 1))).astype(np.uint8)
    return ExpertWeights(
        role,
        w,
        (e, kk, n),
        dtype,
        codes=codes,
        scales=np.ascontiguousarray(scales),
        bits=bits,
        block=block,
        source_nodes=(dq,),
    )


def expert_bias(
    role: str, bv: ir.Value | None, e: int, n: int, dtype: ir.DataType
) -> np.ndarray | None:
    """The constant per-expert bias ``[E, N]`` bound to ``bv`` (None when absent)."""
    if bv is None:
        return None
    arr = const_array(bv)
    if arr is None:
        raise refuse(f"{role} expert bias '{value_label(bv)}' is not constant", bv)
    if arr.shape != (e, n):
        raise refuse(
            f"{role} expert bias '{value_label(bv)}' has shape {arr.shape}, not {(e, n)}", bv
        )
    if ir.DataType.from_numpy(arr.dtype) != dtype:
        raise refuse(f"{role} expert bias '{value_label(bv)}' has type {arr.dtype}", bv)
    return arr


def _expert(
    b: Mapping[str, Any], tag: str, role: str, r: int, k: int, topk_idx: ir.Value, per_slot: bool
) -> ExpertWeights:
    """Prove one projection ``[*, k, N]`` of the selected experts; return its weights."""
    idx = b.get(f"{tag}_indices")
    if idx is not topk_idx:
        raise refuse(
            f"{role} selects experts with '{value_label(idx)}', not the routing TopK's indices "
            f"'{value_label(topk_idx)}'",
            idx,
        )
    ew = expert_weights(role, b.get(f"{tag}_weight"))
    e, kk, n = ew.shape
    lead = lead_dims(b["tokens"], r - 1)  # concrete where a static export fixes them
    kd = Dim.of(k)
    gmm = bound_node(b, f"{tag}_gmm")
    if gmm is not None:
        if not per_slot:
            if r != 2:
                raise refuse(f"{role}: GroupedMatMul takes rank-2 tokens [M, K]", gmm)
        else:
            rows, ridx, unflat = (
                bound_node(b, f"{tag}_{s}") for s in ("rows", "row_idx", "unflat")
            )
            assert rows is not None and ridx is not None and unflat is not None
            checks = [
                (rows, [*lead, kd, Dim.of(kk)], [product(lead) * kd, Dim.of(kk)]),
                (ridx, [*lead, kd], [product(lead) * kd, Dim.of(1)]),
                (unflat, [product(lead) * kd, Dim.of(1), Dim.of(n)], [*lead, kd, Dim.of(n)]),
            ]
            for node, dims_in, want in checks:
                shape = const_ints(node.inputs[1])
                got = None
                if shape is not None:
                    got = reshape_dims(dims_in, shape, attr_int(node, "allowzero", 0) or 0)
                if got != want:
                    raise refuse(
                        f"{role}: Reshape '{label(node)}' (shape {shape}) does not flatten or "
                        f"restore the (token, slot) rows consistently (from {_dims(dims_in)} it "
                        f"must make {_dims(want)})",
                        node,
                    )
        bias = expert_bias(role, b.get(f"{tag}_bias"), e, n, ew.dtype)
        return with_bias(ew, bias)

    gather = bound_node(b, f"{tag}_gather")
    mm = bound_node(b, f"{tag}_matmul")
    lhs_unsq = bound_node(b, f"{tag}_lhs_unsq")
    drop = bound_node(b, f"{tag}_drop")
    assert gather is not None and mm is not None and lhs_unsq is not None and drop is not None
    if attr_int(gather, "axis", 0) != 0:
        raise refuse(
            f"{role}: Gather '{label(gather)}' does not select along the expert axis", gather
        )
    axes = node_axes(lhs_unsq)
    if per_slot:
        # [*, k, K] -> [*, k, 1, K]
        if axes is None or normalize_axes(axes, r + 2) != [r]:
            raise refuse(
                f"{role}: Unsqueeze '{label(lhs_unsq)}' does not add the row axis (axes {axes})",
                lhs_unsq,
            )
        if bound_node(b, f"{tag}_expand") is not None:
            raise refuse(f"{role}: unexpected Expand of the per-slot inputs", mm)
    else:
        # [*, K] -> [*, 1, 1, K] (-> Expand [*, k, 1, K])
        if axes is None or sorted(normalize_axes(axes, r + 2) or []) != [r - 1, r]:
            raise refuse(
                f"{role}: Unsqueeze '{label(lhs_unsq)}' does not add the slot and row axes "
                f"(axes {axes})",
                lhs_unsq,
            )
        expand = bound_node(b, f"{tag}_expand")
        if expand is not None:
            shape = const_ints(expand.inputs[1])
            if shape is None or len(shape) > r + 2:
                raise refuse(
                    f"{role}: Expand '{label(expand)}' has no usable constant shape", expand
                )
            padded = [1] * (r + 2 - len(shape)) + shape
            # a static export writes the token dims in: each is 1 or that dim of the tokens
            ok = all(v == 1 or Dim.of(v) == d for v, d in zip(padded[: r - 1], lead, strict=True))
            ok = ok and padded[r - 1] in (1, k)
            ok = ok and padded[r] == 1 and padded[r + 1] in (1, kk)
            if not ok:
                raise refuse(
                    f"{role}: Expand '{label(expand)}' (shape {shape}) does not just repeat each "
                    "token over the k slots",
                    expand,
                )
    if drop.op_type == "Squeeze":
        axes = node_axes(drop)
        if axes is None or normalize_axes(axes, r + 2) != [r]:
            raise refuse(f"{role}: Squeeze '{label(drop)}' does not drop the row axis", drop)
    else:
        shape = const_ints(drop.inputs[1])
        got = None
        if shape is not None:
            got = reshape_dims(
                [*lead, kd, Dim.of(1), Dim.of(n)], shape, attr_int(drop, "allowzero", 0) or 0
            )
        if got != [*lead, kd, Dim.of(n)]:
            raise refuse(
                f"{role}: Reshape '{label(drop)}' (shape {shape}) does not just drop the row axis "
                f"(from {_dims([*lead, kd, Dim.of(1), Dim.of(n)])} it must make "
                f"{_dims([*lead, kd, Dim.of(n)])})",
                drop,
            )
    bias = None
    bg = bound_node(b, f"{tag}_bias_gather")
    if bg is not None:
        if attr_int(bg, "axis", 0) != 0:
            raise refuse(
                f"{role}: bias Gather '{label(bg)}' does not select along the expert axis", bg
            )
        if b.get(f"{tag}_bias_indices") is not topk_idx:
            raise refuse(f"{role}: the bias is selected with other indices than the weights", bg)
        bias = expert_bias(role, b.get(f"{tag}_bias"), e, n, ew.dtype)
    return with_bias(ew, bias)


def with_bias(ew: ExpertWeights, bias: np.ndarray | None) -> ExpertWeights:
    """``ew`` with its proved bias attached."""
    if bias is None:
        return ew
    return ExpertWeights(
        ew.role,
        ew.value,
        ew.shape,
        ew.dtype,
        array=ew.array,
        codes=ew.codes,
        scales=ew.scales,
        bits=ew.bits,
        block=ew.block,
        bias=bias,
        source_nodes=ew.source_nodes,
    )


# -- 5. activation -----------------------------------------------------------------------------


def _elementwise_activation(b: Mapping[str, Any]) -> str:
    tag = b.get("activation")
    act: ir.Value = b["act"]
    node = act.producer()
    if tag == "relu":
        return "relu"
    if tag == "identity":
        return "identity"
    if tag in ("silu_mul", "silu_mul_r"):
        return "silu"
    if tag == "swish":
        alpha = attr_float(node, "alpha", 1.0) if node is not None else None
        if alpha != 1.0:
            raise refuse(f"Swish '{label(node)}' has alpha {alpha}; MoE's silu has alpha 1", node)
        return "silu"
    if tag == "fast_gelu":
        return "gelu"
    if tag == "gelu":
        assert node is not None
        approx = attr_str(node, "approximate", "none")
        if approx == "tanh":
            return "gelu"
        raise refuse(
            f"exact GELU: Gelu '{label(node)}' computes the erf form (approximate='{approx}'); "
            "ORT's MoE 'gelu' is the tanh approximation, 1e-4 to 3e-4 apart, so fusing would "
            "change the numbers",
            node,
        )
    if tag in ("erf_gelu", "ms_gelu"):
        raise refuse(
            f"exact GELU: the activation '{value_label(act)}' is the erf form of GELU "
            "(x * 0.5 * (1 + Erf(x / sqrt 2))); ORT's MoE 'gelu' is the tanh approximation, so "
            "fusing would change the numbers",
            node,
        )
    raise refuse(f"unknown activation form {tag!r}", node)


def _columns(src: ir.Value, fc1_out: ir.Value, n1: int, last: int, role: str) -> np.ndarray:
    """Which FC1 output columns the gate / linear operand ``src`` selects.

    ``last`` is FC1's feature axis (its output has rank ``last + 1``).
    """
    node = src.producer()
    if node is None or node.inputs[0] is not fc1_out:
        raise refuse(f"SwiGLU {role} operand '{value_label(src)}' is not a slice of FC1", src)
    if node.op_type == "Slice":
        starts, ends = const_ints(node.inputs[1]), const_ints(node.inputs[2])
        axes_v = node.inputs[3] if len(node.inputs) > 3 else None
        steps_v = node.inputs[4] if len(node.inputs) > 4 else None
        if axes_v is None:  # ONNX default: axes 0, 1, ... len(starts) - 1
            axes = None if starts is None else list(range(len(starts)))
        else:
            axes = const_ints(axes_v)
        steps = [1] if steps_v is None else const_ints(steps_v)
        if None in (starts, ends, axes, steps) or not (
            len(starts) == len(ends) == len(axes) == len(steps) == 1  # type: ignore[arg-type]
        ):
            raise refuse(
                f"SwiGLU {role}: Slice '{label(node)}' is not a constant one-axis slice", node
            )
        if normalize_axes(axes, last + 1) != [last]:  # type: ignore[arg-type]
            raise refuse(f"SwiGLU {role}: Slice '{label(node)}' does not cut the last axis", node)
        if steps[0] <= 0:  # type: ignore[index]
            raise refuse(f"SwiGLU {role}: Slice '{label(node)}' has a non-positive step", node)
        return np.arange(n1)[slice(starts[0], ends[0], steps[0])]  # type: ignore[index]
    if node.op_type == "Split":
        axis = attr_int(node, "axis", 0)
        if normalize_axes([axis or 0], last + 1) != [last]:
            raise refuse(f"SwiGLU {role}: Split '{label(node)}' does not cut the last axis", node)
        parts = len(node.outputs)
        split_v = node.inputs[1] if len(node.inputs) > 1 else None
        if split_v is not None:
            sizes = const_ints(split_v)
            if sizes is None or sum(sizes) != n1:
                raise refuse(f"SwiGLU {role}: Split '{label(node)}' sizes are not constant", node)
        else:
            split_attr = node.attributes.get("split")
            if split_attr is not None:
                sizes = [int(v) for v in split_attr.value]
            else:
                if n1 % parts:
                    raise refuse(f"SwiGLU {role}: Split '{label(node)}' is uneven", node)
                sizes = [n1 // parts] * parts
        which = src.index()
        start = sum(sizes[:which])
        return np.arange(start, start + sizes[which])
    raise refuse(f"SwiGLU {role} operand comes from {node.op_type} '{label(node)}'", node)


def _clip_bounds(clip: ir.Node) -> tuple[float | None, float | None]:
    if len(clip.inputs) > 1 or "min" not in clip.attributes:
        lo_v = clip.inputs[1] if len(clip.inputs) > 1 else None
        hi_v = clip.inputs[2] if len(clip.inputs) > 2 else None
        lo = None if lo_v is None else const_float(lo_v)
        hi = None if hi_v is None else const_float(hi_v)
        if (lo_v is not None and lo is None) or (hi_v is not None and hi is None):
            raise refuse(f"Clip '{label(clip)}' has bounds that are not constant", clip)
    else:  # opset < 11: attributes
        lo, hi = attr_float(clip, "min", None), attr_float(clip, "max", None)
    lo = None if lo is not None and math.isinf(lo) and lo < 0 else lo
    hi = None if hi is not None and math.isinf(hi) and hi > 0 else hi
    return lo, hi


def _is_clip(value: ir.Value) -> bool:
    node = value.producer()
    return node is not None and node.op_type == "Clip"


def _swiglu_params(b: Mapping[str, Any]) -> tuple[float, float, float | None]:
    gate_c: ir.Value = b["swiglu_gate"]
    lin_c: ir.Value = b["swiglu_linear"]
    gate_clip = gate_c.producer() if _is_clip(gate_c) else None
    lin_clip = lin_c.producer() if _is_clip(lin_c) else None
    limit = None
    if gate_clip is not None or lin_clip is not None:
        if gate_clip is None or lin_clip is None:
            which = gate_clip or lin_clip
            raise refuse(
                f"SwiGLU clamps only one operand (Clip '{label(which)}'); MoE's swiglu_limit "
                "clamps the gate from above and the linear operand on both sides",
                which,
            )
        g_lo, g_hi = _clip_bounds(gate_clip)
        l_lo, l_hi = _clip_bounds(lin_clip)
        if g_lo is not None or g_hi is None or g_hi <= 0:
            raise refuse(
                f"SwiGLU gate Clip '{label(gate_clip)}' is not min(gate, limit) (bounds "
                f"{g_lo}, {g_hi})",
                gate_clip,
            )
        if l_hi is None or l_lo is None or l_hi != g_hi or l_lo != -g_hi:
            raise refuse(
                f"SwiGLU linear Clip '{label(lin_clip)}' is not clamp(x, -{g_hi}, {g_hi}) "
                f"(bounds {l_lo}, {l_hi})",
                lin_clip,
            )
        limit = float(g_hi)
    alpha = 1.0
    if b.get("alpha_form") == "scaled":
        a = const_float(b.get("swiglu_alpha"))
        if a is None:
            raise refuse("SwiGLU: the Sigmoid's scale factor (alpha) is not a constant scalar")
        alpha = a
    beta = 0.0
    if b.get("beta_form") == "shifted":
        bb = const_float(b.get("swiglu_beta"))
        if bb is None:
            raise refuse("SwiGLU: the linear operand's offset (beta) is not a constant scalar")
        beta = bb
    return alpha, beta, limit


def _granularity(
    fc1: tuple[ExpertWeights, ...], fc2: ExpertWeights, hidden: int, inter: int
) -> tuple[int, int]:
    """One bit width and one block size (0: per output channel) for all the projections.

    A projection with a single block over K can be read either way. 8-bit prefers per channel
    (ORT's block-wise 8-bit QMoE quantises the activations, see semantics.md); 4-bit keeps the
    block size the source declares when every projection declares the same one.
    """
    parts = (*fc1, fc2)
    text = ", ".join(f"{w.role}: {w.describe()}" for w in parts)
    bit_set = {w.bits for w in parts}
    if len(bit_set) != 1:
        raise refuse(
            f"the expert projections have different bit widths ({text}); one QMoE node takes one",
            fc2.value,
        )
    bits = bit_set.pop()
    if bits == 4 and (hidden % 2 or inter % 2):
        raise refuse(f"4-bit QMoE packs pairs along K; H = {hidden}, I = {inter}", fc2.value)
    per_channel = all(w.per_channel for w in parts)
    blocks = {w.block for w in parts}
    common = blocks.pop() if len(blocks) == 1 else 0
    valid = (
        common >= 16 and not common & (common - 1) and not hidden % common and not inter % common
    )
    if per_channel and (bits == 8 or not valid):
        return bits, 0
    if valid and bits == 8:
        # measured (shared/notes/semantics.md): ORT CPU's block-wise 8-bit QMoE quantises the
        # activations to int8 per block, 6e-3 to 2e-2 off the layer it replaces
        raise refuse(
            f"8-bit weights in blocks of {common} along K ({text}): ONNX Runtime's block-wise "
            "8-bit QMoE quantises the activations too, so the fused node would not compute the "
            "same (per-channel 8-bit and every 4-bit form are exact)",
            fc2.value,
        )
    if valid:
        return bits, common
    if common:
        raise refuse(
            f"block size {common} is not usable by QMoE (a power of two >= 16 that divides "
            f"H = {hidden} and I = {inter}) ({text})",
            fc2.value,
        )
    raise refuse(
        f"the expert projections are quantized with different granularity ({text}); one QMoE "
        "node takes one block size",
        fc2.value,
    )


# -- the whole layer ---------------------------------------------------------------------------


#: The FC1 projections of each activation family: (pattern tag, role in the reasons).
FC1_PROJECTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "gated": (("fc1_gate", "FC1 gate"), ("fc1_up", "FC1 up")),
    "fused_gated": (("fc1", "FC1"),),
    "elementwise": (("fc1", "FC1"),),
}


def analyse_layer(
    b: Mapping[str, Any],
    *,
    family: str,
    combine: str,
    emit: frozenset[str],
    matched: Collection[ir.Node] | None = None,
    opset: int | None = None,
) -> LayerPlan:
    """Prove that the matched layer equals one fused node; raise :class:`Refusal` otherwise.

    ``b`` holds the pattern's bindings; ``family`` is ``"gated"`` (separate gate/up experts),
    ``"fused_gated"`` (one FC1 cut into gate/up) or ``"elementwise"``; ``combine`` is
    ``"reduce_sum"``, ``"matmul_squeeze"`` or ``"matmul_reshape"``; ``emit`` the ops allowed;
    ``matched`` the nodes the pattern matched (for the escape check of the dequantized weights;
    None skips it, as ``rewrite`` does once ``check`` has passed).

    This is the per-slot form (projections ``[*, k, N]``); the flattened-rows form of
    torch.onnx ``batched_mm`` exports is :func:`._moe_rows_analysis.analyse_rows_layer`. Both
    end in :func:`finish_layer`.
    """
    root = b["layer_out"].producer()
    graph = root.graph if root is not None else None
    opset = opset if opset is not None else default_opset(graph)
    with part("tokens"):
        r = _token_rank(b)
    routing = routing_form(b, r, opset)
    k = routing.k
    topk_idx = routing.topk.outputs[1]

    with part("fc1"):
        fc1 = tuple(
            _expert(b, tag, role, r, k, topk_idx, False) for tag, role in FC1_PROJECTIONS[family]
        )
    with part("fc2"):
        fc2 = _expert(b, "fc2", "FC2", r, k, topk_idx, True)
    with part("combine"):
        _combine(b, r, combine, fc2.shape[2])
    return finish_layer(
        b,
        family=family,
        emit=emit,
        matched=matched,
        rank=r,
        routing=routing,
        fc1=fc1,
        fc2=fc2,
        fc1_last_axis=r,
    )


def finish_layer(
    b: Mapping[str, Any],
    *,
    family: str,
    emit: frozenset[str],
    matched: Collection[ir.Node] | None,
    rank: int,
    routing: Routing,
    fc1: tuple[ExpertWeights, ...],
    fc2: ExpertWeights,
    fc1_last_axis: int,
) -> LayerPlan:
    """Steps 4 (sizes) to 7 of a layer whose routing and projections are proved.

    Shared by every layer form: ``rank`` is the token rank of the fused node's input,
    ``fc1_last_axis`` the feature axis of FC1's output (``r`` for ``[*, k, N]``, 1 for
    flattened ``[rows, N]``), where the SwiGLU cuts must be.
    """
    root = b["layer_out"].producer()
    r = rank
    k = routing.k
    e, inter, hidden = fc2.shape
    with part("weights"):
        _same_experts(fc1, fc2)
    tokens: ir.Value = b["tokens"]
    with part("tokens"):
        if static_last_dim(tokens) not in (None, hidden):
            raise refuse(
                f"the tokens '{value_label(tokens)}' do not have H = {hidden} features", tokens
            )
    with part("routing"):
        _router_width(routing, e, k)
        _router_rows(routing.router_probs, tokens, hidden)
        if matched is not None and routing.internal_scores is not None:
            _router_scores_stay_inside(routing)
    with part("activation"):
        activation, columns, (alpha, beta, limit) = _activation(b, family, fc1, fc2, fc1_last_axis)
    with part("target"):
        op, bits, block = _target(b, routing, activation, fc1, fc2, emit, hidden, inter)
    with part("region"):
        if matched is not None:
            _weights_stay_inside(fc1, fc2, matched)

    layer_nodes = tuple(
        n
        for n in (routing.internal_scores, *(s for w in (*fc1, fc2) for s in w.source_nodes))
        if n is not None
    )
    return LayerPlan(
        op=op,
        root=root,
        topk=routing.topk,
        tokens=tokens,
        router_probs=routing.router_probs,
        rank=r,
        num_experts=e,
        k=k,
        hidden=hidden,
        inter=inter,
        normalize=routing.normalize,
        activation=activation,
        fc1=fc1,
        fc1_columns=columns,
        fc2=fc2,
        alpha=alpha,
        beta=beta,
        limit=limit,
        bits=bits if op == "QMoE" else 0,
        block=block if op == "QMoE" else 0,
        layer_nodes=layer_nodes,
    )


# -- finish_layer's steps ----------------------------------------------------------------------


def _same_experts(fc1: tuple[ExpertWeights, ...], fc2: ExpertWeights) -> None:
    """FC1's weights are ``[E, H, *]`` with FC2's E and H."""
    e, _, hidden = fc2.shape
    for w in fc1:
        if w.shape[0] != e or w.shape[1] != hidden:
            raise refuse(
                f"{w.role} weights have shape {list(w.shape)} but FC2's are {list(fc2.shape)} "
                "(expected [E, H, ...] with the same E and H)",
                w.value,
            )


def _router_width(routing: Routing, e: int, k: int) -> None:
    router_e = static_last_dim(routing.router_probs)
    if router_e is None:
        raise refuse(
            f"cannot prove that the router '{value_label(routing.router_probs)}' produces "
            f"E = {e} logits per token",
            routing.router_probs,
        )
    if router_e != e:
        raise refuse(
            f"the router produces {router_e} logits per token but there are {e} experts",
            routing.router_probs,
        )
    if not 1 <= k <= e:
        raise refuse(f"TopK k = {k} is not between 1 and E = {e}", routing.topk)


#: Element-wise ops: the row of their output is the row of their input.
_ROW_WISE_UNARY = frozenset({"Cast", "Identity", "Sigmoid", "Tanh", "Relu", "Neg", "Exp"})
#: Ops that keep the row order of a ``[..., H]`` value when they keep its last axis.
_ROW_PRESERVING = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast"})


def _row_source(value: ir.Value, hidden: int | None) -> ir.Value:
    """Walk back through ops that keep the token rows (same elements, same last axis)."""
    for _ in range(16):
        node = value.producer()
        if node is None or node.op_type not in _ROW_PRESERVING or node.domain not in ("", "ai.onnx"):
            return value
        src = node.inputs[0]
        if src is None:
            return value
        if node.op_type in ("Reshape", "Flatten"):
            last = static_last_dim(value)
            if last is None or (hidden is not None and last != static_last_dim(src)):
                return value
        if node.op_type in ("Squeeze", "Unsqueeze"):
            axes = node_axes(node)
            rank = static_rank(value if node.op_type == "Unsqueeze" else src)
            norm = None if axes is None or rank is None else normalize_axes(axes, rank)
            if norm is None or rank - 1 in norm:
                return value
        if node.op_type == "Cast" and static_last_dim(value) != static_last_dim(src):
            return value
        value = src
    return value


def _rows(value: ir.Value) -> tuple | None:
    """The leading (row) dims of ``value``'s declared shape, None when unknown or dynamic."""
    shape = value.shape
    if shape is None or len(shape) < 2:
        return None
    dims = []
    for d in list(shape)[:-1]:
        if isinstance(d, int):
            dims.append(d)
        elif getattr(d, "value", None) is not None:
            dims.append(d.value)
        else:
            return None
    return tuple(dims)


def _router_rows(logits: ir.Value, tokens: ir.Value, hidden: int) -> None:
    """Prove the router logits have one row per token row, in the same order.

    The fused node reads router_probs row i as the routing of token row i. Proved by dataflow
    (the logits are a projection, ``MatMul(x, W)`` with an optional bias ``Add``, of the same
    token rows the experts read, up to row-preserving reshapes) or, for logits that come from
    elsewhere (a graph input), by declared shapes with the same rows.
    """
    src = logits
    for _ in range(8):  # bias, scale, cast or row-wise normalisation around the projection
        node = src.producer()
        if node is None or node.inputs[0] is None or node.domain not in ("", "ai.onnx"):
            break
        if node.op_type in _ROW_WISE_UNARY:
            src = node.inputs[0]
            continue
        if node.op_type in ("Softmax", "LogSoftmax") and attr_int(node, "axis", -1) == -1:
            src = node.inputs[0]
            continue
        if node.op_type in ("Add", "Sub", "Mul", "Div") and len(node.inputs) == 2:
            other = node.inputs[1]
            if other is None or const_array(other) is None:
                break
            src = node.inputs[0]
            continue
        break
    node = src.producer()
    token_root = _row_source(tokens, hidden)
    projection = node is not None and (
        node.op_type == "MatMul" or (node.op_type == "Gemm" and attr_int(node, "transA", 0) == 0)
    )
    if projection and node.inputs[0] is not None:
        reads = node.inputs[0]
        if _row_source(reads, hidden) is token_root:
            return
        raise refuse(
            f"the router {node.op_type} '{label(node)}' reads '{value_label(reads)}', not the token rows "
            f"'{value_label(tokens)}' the experts read: the fused node routes each token by its own "
            "router row, which cannot be proved here",
            node,
        )
    got, want = _rows(logits), _rows(tokens)
    if got is not None and want is not None and math.prod(got) == math.prod(want):
        return
    where = "a graph input" if node is None else f"{node.op_type} '{label(node)}'"
    raise refuse(
        f"cannot prove that the router logits '{value_label(logits)}' ({where}) have one row per "
        f"token of '{value_label(tokens)}'",
        logits,
    )


def _router_scores_stay_inside(routing: Routing) -> None:
    """Standalone rules only (the pipeline's splice keeps an escaping router Softmax)."""
    sm = routing.internal_scores
    assert sm is not None
    scores = sm.outputs[0]
    topk = routing.topk
    if scores.is_graph_output() or any(user is not topk for user, _ in scores.uses()):
        where = (
            "a graph output"
            if scores.is_graph_output()
            else "used by "
            + ", ".join(
                sorted({f"{u.op_type} '{label(u)}'" for u, _ in scores.uses() if u is not topk})
            )
        )
        raise refuse(
            f"the router probabilities '{value_label(scores)}' escape the layer: they are also "
            f"{where}",
            scores,
        )


def _activation(
    b: Mapping[str, Any],
    family: str,
    fc1: tuple[ExpertWeights, ...],
    fc2: ExpertWeights,
    fc1_last_axis: int,
) -> tuple[str, np.ndarray, tuple[float, float, float | None]]:
    """The activation, FC1's columns in the fused node's order, and (alpha, beta, limit)."""
    inter = fc2.shape[1]
    n1 = sum(w.shape[2] for w in fc1)
    if family == "elementwise":
        activation = _elementwise_activation(b)
        if n1 != inter:
            raise refuse(f"FC1 has {n1} outputs but FC2 reads {inter}", fc1[0].value)
        return activation, np.arange(n1), (1.0, 0.0, None)
    params = _swiglu_params(b)
    if family == "gated":
        if fc1[0].shape != fc1[1].shape:
            raise refuse("the gate and up experts have different shapes", fc1[1].value)
        gate_cols = np.arange(fc1[0].shape[2])
        lin_cols = fc1[0].shape[2] + np.arange(fc1[1].shape[2])
    else:
        fc1_out: ir.Value = b["fc1_out"]
        gate_cols = _columns(b["swiglu_gate_src"], fc1_out, n1, fc1_last_axis, "gate")
        lin_cols = _columns(b["swiglu_linear_src"], fc1_out, n1, fc1_last_axis, "linear")
    if len(gate_cols) != inter or len(lin_cols) != inter:
        raise refuse(
            f"the SwiGLU gate/linear operands have {len(gate_cols)}/{len(lin_cols)} columns "
            f"but FC2 reads {inter}",
            fc2.value,
        )
    columns = np.stack([gate_cols, lin_cols], axis=1).reshape(-1)  # row 2j gate, 2j+1 lin
    return "swiglu", columns, params


def _target(
    b: Mapping[str, Any],
    routing: Routing,
    activation: str,
    fc1: tuple[ExpertWeights, ...],
    fc2: ExpertWeights,
    emit: frozenset[str],
    hidden: int,
    inter: int,
) -> tuple[str, int, int]:
    """The fused op (MoE for float weights, QMoE for quantized), its bits and block size."""
    tokens: ir.Value = b["tokens"]
    if tokens.dtype is not None and tokens.dtype != ir.DataType.FLOAT:
        raise refuse(
            f"the tokens '{value_label(tokens)}' are {tokens.dtype.name.lower()}: this version "
            "fuses float32 layers only (float16/bfloat16 layers are left as they are)",
            tokens,
        )
    dtypes = {w.dtype for w in (*fc1, fc2)}
    if len(dtypes) != 1:
        raise refuse("the expert weights do not all have the same float type", fc2.value)
    if dtypes != {ir.DataType.FLOAT}:
        (dtype,) = dtypes
        raise refuse(
            f"the expert weights are {dtype.name.lower()}: this version fuses float32 layers "
            "only (float16/bfloat16 layers are left as they are)",
            fc2.value,
        )
    quant = {w.quantized for w in (*fc1, fc2)}
    if len(quant) != 1:
        raise refuse(
            "some expert weights are quantized and others are float ("
            + ", ".join(f"{w.role}: {w.describe()}" for w in (*fc1, fc2))
            + "); MoE takes float and QMoE quantized weights only",
            fc2.value,
        )
    op = "QMoE" if quant == {True} else "MoE"
    bits = block = 0
    if op == "QMoE":
        bits, block = _granularity(fc1, fc2, hidden, inter)
        if routing.normalize != 1:
            raise refuse(
                f"routing weights not renormalised (TopK '{label(routing.topk)}' values used as "
                "they are): only MoE can express this (normalize_routing_weights=0), but the "
                "expert weights are quantized, which only QMoE takes, and QMoE always renormalises",
                routing.topk,
            )
        if activation not in QMOE_ACTIVATIONS:
            raise refuse(
                f"QMoE takes relu or swiglu in this project's kernels, and the activation is "
                f"{activation}",
                b.get("act") or fc2.value,
            )
    elif activation not in MOE_ACTIVATIONS:  # pragma: no cover - every form above is in the set
        raise refuse(f"MoE cannot run activation {activation}")
    if op not in emit:
        raise refuse(
            f"the layer would fuse into {op}, which is not among the requested ops "
            f"({', '.join(sorted(emit)) or 'none'})",
            routing.topk,
        )
    return op, bits, block


def _weights_stay_inside(
    fc1: tuple[ExpertWeights, ...], fc2: ExpertWeights, matched: Collection[ir.Node]
) -> None:
    """Standalone rules only: the dequantized weights feed the matched layer alone."""
    for w in (*fc1, fc2):
        for node in w.source_nodes:
            out = node.outputs[0]
            bad = [u for u, _ in out.uses() if u not in matched]
            if out.is_graph_output() or bad:
                where = "a graph output" if out.is_graph_output() else f"used by {label(bad[0])}"
                raise refuse(
                    f"the dequantized {w.role} weights '{value_label(out)}' escape the layer: "
                    f"they are also {where}",
                    out,
                )
