"""Value-level proofs for the expert-loop pass: the mask, each expert's NonZero coordinates, shapes.

A loop over all experts (optimum-onnx's patched Qwen3-MoE / Mixtral forwards, traced) starts from a
one-hot mask of the routing TopK's ids, transposed to ``[E, k, T]``, and takes each expert's slice
``m_e [k, T]`` apart with ``NonZero``. Each helper here recognises one such piece and says what it
holds, or raises :class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` naming the node when it
cannot prove it:

* :func:`read_mask` - ``Transpose(OneHot(ids, E, [0, on]), [2, 1, 0])`` or
  ``Transpose(Cast(Equal(Unsqueeze(ids, -1), arange(E))), [2, 1, 0])``: ``M[e, s, t]`` is
  nonzero exactly when ``ids[t, s] == e``;
* :func:`read_coords` - ``Gather(M, e)`` (or ``[e]`` + ``Squeeze(0)``), ``NonZero``,
  ``Transpose``, then its two columns (``Split`` + ``Squeeze``, ``Slice`` + ``Squeeze`` or
  ``Gather``): NonZero lists the coordinates of ``m_e`` in row-major order, so column 0 holds the
  slot ids ``s_e`` and column 1 the token ids ``t_e``, pair by pair;
* :func:`topk_values_of` - a ``[T, k]`` value computed from one TopK's values (renormalised,
  softmaxed over k, cast): it has the TopK's shape;
* :func:`is_k` - a value holding ``k`` (a constant, or dim 1 of such a ``[T, k]`` value);
* :func:`is_zeros_like` - zeros shaped exactly like the tokens (``ConstantOfShape`` /
  ``Expand`` of a zero scalar to a shape the graph computes from the tokens' dims).

Only reads the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.value_proofs import producer_op, small_const, uses
from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_array, const_ints, label, node_axes
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.graph.symbolic_dims import shape_value, value_dims

__all__ = [
    "Mask",
    "Coords",
    "read_mask",
    "read_coords",
    "topk_values_of",
    "is_k",
    "is_zeros_like",
    "squeezed_column",
    "unsqueezed_last",
]

_STD = ("", "ai.onnx")


@dataclass
class Mask:
    """``M [E, k, T]``: nonzero at ``(e, s, t)`` exactly when ``ids[t, s] == e``."""

    value: ir.Value
    experts: int
    on: float  # the mask's value where ids[t, s] == e (0 elsewhere)
    nodes: list[ir.Node] = field(default_factory=list)


@dataclass
class Coords:
    """One expert's slice of the mask taken apart: its index, slot ids and token ids."""

    expert: int
    slots: ir.Value  # s_e [n]
    tokens: ir.Value  # t_e [n]
    nodes: list[ir.Node] = field(default_factory=list)


def unsqueezed_last(value: ir.Value | None, of: ir.Value) -> bool:
    """``value`` is ``Unsqueeze(of, [-1])`` (or ``[1]``) of the 1-D ids ``of``: ``[n, 1]``."""
    node = producer_op(value, "Unsqueeze")
    return node is not None and node.inputs[0] is of and node_axes(node) in ([-1], [1])


def _only_use(value: ir.Value) -> ir.Node | None:
    users = uses(value)
    return users[0] if len(users) == 1 and not value.is_graph_output() else None


def _nonzero_after_cast(node: ir.Node, on: float) -> bool:
    """A ``Cast`` that keeps the one-hot's ``on`` value nonzero (and 0 zero)."""
    to = attr_int(node, "to", None)
    if to is None:
        return False
    try:
        return bool(np.asarray(on).astype(ir.DataType(to).numpy()) != 0)
    except (TypeError, ValueError):
        return False


def _one_hot(node: ir.Node, ids: ir.Value) -> tuple[int, float] | None:
    """``(depth, on)`` of ``OneHot(ids, depth, [0, on], axis=-1)``; None for another OneHot."""
    last_axis = attr_int(node, "axis", -1) in (-1, 2)
    if node.inputs[0] is not ids or len(node.inputs) < 3 or not last_axis:
        return None
    depth, values = small_const(node.inputs[1]), small_const(node.inputs[2], limit=2)
    if depth is None or values is None or depth.size != 1 or values.size != 2:
        return None
    off, on = values.reshape(-1)
    if off != 0 or on == 0:
        return None
    return int(depth.reshape(-1)[0]), float(on)


