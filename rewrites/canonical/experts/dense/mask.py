"""Read the mask of a dense MoE layer, proving what it computes.

Used by :mod:`.dense_experts`, after :mod:`.routing` has read the TopK (values ``v``,
indices ``idx``, both ``[T, k]``, over a router of width E). A dense layer builds the dense
routing weights ``dense[t, e] = sum_j (idx[t, j] == e) * w[t, j]`` with ``w`` computed from
``v``, in one of these forms:

* per expert, ``ReduceSum(Mul(Cast(Equal(idx, e)), w), -1, keepdims=1)`` -> ``[T, 1]``
  (Mobius, transformers' static loop); ``keepdims=0`` then ``Unsqueeze(-1)`` too;
* ``ReduceSum(Mul(onehot, Unsqueeze(w, -1)), 1, keepdims=0)`` -> ``[T, E]``, the ``[T, k, E]``
  one-hot spelled ``OneHot(idx, E, [0, 1])`` (a Cast after it allowed) or
  ``Cast(Equal(Unsqueeze(idx, -1), arange(E)))`` (every id compared with the ``[E]`` range at
  once, as optimum-onnx and Mobius write it);
* ``ScatterElements(zeros [T, E], idx, w, axis=1)`` -> ``[T, E]``: equal to the sum above
  because TopK's k indices of one row are distinct (no write overwrites another).

Every structural constant (axes, depth, OneHot values, the range, Cast type) is checked; a failed
proof raises :class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` tagged part ``combine`` (the
mask is the combine's weights) with the node at fault. The combine that consumes the mask is read by
:mod:`.combine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.dense.consts import (
    STD,
    axes_are,
    const_array,
    const_ints,
    consumers,
    is_op,
    only_consumer,
    other_operand,
)
from onnx_moe_fuse.rewrites.canonical.experts.dense.routing import Routing, check_weights
from onnx_moe_fuse.rewrites.graph.facts import attr_int, attr_str, label
from onnx_moe_fuse.rewrites.graph.refusals import Refusal, part

__all__ = [
    "CapacityRefusal",
    "DenseWeights",
    "fill_like_scores",
    "mask_users",
    "read_dense_weights",
]

_FLOAT_TYPES = frozenset(
    int(t)
    for t in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16)
)
#: Ops through which the expert ids reach a mask.
MASK_OPS = ("Equal", "OneHot", "ScatterElements")


@dataclass
class DenseWeights:
    """The mask: per-expert columns ``[T, 1]`` or one ``[T, E]`` tensor, and the weights ``w``."""

    weights: ir.Value  # w [T, k], from the TopK's values
    columns: dict[int, ir.Value] | None  # expert -> [T, 1]
    dense: ir.Value | None  # [T, E]
    nodes: list[ir.Node] = field(default_factory=list)


def _unsqueezed_ids(node: ir.Node, indices: ir.Value) -> bool:
    """``Unsqueeze(idx, -1)``: the ``[T, k, 1]`` ids an all-at-once ``Equal`` compares."""
    return is_op(node, "Unsqueeze") and node.inputs[0] is indices and axes_are(node, 3, [2])


def mask_users(indices: ir.Value) -> list[ir.Node]:
    """The mask nodes the expert ids feed (through ``Unsqueeze(-1)`` for an ``Equal``)."""
    out = []
    for user in consumers(indices):
        if user.op_type in MASK_OPS and user.domain in STD:
            out.append(user)
        elif _unsqueezed_ids(user, indices):
            out += [n for n in consumers(user.outputs[0]) if is_op(n, "Equal")]
    return out


def _equal_column(
    eq: ir.Node, routing: Routing, nodes: list[ir.Node]
) -> tuple[int, ir.Value, ir.Value]:
    """``Equal(idx, e) -> Cast -> Mul(w) -> ReduceSum(-1)``: (e, the [T, 1] column, w)."""
    const = const_ints(other_operand(eq, routing.indices))
    if const is None or len(const) != 1:
        raise Refusal(f"{label(eq)}: compares the expert ids with a non-constant or non-scalar", eq)
    cast = only_consumer(eq.outputs[0], "the Equal mask")
    if not is_op(cast, "Cast") or attr_int(cast, "to", 0) not in _FLOAT_TYPES:
        raise Refusal(f"{label(eq)}: the mask is not Cast to a float type", eq)
    mul = only_consumer(cast.outputs[0], "the float mask")
    if not is_op(mul, "Mul"):
        raise Refusal(f"{label(cast)}: the mask is not multiplied by the routing weights", cast)
    w = other_operand(mul, cast.outputs[0])
    check_weights(w, routing)
    red = only_consumer(mul.outputs[0], "the weighted mask")
    if not is_op(red, "ReduceSum") or not axes_are(red, 2, [1]):
        raise Refusal(f"{label(mul)}: the weighted mask is not summed over the k slots", mul)
    nodes += [eq, cast, mul, red]
    col = red.outputs[0]
    if attr_int(red, "keepdims", 1) == 0:
        unsq = only_consumer(col, "the expert's weight")
        if not is_op(unsq, "Unsqueeze") or not axes_are(unsq, 2, [1]):
            raise Refusal(f"{label(red)}: the expert's weight is not made a [T, 1] column", red)
        nodes.append(unsq)
        col = unsq.outputs[0]
    return const[0], col, w


def _onehot_of_ids(oh: ir.Node, routing: Routing, nodes: list[ir.Node]) -> ir.Value:
    """``OneHot(idx, E, [0, 1], axis=-1)``: the ``[T, k, E]`` one-hot (a Cast after it kept)."""
    depth, values = const_ints(oh.inputs[1]), const_array(oh.inputs[2])
    if depth != [routing.experts] or values is None or values.reshape(-1).tolist() != [0, 1]:
        raise Refusal(
            f"{label(oh)}: not a one-hot of depth E = {routing.experts} with values [0, 1]", oh
        )
    if attr_int(oh, "axis", -1) not in (-1, 2):
        raise Refusal(f"{label(oh)}: the one-hot axis is not the last", oh)
    nodes.append(oh)
    out = oh.outputs[0]
    user = only_consumer(out, "the one-hot mask")
    if is_op(user, "Cast"):
        if attr_int(user, "to", 0) not in _FLOAT_TYPES:
            raise Refusal(f"{label(user)}: the one-hot mask is not Cast to a float type", user)
        nodes.append(user)
        out = user.outputs[0]
    return out


def _range_of_experts(value: ir.Value | None, experts: int) -> bool:
    """A constant ``[0, 1, .., E-1]`` laid along the last axis (``[E]``, ``[1, E]``, ``[1, 1, E]``)."""
    arr = const_array(value)
    if arr is None or arr.ndim > 3 or arr.size != experts or arr.shape[-1] != experts:
        return False
    return np.issubdtype(arr.dtype, np.integer) and arr.reshape(-1).tolist() == list(range(experts))


def _equal_of_ids(eq: ir.Node, routing: Routing, nodes: list[ir.Node]) -> ir.Value:
    """``Cast(Equal(Unsqueeze(idx, -1), arange(E)))``: the ``[T, k, E]`` one-hot, any order."""
    unsq = next(
        (v.producer() for v in eq.inputs if _unsqueezed_ids(v.producer(), routing.indices)), None
    )
    ids = unsq.outputs[0]
    if not _range_of_experts(other_operand(eq, ids), routing.experts):
        raise Refusal(
            f"{label(eq)}: compares the expert ids with something other than the range "
            f"0..{routing.experts - 1} of the E experts",
            eq,
        )
    cast = only_consumer(eq.outputs[0], "the Equal mask")
    if not is_op(cast, "Cast") or attr_int(cast, "to", 0) not in _FLOAT_TYPES:
        raise Refusal(f"{label(eq)}: the mask is not Cast to a float type", eq)
    nodes += [eq, cast]
    if len(consumers(ids)) == 1 and not ids.is_graph_output():
        nodes.append(unsq)
    return cast.outputs[0]


def _weighted_onehot(
    onehot: ir.Value, routing: Routing, nodes: list[ir.Node]
) -> tuple[ir.Value, ir.Value]:
    """``ReduceSum(Mul(onehot, Unsqueeze(w, -1)), 1, keepdims=0)``: (the ``[T, E]`` mask, w)."""
    user = only_consumer(onehot, "the one-hot mask")
    if not is_op(user, "Mul"):
        raise Refusal(
            f"{label(user)}: the one-hot mask is not multiplied by the routing weights", user
        )
    w3 = other_operand(user, onehot)
    unsq = w3.producer() if w3 is not None else None
    if not is_op(unsq, "Unsqueeze") or not axes_are(unsq, 3, [2]):
        raise Refusal(f"{label(user)}: the routing weights are not made [T, k, 1]", user)
    w = unsq.inputs[0]
    check_weights(w, routing)
    red = only_consumer(user.outputs[0], "the weighted one-hot mask")
    if not is_op(red, "ReduceSum") or not axes_are(red, 3, [1]) or attr_int(red, "keepdims", 1):
        raise Refusal(
            f"{label(user)}: the weighted one-hot is not summed over the k slots", red or user
        )
    nodes += [user, red]
    if len(consumers(w3)) == 1 and not w3.is_graph_output():
        nodes.append(unsq)
    return red.outputs[0], w


def fill_like_scores(z: ir.Value | None, routing: Routing) -> np.ndarray | None:
    """The one value ``z`` holds everywhere when it is a fill of the scores' shape ``[T, E]``.

    ``ConstantOfShape(Shape(scores))`` or ``Expand(c, Shape(scores))`` (scores: what the TopK
    reads, or the logits under its Softmax/Sigmoid); None otherwise.
    """
    node = z.producer() if z is not None else None
    array = const_array(z) if z is not None else None
    scores = routing.topk.inputs[0]
    if array is not None:  # a static export folds the fill into a constant of the scores' shape
        array = np.asarray(array)
        static = scores.shape if scores is not None else None
        if static is None or not all(isinstance(d, int) for d in static):
            return None
        if array.size == 0 or tuple(array.shape) != tuple(static):
            return None
        flat = array.reshape(-1)
        return flat[:1] if bool(np.all(flat == flat[0])) else None
    if node is None or node.domain not in STD:
        return None
    if node.op_type == "ConstantOfShape":
        attr = node.attributes.get("value")
        fill = np.zeros(1, np.float32) if attr is None else np.asarray(attr.value.numpy())
        shape_src = node.inputs[0]
    elif node.op_type == "Expand":
        fill, shape_src = const_array(node.inputs[0]), node.inputs[1]
    else:
        return None
    if fill is None or np.asarray(fill).size == 0 or not np.all(fill == np.ravel(fill)[0]):
        return None
    shape = shape_src.producer() if shape_src is not None else None
    if not is_op(shape, "Shape") or not _whole_shape(shape):
        return None
    src = shape.inputs[0]
    before = scores.producer() if scores is not None else None
    same = src is scores or (
        before is not None and before.op_type in ("Softmax", "Sigmoid") and src is before.inputs[0]
    )
    return np.ravel(fill)[:1] if same else None


def _whole_shape(shape: ir.Node) -> bool:
    """A ``Shape`` node of every axis (no ``end``, ``start`` absent or 0)."""
    return "end" not in shape.attributes and attr_int(shape, "start", 0) == 0


def _zeros_like_scores(z: ir.Value | None, routing: Routing) -> bool:
    """``z`` is zeros of the router scores' shape ``[T, E]``."""
    fill = fill_like_scores(z, routing)
    return fill is not None and bool(np.all(fill == 0))


