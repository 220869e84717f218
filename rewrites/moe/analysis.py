"""The proofs behind the MoE layer rules: from recognised parts to a :class:`LayerPlan`.

:func:`analyse_layer` reads the values the part recognisers bound (``parts.LayerParts.bindings``)
and proves, step by step, that one ``com.microsoft.MoE`` or ``QMoE`` node computes exactly what
the recognised layer computes. Every step either adds facts to the plan or raises a
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` (the one failure type) with a plain-words
reason that names the value or node at fault and, through
:func:`~onnx_moe_fuse.rewrites.graph.refusals.part`, the layer part (these reasons are what
``--explain`` prints). It is a pure function of the graph and the bindings: the
rules call it from ``check`` and again from ``rewrite``, and keep nothing between the two calls.

Steps, in order (the first failing one gives the reason):

1. rank: the token rank ``r`` (2 for ``[T, H]``, 3 for ``[B, S, H]``);
2. routing: TopK over the last axis, ``largest=1``, constant ``k``; the routing form
   (softmax -> top-k -> renormalised, softmax -> top-k as they are, top-k -> softmax) and so
   ``router_probs`` and ``normalize_routing_weights``; sigmoid or raw scores are refused;
3. combine: Unsqueeze/ReduceSum (or MatMul) axes, ``keepdims=0``;
4. experts: each projection's spelling (GroupedMatMul or Gather/Expand/MatMul), its axes and
   Reshape targets proved symbolically, the same TopK indices everywhere, constant weights
   (float, or DequantizeLinear of int4/uint4/int8/uint8, any zero points), optional
   constant biases, consistent sizes ``E, H, I``;
5. activation: relu / tanh gelu / silu / identity / SwiGLU (gate and linear column selections,
   clamp limit, alpha, beta); exact (Erf) GELU is refused; an activation no spelling matched is
   proved by probing (:mod:`.behaviour.activation`);
6. target: MoE for float weights, QMoE for quantized ones (renormalised routing), or for float
   ones quantised on request (:mod:`.quantize`), within the requested ops;
7. escapes (a rule used alone): the router probabilities and the dequantized weights are used by
   the recognised layer only.

Steps 1 to 3 and the projections' spellings are per layer form: this module proves the per-slot
form (projections ``[*, k, N]``, :func:`analyse_layer`); :mod:`.rows_analysis` proves the
flattened-rows form of torch.onnx ``batched_mm`` exports with the same routing, weight and bias
steps. Both hand the proved parts to :func:`finish_layer` (sizes, activation, target, escapes).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import (
    default_opset,
    label,
    static_last_dim,
    value_label,
)
from onnx_moe_fuse.rewrites.graph.refusals import Refusal, part
from onnx_moe_fuse.rewrites.moe.activation_proof import activation_step, granularity
from onnx_moe_fuse.rewrites.moe.parts.facts import HALF_TYPES, precision_cast
from onnx_moe_fuse.rewrites.moe.plan import (
    LAYER_DTYPES,
    MOE_ACTIVATIONS,
    QMOE_ACTIVATIONS,
    ExpertWeights,
    LayerPlan,
    bound_node,
)
from onnx_moe_fuse.rewrites.moe.quantize import Quantization
from onnx_moe_fuse.rewrites.moe.routing_checks import (
    router_rows,
    router_scores_stay_inside,
    router_width,
    selected_routing,
)
from onnx_moe_fuse.rewrites.moe.routing_proof import (
    Routing,
    combine_step,
    routing_form,
    token_rank,
)
from onnx_moe_fuse.rewrites.moe.weights_proof import (
    WEIGHT_LAYOUTS,
    expert,
    expert_bias,
    expert_weights,
    with_bias,
)

__all__ = [
    "ExpertWeights",
    "FC1_PROJECTIONS",
    "LayerPlan",
    "QMOE_ACTIVATIONS",
    "Routing",
    "WEIGHT_LAYOUTS",
    "analyse_layer",
    "bound_node",
    "combine_step",
    "expert_bias",
    "expert_weights",
    "finish_layer",
    "routing_form",
    "with_bias",
]
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
    quantize: Quantization | None = None,
) -> LayerPlan:
    """Prove that the matched layer equals one fused node; raise :class:`Refusal` otherwise.

    ``b`` holds the pattern's bindings; ``family`` is ``"gated"`` (separate gate/up experts),
    ``"fused_gated"`` (one FC1 cut into gate/up) or ``"elementwise"``; ``combine`` is
    ``"reduce_sum"``, ``"matmul_squeeze"`` or ``"matmul_reshape"``; ``emit`` the ops allowed;
    ``matched`` the nodes the pattern matched (for the escape check of the dequantized weights;
    None skips it, as ``rewrite`` does once ``check`` has passed); ``quantize`` the opt-in
    quantisation of a float layer into QMoE (:mod:`.quantize`; None: float layers become MoE).

    This is the per-slot form (projections ``[*, k, N]``); the flattened-rows form of
    torch.onnx ``batched_mm`` exports is :func:`.rows_analysis.analyse_rows_layer`. Both
    end in :func:`finish_layer`.
    """
    root = b["layer_out"].producer()
    graph = root.graph if root is not None else None
    opset = opset if opset is not None else default_opset(graph)
    with part("tokens"):
        r = token_rank(b)
    routing = routing_form(b, r, opset)
    k = routing.k
    topk_idx = routing.topk.outputs[1]

    with part("fc1"):
        fc1 = tuple(
            expert(b, tag, role, r, k, topk_idx, False) for tag, role in FC1_PROJECTIONS[family]
        )
    with part("fc2"):
        fc2 = expert(b, "fc2", "FC2", r, k, topk_idx, True)
    with part("combine"):
        combine_step(b, r, combine, fc2.shape[2])
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
        quantize=quantize,
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
    quantize: Quantization | None = None,
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
            raise Refusal(
                f"the tokens '{value_label(tokens)}' do not have H = {hidden} features", tokens
            )
    with part("routing"):
        router_width(routing, e, k)
        if not routing.selected:
            router_rows(routing.router_probs, tokens, hidden)
        if matched is not None and routing.internal_scores is not None:
            router_scores_stay_inside(routing)
    with part("activation"):
        activation, columns, (alpha, beta, limit) = activation_step(
            b, family, fc1, fc2, fc1_last_axis
        )
    with part("target"):
        op, bits, block, dtype = _target(
            b, routing, activation, fc1, fc2, emit, hidden, inter, quantize
        )
    if op == "QMoE" and routing.normalize != 1 and not routing.selected:
        # QMoE always renormalises its own softmax: weights used as they are go in as the
        # selection and its weights (router_weights, or log-weights and a rescale)
        routing = routing.as_selected(b["routing_weights"])
    half = dtype != ir.DataType.FLOAT or b.get("routing_casts") or _half_router(routing)
    if not routing.selected and half:
        # the node would run the router in its own dtype: router logits rounded to float16
        # can tie, or swap near-ties, where the model's float32 softmax did not (and ORT breaks
        # ties towards the highest index, TopK towards the lowest); a float32 layer whose
        # router logits come from float16 ties as often. Fed as the model's own selection and
        # weights, the experts each token uses are exactly the model's
        routing = routing.as_selected(b["routing_weights"])
    if routing.selected:
        with part("routing"):
            try:
                selected_routing(routing, tokens, root, e, r)
            except Refusal as refusal:
                if routing.not_internal:  # and the probed near miss of the router's own form
                    refusal.reason = (
                        f"{refusal.reason}; as MoE/QMoE's own routing: {routing.not_internal}"
                    )
                raise
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
        selection=routing.topk.outputs[1] if routing.selected else None,
        selected_weights=routing.weights,
        weights_sum_to_one=routing.sums_to_one,
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
        zero_points=_zero_points(op, block, fc1, fc2),
        dtype=dtype,
        out_dtype=b.get("combine_dtype"),
        layer_nodes=layer_nodes,
    )


# -- finish_layer's steps ----------------------------------------------------------------------


def _same_experts(fc1: tuple[ExpertWeights, ...], fc2: ExpertWeights) -> None:
    """FC1's weights are ``[E, H, *]`` with FC2's E and H."""
    e, _, hidden = fc2.shape
    for w in fc1:
        if w.shape[0] != e or w.shape[1] != hidden:
            raise Refusal(
                f"{w.role} weights have shape {list(w.shape)} but FC2's are {list(fc2.shape)} "
                "(expected [E, H, ...] with the same E and H)",
                w.value,
            )


def _target(
    b: Mapping[str, Any],
    routing: Routing,
    activation: str,
    fc1: tuple[ExpertWeights, ...],
    fc2: ExpertWeights,
    emit: frozenset[str],
    hidden: int,
    inter: int,
    quantize: Quantization | None = None,
) -> tuple[str, int, int, ir.DataType]:
    """The fused op (MoE for float weights, QMoE for quantized), its bits, block size, dtype.

    The dtype is the experts' (their weights' and the tokens'): the fused node computes in it.
    Which targets have a kernel for the (op, dtype) pair is the pipeline's question
    (``contract.targets``); the routing of a layer that does not compute in float32 is fed as
    its selection and weights (:func:`finish_layer`). With ``quantize`` a float layer becomes
    QMoE of its weights quantised at emission (:mod:`.quantize`).
    """
    tokens: ir.Value = b["tokens"]
    dtypes = {w.dtype for w in (*fc1, fc2)}
    if len(dtypes) != 1:
        raise Refusal("the expert weights do not all have the same float type", fc2.value)
    (dtype,) = dtypes
    if tokens.dtype is not None and tokens.dtype != dtype:
        raise Refusal(
            f"the tokens '{value_label(tokens)}' are {tokens.dtype.name.lower()} but the expert "
            f"weights {dtype.name.lower()}: a fused node computes in one float type",
            tokens,
        )
    if dtype not in LAYER_DTYPES:
        raise Refusal(
            f"the expert weights are {dtype.name.lower()}: MoE and QMoE compute in float32, "
            "float16 or bfloat16",
            fc2.value,
        )
    quant = {w.quantized for w in (*fc1, fc2)}
    if len(quant) != 1:
        raise Refusal(
            "some expert weights are quantized and others are float ("
            + ", ".join(f"{w.role}: {w.describe()}" for w in (*fc1, fc2))
            + "); MoE takes float and QMoE quantized weights only",
            fc2.value,
        )
    op = "QMoE" if quant == {True} else "MoE"
    bits = block = 0
    if op == "MoE" and quantize is not None:  # opt-in: the float weights quantised at emission
        op, bits, block = "QMoE", quantize.bits, quantize.layer_block(hidden, inter, fc2.value)
    elif op == "QMoE":
        bits, block = granularity(fc1, fc2, hidden, inter)
    if op == "QMoE":
        if activation not in QMOE_ACTIVATIONS:
            raise Refusal(
                f"QMoE cannot run activation {activation}",
                b.get("act") or fc2.value,
            )
    elif activation not in MOE_ACTIVATIONS:  # pragma: no cover - every form above is in the set
        raise Refusal(f"MoE cannot run activation {activation}")
    if op not in emit:
        raise Refusal(
            f"the layer would fuse into {op}, which is not among the requested ops "
            f"({', '.join(sorted(emit)) or 'none'})",
            routing.topk,
        )
    return op, bits, block, dtype


def _half_router(routing: Routing) -> bool:
    """The router logits the node would read are a Cast of float16/bfloat16 values."""
    cast = precision_cast(routing.router_probs)
    return cast is not None and cast.inputs[0].dtype in HALF_TYPES


def _zero_points(
    op: str, block: int, fc1: tuple[ExpertWeights, ...], fc2: ExpertWeights
) -> str | None:
    """The granularity of the layer's asymmetric zero points (None: symmetric weights).

    Whether the target takes them is decided at emission (``contract.targets``), where the
    near miss can name the target.
    """
    if op != "QMoE" or all(w.zero_points is None for w in (*fc1, fc2)):
        return None
    return "block-wise" if block else "per-channel"


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
                raise Refusal(
                    f"the dequantized {w.role} weights '{value_label(out)}' escape the layer: "
                    f"they are also {where}",
                    out,
                )