def _equal_range(node: ir.Node, ids: ir.Value) -> int | None:
    """``E`` for ``Equal(Unsqueeze(ids, [-1]), arange(E))`` (either operand order)."""
    for a, b in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        unsq = producer_op(a, "Unsqueeze")
        if unsq is None or unsq.inputs[0] is not ids or node_axes(unsq) not in ([-1], [2]):
            continue
        arange = const_array(b)
        if arange is not None and arange.ndim == 1 and arange.size > 0:
            if np.array_equal(arange, np.arange(arange.size)):
                return int(arange.size)
    return None


def read_mask(topk: ir.Node) -> Mask | None:
    """The ``[E, k, T]`` expert mask built from ``topk``'s ids, or None when there is none.

    None (not a refusal) when the ids feed no one-hot transposed to ``[E, k, T]``: that is no
    loop over the experts (the dense form, say, which another pass reads).
    """
    ids = topk.outputs[1]
    for user in uses(ids):
        nodes: list[ir.Node] = [user]
        if user.op_type == "OneHot" and user.domain in _STD:
            found = _one_hot(user, ids)
            if found is None:
                continue
            experts, on = found
        elif user.op_type == "Unsqueeze" and user.domain in _STD:
            equal = _only_use(user.outputs[0])
            experts = _equal_range(equal, ids) if equal is not None else None
            if equal is None or equal.op_type != "Equal" or experts is None:
                continue
            nodes.append(equal)
            on = 1.0
        else:
            continue
        value = nodes[-1].outputs[0]
        step = _only_use(value)
        while step is not None and step.op_type == "Cast" and _nonzero_after_cast(step, on):
            nodes.append(step)
            value = step.outputs[0]
            step = _only_use(value)
        if step is None or step.op_type != "Transpose" or step.domain not in _STD:
            continue
        perm = step.attributes.get("perm")
        if perm is None or list(perm.value) != [2, 1, 0]:
            continue
        nodes.append(step)
        return Mask(step.outputs[0], experts, on, nodes)
    return None


def _expert_index(gather: ir.Node, experts: int) -> tuple[int, ir.Value, list[ir.Node]]:
    """``(e, m_e, nodes)`` for ``Gather(M, e)`` or ``Squeeze(Gather(M, [e]), [0])``."""
    index = small_const(gather.inputs[1])
    if attr_int(gather, "axis", 0) != 0 or index is None or index.size != 1:
        raise Refusal(f"mask: {label(gather)} does not pick one expert's slice of the mask")
    e = int(index.reshape(-1)[0])
    e = e + experts if e < 0 else e
    if not 0 <= e < experts:
        raise Refusal(f"mask: {label(gather)} picks expert {e}, outside 0..{experts - 1}")
    value, nodes = gather.outputs[0], [gather]
    nxt = _only_use(value)
    if index.ndim == 1:
        if nxt is None or nxt.op_type != "Squeeze" or node_axes(nxt) != [0]:
            raise Refusal(f"mask: {label(gather)} keeps the expert axis of the mask")
        nodes.append(nxt)
        value = nxt.outputs[0]
    elif nxt is not None and nxt.op_type == "Squeeze":
        raise Refusal(
            f"mask: {label(nxt)} squeezes the slot axis of expert {e}'s [k, T] mask slice, so "
            "NonZero does not give (slot, token) pairs (for k > 1 ONNX Runtime refuses that "
            "Squeeze: torch.onnx writes torch's no-op squeeze(0) this way)"
        )
    return e, value, nodes