def _scatter_dense(
    sc: ir.Node, routing: Routing, nodes: list[ir.Node]
) -> tuple[ir.Value, ir.Value]:
    if sc.inputs[1] is not routing.indices:
        raise Refusal(f"{label(sc)}: the expert ids are not the scatter indices", sc)
    if attr_int(sc, "axis", 0) not in (1, -1) or attr_str(sc, "reduction", "none") != "none":
        raise Refusal(f"{label(sc)}: not a plain scatter along the expert axis", sc)
    w = sc.inputs[2]
    check_weights(w, routing)
    if not _zeros_like_scores(sc.inputs[0], routing):
        raise Refusal(
            f"{label(sc)}: the scatter target is not zeros of the router's [T, E] shape", sc
        )
    nodes.append(sc)
    return sc.outputs[0], w


class CapacityRefusal(Refusal):
    """The TopK's ids are also counted over the tokens: a capacity limit (GShard, Switch).

    The layer is a dense MoE for sure (its mask is there), so the pass records this refusal.
    """


def _token_count(masks: list[ir.Node]) -> ir.Node | None:
    """A CumSum over the token axis (axis 0) that a mask's value reaches within a few ops."""
    todo = [(o, 0) for m in masks for o in m.outputs]
    while todo:
        value, depth = todo.pop()
        for user in consumers(value):
            if user.op_type == "CumSum":
                axis = const_array(user.inputs[1]) if len(user.inputs) > 1 else None
                if axis is not None and int(np.asarray(axis).reshape(-1)[0]) == 0:
                    return user
            if depth < 4:
                todo.extend((o, depth + 1) for o in user.outputs)
    return None


