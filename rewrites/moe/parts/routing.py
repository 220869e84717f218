"""Routing: from the weights the combine multiplies by, back to the routing ``TopK``.

Spellings (each a small pattern rooted where the weights are made)::

    values, indices = TopK(scores, k)
    weights = Div(values, ReduceSum(values, axes?))                 renorm_div
            | Mul(values, Reciprocal(ReduceSum(values, axes?)))      renorm_reciprocal (either order)
            | Softmax(values)                                        softmax_k
            | values                                                 as_is
            | any other element-wise region of the values alone, probed against the three
              (``moe.behaviour.routing.weights_form``; ``weights_by_behaviour`` set)

:func:`recognise_routing` returns a :class:`~.facts.RoutingFact`; what the scores are (a
Softmax of the router logits, over which axis, with which k) is proved by
``moe.analysis.routing_form``. :func:`routing_pattern` is the same piece for a rule's pattern:
the layer rules anchor at the combine and the TopK whose values it weights by.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.rewrites.graph.facts import label, static_rank, value_label
from onnx_moe_fuse.rewrites.graph.match import PartPattern, first_match, spellings
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.moe.behaviour.routing import weights_form
from onnx_moe_fuse.rewrites.moe.parts.facts import RoutingFact, half_precision, precision_cast

__all__ = ["SELECTED", "WEIGHT_FORMS", "recognise_routing", "routing_pattern", "selected_routing"]

#: The weight forms, in the order they are tried.
WEIGHT_FORMS = ("renorm_div", "renorm_reciprocal", "softmax_k", "as_is")
#: The form of weights made otherwise from the selection (``moe.selected_weights`` proves them).
SELECTED = "selected"
_INDEX_LAYOUT = ("Cast", "Identity", "Reshape", "Flatten", "Unsqueeze", "Squeeze")


def _var(name: str, optional: bool = False) -> pattern.Var:
    return pattern.Var(name, can_match_none=optional)


def _topk(op) -> tuple[Any, Any]:
    return op.TopK(_var("router_scores"), _var("topk_k"), _outputs=["topk_values", "topk_indices"])


def _total(op, values) -> Any:
    return op.ReduceSum(values, _var("renorm_axes", True), _outputs=["renorm_sum"])


def routing_pattern(op) -> tuple[Any, Any]:
    """``TopK(scores, k)`` for a rule's pattern: (the weights in any form, the indices).

    Binds ``router_scores``, ``topk_k``, ``topk_values``, ``topk_indices``, ``routing_weights``
    and the tag ``weight_form``.
    """
    values, indices = _topk(op)
    total = _total(op, values)
    weights = pattern.OrValue(
        [
            op.Div(values, total),
            op.Mul(values, op.Reciprocal(total)),
            op.Mul(op.Reciprocal(total), values),
            op.Softmax(values),
            values,
        ],
        name="routing_weights",
        tag_var="weight_form",
        tag_values=["renorm_div", "renorm_reciprocal", "renorm_reciprocal", "softmax_k", "as_is"],
    )
    return weights, indices


def _div(op):
    values, _ = _topk(op)
    return op.Div(values, _total(op, values))


def _mul_reciprocal(op):
    values, _ = _topk(op)
    return op.Mul(values, op.Reciprocal(_total(op, values)))


def _reciprocal_mul(op):
    values, _ = _topk(op)
    return op.Mul(op.Reciprocal(_total(op, values)), values)


def _softmax(op):
    values, _ = _topk(op)
    return op.Softmax(values)


_PATTERNS = (
    ("renorm_div", PartPattern("routing/renorm_div", _div)),
    ("renorm_reciprocal", PartPattern("routing/mul_reciprocal", _mul_reciprocal)),
    ("renorm_reciprocal", PartPattern("routing/reciprocal_mul", _reciprocal_mul)),
    ("softmax_k", PartPattern("routing/softmax_k", _softmax)),
)


def recognise_routing(weights: ir.Value) -> RoutingFact:
    """The routing TopK behind ``weights`` (the values the combine weights the slots by).

    Casts between float types on the way are looked through (a float16 export computes its
    routing in float32 and casts the weights down, or the other way round): the fused node
    rounds the weights to its own dtype, and the layer proof feeds a cast layer as its
    selection and these very weights (``analysis.finish_layer``).
    """
    inner = weights
    for _ in range(2):
        cast = precision_cast(inner)
        if cast is None:
            break
        inner = cast.inputs[0]
    fact = _recognise_routing(inner)
    if inner is weights:
        return fact
    b = dict(fact.bindings)
    b["routing_casts"] = True
    return _fact(fact.topk, weights, fact.form, fact.nodes, b)


def _recognise_routing(weights: ir.Value) -> RoutingFact:
    node = weights.producer()
    if node is not None and node.op_type == "TopK" and node.domain in ("", "ai.onnx"):
        if weights.index() != 0:
            raise Refusal(
                f"the combine weights the slots by the indices of TopK '{label(node)}', not by "
                "its values",
                node,
                part="routing",
            )
        b = {
            "router_scores": node.inputs[0],
            "topk_k": node.inputs[1] if len(node.inputs) > 1 else None,
            "topk_values": node.outputs[0],
            "topk_indices": node.outputs[1],
        }
        return _fact(node, weights, "as_is", (node,), b)
    found = first_match(_PATTERNS, node)
    if found is None:
        half = half_precision("routing", weights)
        if half is not None:
            raise half
        by_behaviour = _by_behaviour(weights)
        if by_behaviour is not None:
            return by_behaviour
        what = "a graph input" if node is None else f"{node.op_type} '{label(node)}'"
        raise Refusal(
            f"the routing weights '{value_label(weights)}' ({what}) are not the values of a TopK "
            "(as they are, renormalised by their sum, or softmaxed over the k slots)",
            weights,
            part="routing",
            expected=spellings(_PATTERNS),
        )
    form, match = found
    topk = match.bindings["topk_values"].producer()
    return _fact(topk, weights, form, match.nodes, match.bindings)


def _by_behaviour(weights: ir.Value) -> RoutingFact | None:
    """Weights written out from a TopK's values, recognised by probing (None: not from one).

    The form is ``renorm_div``, ``softmax_k`` or ``as_is`` with ``weights_by_behaviour`` set
    (the proof skips the structural checks of the patterns' nodes: probing proved the axes). A
    region of TopK values that computes none of them raises, naming the closest.
    """
    rank = static_rank(weights)
    if rank is None or rank < 2:
        return None
    try:
        found = weights_form(weights, rank)
    except Refusal as refusal:
        refusal.part = refusal.part or "routing"
        raise
    if found is None:
        return None
    topk, form, region = found
    b = {
        "router_scores": topk.inputs[0],
        "topk_k": topk.inputs[1] if len(topk.inputs) > 1 else None,
        "topk_values": topk.outputs[0],
        "topk_indices": topk.outputs[1],
        "weights_by_behaviour": True,
    }
    form = {"renorm": "renorm_div"}.get(form, form)
    nodes = tuple(n for n in region.nodes if n.outputs[0] not in region.constants)
    return _fact(topk, weights, form, (topk, *nodes), b)


def _selection_topk(indices: ir.Value | None) -> ir.Node | None:
    """The TopK whose indices (output 1) ``indices`` is, up to casts and reshapes."""
    for _ in range(8):
        if indices is None:
            return None
        node = indices.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "TopK":
            return node if indices is node.outputs[1] else None
        if node.op_type not in _INDEX_LAYOUT or not node.inputs:
            return None
        indices = node.inputs[0]
    return None


def selected_routing(
    weights: ir.Value, expert_ids: ir.Value | None, refusal: Refusal
) -> RoutingFact:
    """Routing whose weights are not a TopK's values: the TopK behind FC2's ``expert_ids``.

    The weights stay as the model computes them (form :data:`SELECTED`); what they are is
    proved later (``moe.selected_weights``). ``refusal`` (why the weights are no TopK values
    form) is raised when FC2's experts are not chosen by a TopK either.
    """
    topk = _selection_topk(expert_ids)
    if topk is None:
        raise refusal
    b = {
        "router_scores": topk.inputs[0],
        "topk_k": topk.inputs[1] if len(topk.inputs) > 1 else None,
        "topk_values": topk.outputs[0],
        "topk_indices": topk.outputs[1],
    }
    return _fact(topk, weights, SELECTED, (), b)


def _fact(topk: ir.Node, weights: ir.Value, form: str, nodes: tuple, bindings: dict) -> RoutingFact:
    b = dict(bindings)
    b["routing_weights"] = weights
    b["weight_form"] = form
    return RoutingFact(
        topk=topk,
        scores=b["router_scores"],
        weights=weights,
        indices=topk.outputs[1],
        form=form,
        nodes=tuple(nodes),
        bindings=b,
    )