def squeezed_column(value: ir.Value) -> tuple[int, ir.Value, list[ir.Node]] | None:
    """``(c, column, nodes)`` when ``value`` is column ``c`` of an ``[n, 2]`` matrix, 1-D.

    Spellings: ``Squeeze(Split(m, axis=1)[c], [1])``, ``Squeeze(Slice(m, [c], [c+1], [1]), [1])``
    and ``Gather(m, c, axis=1)``. ``value`` is the final column; the matrix is not returned
    (the caller checks every column comes from the same one through ``nodes[0]``).
    """
    gather = producer_op(value, "Gather")
    if gather is not None:
        c = small_const(gather.inputs[1])
        if attr_int(gather, "axis", 0) in (1, -1) and c is not None and c.ndim == 0:
            return int(c), value, [gather]
        return None
    squeeze = producer_op(value, "Squeeze")
    if squeeze is None or node_axes(squeeze) not in ([1], [-1]):
        return None
    inner = squeeze.inputs[0]
    split = producer_op(inner, "Split")
    if split is not None:
        sizes = const_ints(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] else None
        if attr_int(split, "axis", 0) not in (1, -1) or len(split.outputs) != 2:
            return None
        if sizes is not None and sizes != [1, 1]:
            return None
        return inner.index(), value, [split, squeeze]
    sl = producer_op(inner, "Slice")
    if sl is None:
        return None
    args = [const_ints(v) if v is not None else None for v in sl.inputs[1:]]
    starts, ends = args[0], args[1]
    axes = args[2] if len(args) > 2 else None
    steps = args[3] if len(args) > 3 else None
    if starts is None or ends is None or len(starts) != 1 or axes not in ([1], [-1]):
        return None
    if len(sl.inputs) > 4 and sl.inputs[4] is not None and steps != [1]:
        return None
    c = starts[0]
    if c not in (0, 1) or ends[0] != c + 1:
        return None
    return c, value, [sl, squeeze]


def read_coords(gather: ir.Node, mask: Mask) -> Coords:
    """Expert ``e``'s slot and token ids from its ``Gather`` of the mask; refuses otherwise."""
    e, value, nodes = _expert_index(gather, mask.experts)
    step = _only_use(value)
    while step is not None and step.op_type == "Cast" and _nonzero_after_cast(step, mask.on):
        nodes.append(step)  # the mask cast to bool (or another type) keeps its nonzeros
        value = step.outputs[0]
        step = _only_use(value)
    if step is None or step.op_type != "NonZero":
        raise Refusal(f"expert {e}: the mask slice {value.name!r} is not read by one NonZero only")
    nodes.append(step)
    transpose = _only_use(step.outputs[0])
    perm = transpose.attributes.get("perm") if transpose is not None else None
    if transpose is None or transpose.op_type != "Transpose" or perm is None:
        raise Refusal(f"expert {e}: the NonZero coordinates are not transposed to [n, 2]")
    if list(perm.value) != [1, 0]:
        raise Refusal(f"expert {e}: {label(transpose)} is not a [1, 0] transpose")
    nodes.append(transpose)
    pairs = transpose.outputs[0]
    columns: dict[int, ir.Value] = {}
    for user in uses(pairs):
        outs = user.outputs if user.op_type == "Split" else user.outputs[:1]
        for out in outs:
            for candidate in [out, *[o for n in uses(out) for o in n.outputs]]:
                found = squeezed_column(candidate)
                if found is None or found[2][0] is not user:
                    continue
                c, column, col_nodes = found
                if c in columns and columns[c] is not column:
                    raise Refusal(f"expert {e}: column {c} of {pairs.name!r} is taken twice")
                columns[c] = column
                nodes.extend(n for n in col_nodes if n not in nodes)
    if set(columns) != {0, 1}:
        raise Refusal(f"expert {e}: the slot and token ids are not both read off {pairs.name!r}")
    return Coords(e, columns[0], columns[1], nodes)


_ROUTING_UNARY = ("Cast", "Identity", "Softmax")
_ROUTING_BINARY = ("Div", "Mul", "Add", "Sub")


