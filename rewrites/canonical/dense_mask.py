"""Read the routing and the mask of a dense MoE layer, proving what they compute.

Used by :mod:`.dense_experts`. Starting from one ``TopK`` (values ``v``, indices ``idx``, both
``[T, k]`` over a router of width E), a dense layer builds the dense routing weights
``dense[t, e] = sum_j (idx[t, j] == e) * w[t, j]`` with ``w`` computed from ``v`` per token,
in one of these forms:

* per expert, ``ReduceSum(Mul(Cast(Equal(idx, e)), w), -1, keepdims=1)`` -> ``[T, 1]``
  (Mobius, transformers' static loop); ``keepdims=0`` then ``Unsqueeze(-1)`` too;
* ``ReduceSum(Mul(OneHot(idx, E, [0, 1]), Unsqueeze(w, -1)), 1, keepdims=0)`` -> ``[T, E]``;
* ``ScatterElements(zeros [T, E], idx, w, axis=1)`` -> ``[T, E]``: equal to the sum above
  because TopK's k indices of one row are distinct (no write overwrites another).

Every structural constant (axes, depth, OneHot values, Equal constants, Cast type) is checked;
a failed proof raises :class:`~onnx_moe_fuse.rewrites._graph_facts.Refusal`. The combine that
consumes the mask is read by :mod:`.dense_combine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from .._graph_facts import (
    Refusal,
    attr_int,
    attr_str,
    label,
    normalize_axes,
    static_last_dim,
    static_rank,
)
from .dense_consts import const_array, const_ints, node_axes

__all__ = [
    "DenseWeights",
    "Routing",
    "axes_are",
    "consumers",
    "is_op",
    "only_consumer",
    "other_operand",
    "read_dense_weights",
    "read_routing",
]

_STD = ("", "ai.onnx")
_FLOAT_TYPES = frozenset(
    int(t)
    for t in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16)
)


@dataclass
class Routing:
    """One TopK over the last axis of ``[T, E]`` scores computed from the ``tokens``."""

    topk: ir.Node
    indices: ir.Value
    values: ir.Value
    experts: int
    k: int
    tokens: ir.Value


@dataclass
class DenseWeights:
    """The mask: per-expert columns ``[T, 1]`` or one ``[T, E]`` tensor, and the weights ``w``."""

    weights: ir.Value  # w [T, k], from the TopK's values
    columns: dict[int, ir.Value] | None  # expert -> [T, 1]
    dense: ir.Value | None  # [T, E]
    nodes: list[ir.Node] = field(default_factory=list)


def is_op(node: ir.Node | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in _STD


def consumers(value: ir.Value) -> list[ir.Node]:
    return list(dict.fromkeys(value.consumers()))


def only_consumer(value: ir.Value, what: str) -> ir.Node:
    users = consumers(value)
    if len(users) != 1 or value.is_graph_output():
        raise Refusal(f"{value.name}: {what} is used {len(users)} times, expected once")
    return users[0]


def other_operand(node: ir.Node, value: ir.Value) -> ir.Value | None:
    a, b = node.inputs[0], node.inputs[1]
    return b if a is value else a


def axes_are(node: ir.Node, rank: int, want: list[int]) -> bool:
    axes = node_axes(node)
    return axes is not None and normalize_axes(axes, rank) == want


def read_routing(topk: ir.Node) -> Routing:
    """Prove ``topk`` selects k of E experts over the last axis of router scores of the tokens."""
    scores = topk.inputs[0]
    k = const_ints(topk.inputs[1]) if len(topk.inputs) > 1 else None
    if scores is None or static_rank(scores) != 2:
        raise Refusal("the router scores are not provably [T, E]")
    if attr_int(topk, "axis", -1) not in (-1, 1) or attr_int(topk, "largest", 1) != 1:
        raise Refusal("TopK is not a largest-k selection over the expert axis")
    experts = static_last_dim(scores)
    if k is None or len(k) != 1 or experts is None or not 1 <= k[0] <= experts:
        raise Refusal("cannot prove k and the number of experts E of the router")
    tokens = _router_tokens(scores)
    if tokens is None or static_rank(tokens) != 2:
        raise Refusal("cannot prove that the router reads [T, H] tokens")
    return Routing(topk, topk.outputs[1], topk.outputs[0], experts, k[0], tokens)


def _router_tokens(scores: ir.Value) -> ir.Value | None:
    """The tokens of ``[MatMul | Gemm](tokens, W)`` behind the scores, through row-wise ops.

    Only Softmax / Sigmoid / Cast / Identity and an Add of a constant lie between: each keeps
    the rows, so the scores have one row per token of those tokens.
    """
    value = scores
    for _ in range(8):
        node = value.producer()
        if node is None or node.domain not in _STD:
            return None
        if node.op_type == "MatMul" or (node.op_type == "Gemm" and not attr_int(node, "transA", 0)):
            return node.inputs[0]
        if node.op_type in ("Softmax", "Sigmoid", "Cast", "Identity"):
            value = node.inputs[0]
        elif node.op_type == "Add":
            a, b = node.inputs[0], node.inputs[1]
            value = a if const_array(b) is not None else b if const_array(a) is not None else None
        else:
            return None
        if value is None:
            return None
    return None


def _check_weights(w: ir.Value, routing: Routing) -> None:
    """``w`` is computed from the TopK's values per token, keeping their ``[T, k]`` shape."""
    seen_values = False
    todo, seen = [w], set()
    while todo:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if v is routing.values:
            seen_values = True
            continue
        if const_array(v) is not None and const_array(v).size == 1:
            continue
        p = v.producer()
        ok = (
            p is not None
            and p.domain in _STD
            and (
                p.op_type in ("Div", "Mul", "Reciprocal", "Identity", "Cast")
                or (p.op_type == "Softmax" and attr_int(p, "axis", -1) in (-1, 1))
                or (
                    p.op_type == "ReduceSum"
                    and attr_int(p, "keepdims", 1) == 1
                    and axes_are(p, 2, [1])
                )
            )
        )
        if not ok:
            raise Refusal(
                f"the mask is weighted by {v.name}, which is not computed from this TopK's values"
            )
        todo.extend(i for i in p.inputs if i is not None)
    if not seen_values:
        raise Refusal("the mask weights do not come from this TopK's values")


