"""Proof steps 1-3 of a per-slot layer: the token rank, the routing form, the combine.

The routing form decides ``router_probs`` and ``normalize_routing_weights`` (softmax -> top-k
-> renormalised, as they are, or top-k -> softmax); the combine's axes and shapes are proved on
symbolic dims. Used by :func:`.analysis.analyse_layer` and the rows layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.dims import Dim, reshape_dims
from onnx_moe_fuse.rewrites.graph.facts import (
    attr_int,
    const_ints,
    label,
    node_axes,
    normalize_axes,
    static_rank,
    value_label,
)
from onnx_moe_fuse.rewrites.graph.refusals import Refusal, part
from onnx_moe_fuse.rewrites.graph.symbolic_dims import lead_dims
from onnx_moe_fuse.rewrites.moe.behaviour.routing import softmax_logits
from onnx_moe_fuse.rewrites.moe.parts.routing import SELECTED
from onnx_moe_fuse.rewrites.moe.plan import (
    bound_node,
    is_last_axis,
)

# -- 1. rank -----------------------------------------------------------------------------------


def token_rank(b: Mapping[str, Any]) -> int:
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
        raise Refusal(
            f"cannot tell the rank of the tokens '{value_label(tokens)}' (no declared shape and "
            "no constant that fixes it)",
            tokens,
        )
    if r not in (2, 3):
        raise Refusal(
            f"the tokens '{value_label(tokens)}' have rank {r}; MoE/QMoE take [tokens, H] or "
            "[batch, seq, H]",
            tokens,
        )
    return r


# -- 2. routing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Routing:
    """The proved routing: the TopK, k, what MoE/QMoE read as router_probs, the normalisation.

    ``weights`` is set for the router-agnostic routing (``selected``): the fused node is fed
    the selection's indices and these final weights through the routing construction
    (:mod:`.routing_construction`), the router staying in the graph; ``router_probs`` is then
    the scores the selection TopK reads (for the width check), not a fused input.
    """

    topk: ir.Node
    k: int
    router_probs: ir.Value
    normalize: int
    internal_scores: ir.Node | None  # the Softmax that becomes part of the fused node
    weights: ir.Value | None = None
    sums_to_one: bool = False
    # why the router is not one MoE/QMoE compute themselves (a probed near miss), for the
    # refusal of the router-agnostic routing when that fails too
    not_internal: str | None = None

    @property
    def selected(self) -> bool:
        """True for the router-agnostic routing (fed through the routing construction)."""
        return self.weights is not None

    def as_selected(self, weights: ir.Value) -> Routing:
        """This routing fed as its selection and final ``weights`` (the combine's)."""
        return Routing(self.topk, self.k, self.topk.inputs[0], 0, None, weights)  # type: ignore[arg-type]


def routing_form(b: Mapping[str, Any], r: int, opset: int) -> Routing:
    """Step 2: the routing TopK over the experts of rank-``r`` scores and its weight form."""
    with part("routing"):
        return _routing_form(b, r, opset)


def _routing_form(b: Mapping[str, Any], r: int, opset: int) -> Routing:
    topk, k = _selection(b, r)
    weights: ir.Value = b["routing_weights"]
    if b.get("weight_form") == SELECTED:
        return Routing(topk, k, b["router_scores"], 0, None, weights)
    try:
        return _softmax_routing(b, r, opset, topk, k)
    except Refusal as refusal:
        # not what MoE/QMoE's own softmax computes: fed as its selection and weights instead,
        # which the layer proof checks (moe.selected_weights) and refuses in its own words
        probed = refusal.reason if "probe" in refusal.reason else None  # a probed region
        return Routing(topk, k, b["router_scores"], 0, None, weights, not_internal=probed)


def _selection(b: Mapping[str, Any], r: int) -> tuple[ir.Node, int]:
    """The routing TopK over the experts (last axis, largest, constant k) and its k."""
    topk_values: ir.Value = b["topk_values"]
    topk = topk_values.producer()
    assert topk is not None
    if topk.outputs[1] is not b.get("topk_indices"):
        raise Refusal("the routing TopK's indices are not bound", topk)
    if not is_last_axis(attr_int(topk, "axis", -1), r):
        raise Refusal(
            f"TopK '{label(topk)}' selects along axis {attr_int(topk, 'axis', -1)}, not over the "
            "experts (last axis)",
            topk,
        )
    if attr_int(topk, "largest", 1) != 1:
        raise Refusal(f"TopK '{label(topk)}' takes the smallest values (largest=0)", topk)
    k_values = const_ints(b.get("topk_k"))
    if not k_values or len(k_values) != 1 or k_values[0] < 1:
        raise Refusal(f"TopK '{label(topk)}' has no constant k >= 1", topk)
    return topk, k_values[0]


def _softmax_routing(b: Mapping[str, Any], r: int, opset: int, topk: ir.Node, k: int) -> Routing:
    """The routing forms MoE/QMoE compute themselves from the router logits."""
    scores: ir.Value = b["router_scores"]
    producer = scores.producer()
    form = b.get("weight_form")
    probed = bool(b.get("weights_by_behaviour"))  # the weights' region was probed (axes too)
    if form == "softmax_k":
        sm = bound_node(b, "routing_weights")
        if not probed and (
            sm is None or not is_last_axis(attr_int(sm, "axis", -1 if opset >= 13 else 1), r)
        ):
            raise Refusal(
                f"the Softmax over the top-k values '{label(sm)}' is not over the k axis", sm
            )
        # Softmax over the k selected scores == MoE/QMoE's top-k of router_probs with the k
        # weights renormalised, whatever produced the scores.
        return Routing(topk, k, scores, 1, None, sums_to_one=True)

    if producer is not None and producer.op_type == "Sigmoid":
        raise Refusal(
            f"sigmoid routing: the top-k scores come from Sigmoid '{label(producer)}', not Softmax; "
            "MoE and QMoE softmax the router logits and cannot express sigmoid scores (that "
            "needs router_weights)",
            producer,
        )
    if producer is None or producer.op_type != "Softmax":
        logits = _written_softmax(scores, r, topk, form)
    else:
        if not is_last_axis(attr_int(producer, "axis", -1 if opset >= 13 else 1), r):
            raise Refusal(
                f"Softmax '{label(producer)}' is not over the experts (last axis)", producer
            )
        logits = producer.inputs[0]
    assert logits is not None and producer is not None
    if form in ("renorm_div", "renorm_reciprocal") and probed:
        return Routing(topk, k, logits, 1, producer, sums_to_one=True)
    if form in ("renorm_div", "renorm_reciprocal"):
        s = bound_node(b, "renorm_sum")
        if s is None:
            raise Refusal("the renormalising ReduceSum is missing", topk)
        axes = node_axes(s)
        if axes is None or len(axes) != 1 or not is_last_axis(axes[0], r):
            raise Refusal(
                f"ReduceSum '{label(s)}' does not sum the k routing weights (axes {axes})", s
            )
        if attr_int(s, "keepdims", 1) != 1:
            raise Refusal(f"ReduceSum '{label(s)}' drops the summed axis (keepdims=0)", s)
        return Routing(topk, k, logits, 1, producer, sums_to_one=True)
    if form == "as_is":
        return Routing(topk, k, logits, 0, producer)
    raise Refusal(f"unknown routing form {form!r}", topk)


def _written_softmax(scores: ir.Value, r: int, topk: ir.Node, form: str | None) -> ir.Value:
    """The logits of a softmax over the experts written out in element-wise ops (probed)."""
    producer = scores.producer()
    what = "a graph input" if producer is None else f"{producer.op_type} '{label(producer)}'"
    try:
        logits, _ = softmax_logits(scores, r)
    except Refusal as refusal:
        raise Refusal(
            f"the top-k weights are not softmax probabilities: TopK '{label(topk)}' reads "
            f"'{value_label(scores)}' ({what}) and its values are combined "
            + ("after renormalising" if form != "as_is" else "as they are")
            + f" ({refusal.reason})",
            topk,
        ) from None
    return logits


# -- 3. combine --------------------------------------------------------------------------------


def combine_step(b: Mapping[str, Any], r: int, combine: str, hidden: int) -> ir.Node:
    """Step 3: the slot combine's axes (``[*, k, H]`` slots, rank-``r`` tokens); its root."""
    out: ir.Value = b["layer_out"]
    root = out.producer()
    assert root is not None
    unsq = bound_node(b, "routing_weights_unsq")
    assert unsq is not None
    if combine == "reduce_sum":
        axes = node_axes(unsq)
        if axes is None or normalize_axes(axes, r + 1) != [r]:
            raise Refusal(
                f"Unsqueeze '{label(unsq)}' does not add a trailing axis to the routing weights "
                f"(axes {axes})",
                unsq,
            )
        axes = node_axes(root)
        if axes is None or normalize_axes(axes, r + 1) != [r - 1]:
            raise Refusal(
                f"ReduceSum '{label(root)}' does not sum over the k axis (axes {axes})", root
            )
        if attr_int(root, "keepdims", 1) != 0:
            raise Refusal(f"ReduceSum '{label(root)}' keeps the k axis (keepdims=1)", root)
        return root
    # MatMul combine: Unsqueeze(w, k-1 axis) [*, 1, k] @ expert_out [*, k, H] -> [*, 1, H]
    axes = node_axes(unsq)
    if axes is None or normalize_axes(axes, r + 1) != [r - 1]:
        raise Refusal(
            f"Unsqueeze '{label(unsq)}' does not make the routing weights a row vector per token "
            f"(axes {axes})",
            unsq,
        )
    if root.op_type == "Squeeze":
        axes = node_axes(root)
        if axes is None or normalize_axes(axes, r + 1) != [r - 1]:
            raise Refusal(
                f"Squeeze '{label(root)}' does not drop the unit axis (axes {axes})", root
            )
        return root
    shape = const_ints(root.inputs[1])
    lead = lead_dims(b["tokens"], r - 1)
    h = Dim.of(hidden)
    got = None if shape is None else reshape_dims([*lead, Dim.of(1), h], shape)
    if got != [*lead, h]:
        raise Refusal(
            f"Reshape '{label(root)}' (shape {shape}) does not drop the unit axis of the combine "
            f"(from {dims_text([*lead, Dim.of(1), h])} it must make {dims_text([*lead, h])})",
            root,
        )
    return root


def dims_text(dims: list[Dim]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"