def topk_values_of(value: ir.Value, depth: int = 0) -> ir.Node | None:
    """The TopK whose ``[T, k]`` values ``value`` is computed from, shape for shape; else None.

    Element-wise ops of the values, a ``Softmax`` over them, and binary ops whose other operand
    is a scalar constant or a ``ReduceSum`` over the last axis (``keepdims=1``) of such a value
    (the renormalisation) all keep the shape ``[T, k]``.
    """
    node = value.producer()
    if node is None or node.domain not in _STD or depth > 16:
        return None
    if node.op_type == "TopK":
        return node if value.index() == 0 else None
    if node.op_type in _ROUTING_UNARY:
        return topk_values_of(node.inputs[0], depth + 1)
    if node.op_type in _ROUTING_BINARY and len(node.inputs) == 2:
        found = [topk_values_of(v, depth + 1) for v in node.inputs]
        for this, other, other_topk in ((0, 1, found[1]), (1, 0, found[0])):
            topk = found[this]
            if topk is None:
                continue
            b = node.inputs[other]
            if other_topk is topk or (small_const(b) is not None and small_const(b).size == 1):
                return topk
            reduce = producer_op(b, "ReduceSum")
            if (
                reduce is not None
                and attr_int(reduce, "keepdims", 1) == 1
                and node_axes(reduce) in ([-1], [1])
                and topk_values_of(reduce.inputs[0], depth + 1) is topk
            ):
                return topk
    return None


def is_k(value: ir.Value | None, k: int, weights: ir.Value) -> bool:
    """``value`` holds ``k`` (or ``[k]``): a constant, or dim 1 of the ``[T, k]`` weights.

    The dim spelling is ``Gather(Shape(w'), 1)`` with ``w'`` the weights or
    ``Unsqueeze(weights, [2])`` (dim 1 of either is k), possibly reshaped to a scalar.
    """
    if value is None:
        return False
    const = small_const(value)
    if const is not None:
        return const.size == 1 and int(const.reshape(-1)[0]) == k
    known = shape_value(value)
    if known is not None and known.ints is not None:
        return known.ints == [k]
    node = value.producer()
    while node is not None and node.op_type in ("Squeeze", "Reshape", "Unsqueeze", "Cast"):
        value = node.inputs[0]
        node = value.producer()
    if node is None or node.op_type != "Gather" or attr_int(node, "axis", 0) != 0:
        return False
    index = small_const(node.inputs[1])
    shape = producer_op(node.inputs[0], "Shape")
    if index is None or index.size != 1 or int(index.reshape(-1)[0]) != 1 or shape is None:
        return False
    if attr_int(shape, "start", 0) != 0 or attr_int(shape, "end", None) is not None:
        return False
    source = shape.inputs[0]
    unsq = producer_op(source, "Unsqueeze")
    if unsq is not None and node_axes(unsq) in ([2], [-1]):
        source = unsq.inputs[0]
    return source is weights


def is_zeros_like(value: ir.Value, tokens: ir.Value) -> bool:
    """``value`` is all zeros with exactly the dims of ``tokens`` ``[T, H]``.

    ``ConstantOfShape(s)`` (value 0 or absent) or ``Expand(0, s)`` with ``s`` evaluating to the
    tokens' dims, or a zero constant of the tokens' static shape.
    """
    dims = value_dims(tokens)
    if dims is None:
        return False
    producer = value.producer()
    constant = producer is None or (producer.op_type == "Constant" and producer.domain in _STD)
    array = const_array(value) if constant else None
    if array is not None:
        static = [d.coef for d in dims] if all(not d.syms for d in dims) else None
        return static is not None and list(array.shape) == static and not np.any(array)
    node = producer_op(value, "ConstantOfShape", "Expand")
    if node is None:
        return False
    if node.op_type == "ConstantOfShape":
        attr = node.attributes.get("value")
        if attr is not None and np.any(attr.value.numpy()):
            return False
        shape = node.inputs[0]
    else:
        fill = small_const(node.inputs[0])
        if fill is None or fill.size != 1 or np.any(fill):
            return False
        shape = node.inputs[1]
    known = shape_value(shape)
    return known is not None and list(known.dims) == dims