def _equal_column(
    eq: ir.Node, routing: Routing, nodes: list[ir.Node]
) -> tuple[int, ir.Value, ir.Value]:
    """``Equal(idx, e) -> Cast -> Mul(w) -> ReduceSum(-1)``: (e, the [T, 1] column, w)."""
    const = const_ints(other_operand(eq, routing.indices))
    if const is None or len(const) != 1:
        raise Refusal(f"{label(eq)}: compares the expert ids with a non-constant or non-scalar")
    cast = only_consumer(eq.outputs[0], "the Equal mask")
    if not is_op(cast, "Cast") or attr_int(cast, "to", 0) not in _FLOAT_TYPES:
        raise Refusal(f"{label(eq)}: the mask is not Cast to a float type")
    mul = only_consumer(cast.outputs[0], "the float mask")
    if not is_op(mul, "Mul"):
        raise Refusal(f"{label(cast)}: the mask is not multiplied by the routing weights")
    w = other_operand(mul, cast.outputs[0])
    _check_weights(w, routing)
    red = only_consumer(mul.outputs[0], "the weighted mask")
    if not is_op(red, "ReduceSum") or not axes_are(red, 2, [1]):
        raise Refusal(f"{label(mul)}: the weighted mask is not summed over the k slots")
    nodes += [eq, cast, mul, red]
    col = red.outputs[0]
    if attr_int(red, "keepdims", 1) == 0:
        unsq = only_consumer(col, "the expert's weight")
        if not is_op(unsq, "Unsqueeze") or not axes_are(unsq, 2, [1]):
            raise Refusal(f"{label(red)}: the expert's weight is not made a [T, 1] column")
        nodes.append(unsq)
        col = unsq.outputs[0]
    return const[0], col, w


