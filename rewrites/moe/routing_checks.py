"""The routing checks of a layer proof: router width, token rows, escapes, selected weights.

Called by :func:`.analysis.finish_layer` inside ``part("routing")``: the router produces E
scores per token (:func:`router_width`); the fused op's own routing reads router logits made row
by row from the experts' token rows (:func:`router_rows`) and, for a rule used alone, its
Softmax is used by the layer only (:func:`router_scores_stay_inside`); a router fed as its
selection and weights (the routing construction) is proved by :func:`selected_routing`.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import (
    attr_int,
    const_array,
    default_opset,
    label,
    node_axes,
    normalize_axes,
    static_last_dim,
    static_rank,
    value_label,
)
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.graph.symbolic_dims import value_dims
from onnx_moe_fuse.rewrites.graph.token_rows import row_origins
from onnx_moe_fuse.rewrites.moe.routing_construction import value_refusal
from onnx_moe_fuse.rewrites.moe.routing_proof import Routing
from onnx_moe_fuse.rewrites.moe.selected_weights import prove_selected_weights

__all__ = ["router_rows", "router_scores_stay_inside", "router_width", "selected_routing"]


def router_width(routing: Routing, e: int, k: int) -> None:
    router_e = static_last_dim(routing.router_probs)
    if router_e is None and routing.selected:
        dims = value_dims(routing.router_probs)
        router_e = dims[-1].coef if dims and not dims[-1].syms else None
    if router_e is None:
        raise Refusal(
            f"cannot prove that the router '{value_label(routing.router_probs)}' produces "
            f"E = {e} logits per token",
            routing.router_probs,
        )
    if router_e != e:
        raise Refusal(
            f"the router produces {router_e} logits per token but there are {e} experts",
            routing.router_probs,
        )
    if not 1 <= k <= e:
        raise Refusal(f"TopK k = {k} is not between 1 and E = {e}", routing.topk)


#: Element-wise ops: the row of their output is the row of their input.
_ROW_WISE_UNARY = frozenset({"Cast", "Identity", "Sigmoid", "Tanh", "Relu", "Neg", "Exp"})
#: Ops that keep the row order of a ``[..., H]`` value when they keep its last axis.
_ROW_PRESERVING = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast"})


def _row_source(value: ir.Value, hidden: int | None) -> ir.Value:
    """Walk back through ops that keep the token rows (same elements, same last axis)."""
    for _ in range(16):
        node = value.producer()
        if (
            node is None
            or node.op_type not in _ROW_PRESERVING
            or node.domain not in ("", "ai.onnx")
        ):
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


def router_rows(logits: ir.Value, tokens: ir.Value, hidden: int) -> None:
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
    origins = [_row_source(o, hidden) for o in row_origins(tokens)]
    projection = node is not None and (
        node.op_type == "MatMul" or (node.op_type == "Gemm" and attr_int(node, "transA", 0) == 0)
    )
    if projection and node.inputs[0] is not None:
        reads = node.inputs[0]
        source = _row_source(reads, hidden)
        if any(source is origin for origin in origins):
            return
        raise Refusal(
            f"the router {node.op_type} '{label(node)}' reads '{value_label(reads)}', not the token rows "
            f"'{value_label(tokens)}' the experts read: the fused node routes each token by its own "
            "router row, which cannot be proved here",
            node,
        )
    got, want = _rows(logits), _rows(tokens)
    if got is not None and want is not None and math.prod(got) == math.prod(want):
        return
    where = "a graph input" if node is None else f"{node.op_type} '{label(node)}'"
    raise Refusal(
        f"cannot prove that the router logits '{value_label(logits)}' ({where}) have one row per "
        f"token of '{value_label(tokens)}'",
        logits,
    )


def selected_routing(
    routing: Routing, tokens: ir.Value, root: ir.Node, num_experts: int, token_rank: int
) -> None:
    """The router-agnostic routing: the selection and its weights are each token's own."""
    topk = routing.topk
    weights = routing.weights
    assert weights is not None
    opset = default_opset(root.graph)
    if opset < 15:
        raise Refusal(
            f"the router is fed as its selection and weights, which needs opset >= 15 (the "
            f"graph has {opset})",
            topk,
        )
    scores = topk.inputs[0]
    dims = value_dims(scores)
    rank = len(dims) if dims is not None else static_rank(scores)
    if rank is None:  # a TopK's outputs have its input's rank
        rank = static_rank(topk.outputs[0]) or static_rank(routing.weights) or token_rank
    if scores is None or rank is None:
        raise Refusal(
            f"the rank of the router scores TopK '{label(topk)}' selects from is unknown", topk
        )
    prove_selected_weights(weights, topk, tokens, rank - 1)
    reason = value_refusal(topk.outputs[1], weights, num_experts)
    if reason is not None:  # what the construction needs of the graph values (dtypes, shapes)
        raise Refusal(f"the selection and weights cannot be fed: {reason}", weights)


def router_scores_stay_inside(routing: Routing) -> None:
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
        raise Refusal(
            f"the router probabilities '{value_label(scores)}' escape the layer: they are also "
            f"{where}",
            scores,
        )