def read_dense_weights(routing: Routing) -> DenseWeights | None:
    """The mask built from ``routing``'s indices; None when they feed no mask at all."""
    masks = mask_users(routing.indices)
    if not masks:
        return None
    with part("combine"):
        return _read_mask(routing, masks)


def _read_mask(routing: Routing, masks: list[ir.Node]) -> DenseWeights:
    idx = routing.indices
    per_expert = [n for n in masks if is_op(n, "Equal") and idx in n.inputs]
    at_once = [n for n in masks if n not in per_expert]
    direct = [n for n in consumers(idx) if n.op_type in MASK_OPS or _unsqueezed_ids(n, idx)]
    # the routing weights may read the scores at the selected experts (DeepSeek-V3's
    # scores.gather(1, idx)): those reads stay outside the dense block the pass rewrites
    gathers = [
        n
        for n in consumers(idx)
        if is_op(n, "GatherElements") and len(n.inputs) > 1 and n.inputs[1] is idx
    ]
    if len(direct) + len(gathers) != len(consumers(idx)) or idx.is_graph_output():
        raise Refusal("the expert ids feed something besides the mask", routing.topk)
    nodes: list[ir.Node] = []
    if per_expert and not at_once:
        columns: dict[int, ir.Value] = {}
        weights: set[int] = set()
        w = None
        for eq in per_expert:
            e, col, w = _equal_column(eq, routing, nodes)
            if e in columns:
                raise Refusal(f"expert {e} has two masks", eq)
            columns[e] = col
            weights.add(id(w))
        if len(weights) != 1:
            raise Refusal("the experts' masks are weighted by different values", routing.topk)
        missing = sorted(set(range(routing.experts)) - set(columns))
        if missing or len(columns) != routing.experts:
            raise Refusal(f"no mask for experts {missing} of E = {routing.experts}", routing.topk)
        return DenseWeights(w, columns, None, nodes)
    if len(at_once) != 1 or per_expert:
        counted = _token_count(masks)
        if counted is not None:
            raise CapacityRefusal(
                f"the expert ids are also counted over the tokens (CumSum '{label(counted)}' "
                "along the token axis): a capacity limit that drops tokens from the routing, "
                "which no fused node computes",
                counted,
                part="routing",
            )
        raise Refusal("the expert ids feed more than one mask", routing.topk)
    (mask,) = at_once
    if is_op(mask, "ScatterElements"):
        dense, w = _scatter_dense(mask, routing, nodes)
    else:
        if is_op(mask, "OneHot"):
            if mask.inputs[0] is not idx:
                raise Refusal(f"{label(mask)}: the expert ids are not what is one-hot", mask)
            onehot = _onehot_of_ids(mask, routing, nodes)
        else:
            onehot = _equal_of_ids(mask, routing, nodes)
        dense, w = _weighted_onehot(onehot, routing, nodes)
    return DenseWeights(w, None, dense, nodes)