def _onehot_dense(oh: ir.Node, routing: Routing, nodes: list[ir.Node]) -> tuple[ir.Value, ir.Value]:
    depth, values = const_ints(oh.inputs[1]), const_array(oh.inputs[2])
    if depth != [routing.experts] or values is None or values.reshape(-1).tolist() != [0, 1]:
        raise Refusal(
            f"{label(oh)}: not a one-hot of depth E = {routing.experts} with values [0, 1]"
        )
    if attr_int(oh, "axis", -1) not in (-1, 2):
        raise Refusal(f"{label(oh)}: the one-hot axis is not the last")
    nodes.append(oh)
    out = oh.outputs[0]
    user = only_consumer(out, "the one-hot mask")
    if is_op(user, "Cast"):
        nodes.append(user)
        out = user.outputs[0]
        user = only_consumer(out, "the one-hot mask")
    if not is_op(user, "Mul"):
        raise Refusal(f"{label(oh)}: the one-hot mask is not multiplied by the routing weights")
    w3 = other_operand(user, out)
    unsq = w3.producer() if w3 is not None else None
    if not is_op(unsq, "Unsqueeze") or not axes_are(unsq, 3, [2]):
        raise Refusal(f"{label(user)}: the routing weights are not made [T, k, 1]")
    w = unsq.inputs[0]
    _check_weights(w, routing)
    red = only_consumer(user.outputs[0], "the weighted one-hot mask")
    if not is_op(red, "ReduceSum") or not axes_are(red, 3, [1]) or attr_int(red, "keepdims", 1):
        raise Refusal(f"{label(user)}: the weighted one-hot is not summed over the k slots")
    nodes += [user, red]
    if len(consumers(w3)) == 1 and not w3.is_graph_output():
        nodes.append(unsq)
    return red.outputs[0], w


def _zeros_like_scores(z: ir.Value | None, routing: Routing) -> bool:
    """``z`` is zeros of the router scores' shape ``[T, E]``."""
    node = z.producer() if z is not None else None
    if node is None or node.domain not in _STD:
        return False
    if node.op_type == "ConstantOfShape":
        attr = node.attributes.get("value")
        fill = 0.0 if attr is None else np.asarray(attr.value.numpy()).reshape(-1)
        shape_src = node.inputs[0]
    elif node.op_type == "Expand":
        fill, shape_src = const_array(node.inputs[0]), node.inputs[1]
    else:
        return False
    if fill is None or np.any(np.asarray(fill) != 0):
        return False
    shape = shape_src.producer() if shape_src is not None else None
    if not is_op(shape, "Shape") or shape.attributes:
        return False
    src = shape.inputs[0]
    scores = routing.topk.inputs[0]
    before = scores.producer() if scores is not None else None
    return src is scores or (
        before is not None and before.op_type in ("Softmax", "Sigmoid") and src is before.inputs[0]
    )


def _scatter_dense(
    sc: ir.Node, routing: Routing, nodes: list[ir.Node]
) -> tuple[ir.Value, ir.Value]:
    if sc.inputs[1] is not routing.indices:
        raise Refusal(f"{label(sc)}: the expert ids are not the scatter indices")
    if attr_int(sc, "axis", 0) not in (1, -1) or attr_str(sc, "reduction", "none") != "none":
        raise Refusal(f"{label(sc)}: not a plain scatter along the expert axis")
    w = sc.inputs[2]
    _check_weights(w, routing)
    if not _zeros_like_scores(sc.inputs[0], routing):
        raise Refusal(f"{label(sc)}: the scatter target is not zeros of the router's [T, E] shape")
    nodes.append(sc)
    return sc.outputs[0], w


def read_dense_weights(routing: Routing) -> DenseWeights | None:
    """The mask built from ``routing``'s indices; None when they feed no mask at all."""
    users = consumers(routing.indices)
    equals = [n for n in users if is_op(n, "Equal")]
    onehots = [n for n in users if is_op(n, "OneHot") and n.inputs[0] is routing.indices]
    scatters = [n for n in users if is_op(n, "ScatterElements")]
    if not (equals or onehots or scatters):
        return None
    if (
        len(users) != len(equals) + len(onehots) + len(scatters)
        or routing.indices.is_graph_output()
    ):
        raise Refusal("the expert ids feed something besides the mask")
    nodes: list[ir.Node] = []
    if equals and not (onehots or scatters):
        columns: dict[int, ir.Value] = {}
        weights: set[int] = set()
        w = None
        for eq in equals:
            e, col, w = _equal_column(eq, routing, nodes)
            if e in columns:
                raise Refusal(f"expert {e} has two masks")
            columns[e] = col
            weights.add(id(w))
        if len(weights) != 1:
            raise Refusal("the experts' masks are weighted by different values")
        missing = sorted(set(range(routing.experts)) - set(columns))
        if missing or len(columns) != routing.experts:
            raise Refusal(f"no mask for experts {missing} of E = {routing.experts}")
        return DenseWeights(w, columns, None, nodes)
    if len(onehots) + len(scatters) != 1 or equals:
        raise Refusal("the expert ids feed more than one mask")
    if onehots:
        dense, w = _onehot_dense(onehots[0], routing, nodes)
    else:
        dense, w = _scatter_dense(scatters[0], routing, nodes)
    return DenseWeights(w, None, dense, nodes)
