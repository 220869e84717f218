"""Small value-level proofs for the sorted-experts pass: what one value provably holds.

The grouped_mm (sorted rows) experts block computes its segment boundaries, its token rows and its
histogram with short index-arithmetic chains. Each helper here recognises one such chain and says
what it computes, or returns ``None`` when it cannot prove it (never guesses):

* :func:`is_unsqueeze_last` - ``Unsqueeze(v, [-1])`` on a 1-D ``v`` (GatherND / ScatterND index);
* :func:`is_length_of` - a value holding ``[len(flat)]`` (the K of an argsort TopK);
* :func:`is_floor_div` - ``perm // k`` for a non-negative ``perm`` (torch's floor-divide spelling);
* :func:`offset_position` - ``offsets[i]`` picked out of a 1-D offsets tensor (Split/Gather);
* :func:`elementwise_eval` - evaluates an elementwise chain of a leaf on given leaf values, which
  proves what the chain computes when the leaf can only take those values.

Only reads the graph.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_array, const_ints, node_axes
from onnx_moe_fuse.rewrites.graph.numpy_ops import BINARY_OPS, UNARY_OPS

__all__ = [
    "const_shape",
    "small_const",
    "uses",
    "producer_op",
    "strip",
    "is_unsqueeze_last",
    "is_length_of",
    "is_floor_div",
    "offset_position",
    "elementwise_eval",
]

_DEFAULT_DOMAINS = ("", "ai.onnx")


def uses(value: ir.Value) -> list[ir.Node]:
    """The nodes that use ``value`` (one entry per use)."""
    return [use.node for use in value.uses()]


def const_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    """The shape of the constant held by ``value`` (its data is not loaded), or None."""
    if value is None or value.is_graph_input():
        return None
    tensor = value.const_value
    if tensor is None:
        node = value.producer()
        if node is None or node.op_type != "Constant":
            return None
        tensor = ir.convenience.get_const_tensor(value)
        if tensor is None:
            return None
    return tuple(int(d) for d in tensor.shape)


def small_const(value: ir.Value | None, limit: int = 1) -> np.ndarray | None:
    """The constant held by ``value`` when it has at most ``limit`` elements (weights unread)."""
    shape = const_shape(value)
    if shape is None or int(np.prod(shape, dtype=np.int64)) > limit:
        return None
    return const_array(value)


def producer_op(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    """The producer of ``value`` when it is a default-domain node of one of ``op_types``."""
    if value is None:
        return None
    node = value.producer()
    if node is None or node.domain not in _DEFAULT_DOMAINS or node.op_type not in op_types:
        return None
    return node


def strip(value: ir.Value, ops: Callable[[ir.Node], bool]) -> ir.Value:
    """Follow input 0 back through every producer for which ``ops(node)`` holds."""
    seen = 0
    while seen < 64:
        node = value.producer()
        if node is None or node.domain not in _DEFAULT_DOMAINS or not ops(node):
            return value
        value = node.inputs[0]
        seen += 1
    return value


def _rank(value: ir.Value) -> int | None:
    return len(value.shape) if value.shape is not None else None


def is_unsqueeze_last(index: ir.Value, of: ir.Value) -> bool:
    """True when ``index`` is ``Unsqueeze(of, [-1])`` (or ``[1]``) with ``of`` one-dimensional."""
    node = producer_op(index, "Unsqueeze")
    if node is None or node.inputs[0] is not of:
        return False
    axes = node_axes(node)
    return axes in ([-1], [1]) and _rank(of) == 1


def _is_shape_of(value: ir.Value, flat: ir.Value) -> bool:
    node = producer_op(value, "Shape")
    if node is None or node.inputs[0] is not flat:
        return False
    start = attr_int(node, "start", 0)
    end = attr_int(node, "end", None)
    return start in (0, -1) and end in (None, 1)


def is_length_of(value: ir.Value | None, flat: ir.Value) -> bool:
    """True when ``value`` provably holds ``[n]`` (or ``n``), ``n`` the length of 1-D ``flat``."""
    if value is None or _rank(flat) != 1:
        return False
    const = const_ints(value)
    if const is not None:
        dim = flat.shape[0] if flat.shape is not None else None
        return len(const) == 1 and isinstance(dim, int) and const[0] == dim
    inner = strip(value, lambda n: n.op_type in ("Reshape", "Unsqueeze", "Squeeze", "Identity"))
    if _is_shape_of(inner, flat):
        return True
    gather = producer_op(inner, "Gather")
    if gather is None or attr_int(gather, "axis", 0) != 0:
        return False
    return _is_shape_of(gather.inputs[0], flat) and const_ints(gather.inputs[1]) in ([0], [-1])


def _is_const(value: ir.Value | None, want: Callable[[np.ndarray], bool]) -> bool:
    arr = small_const(value)
    return arr is not None and arr.size == 1 and bool(want(arr.reshape(-1)[0]))


def _false_when_nonnegative(value: ir.Value, perm: ir.Value) -> bool:
    """``value`` is ``perm < c`` (c <= 0), or that compared ``== True``: False for perm >= 0."""
    node = producer_op(value, "Less")
    if node is not None:
        return node.inputs[0] is perm and _is_const(node.inputs[1], lambda c: c <= 0)
    node = producer_op(value, "Equal")
    if node is None:
        return False
    for this, other in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        if _is_const(other, lambda c: c.dtype == np.bool_ and bool(c)):
            return _false_when_nonnegative(this, perm)
    return False


def _is_integer(value: ir.Value) -> bool:
    return value.dtype is not None and value.dtype.is_integer()


def is_floor_div(value: ir.Value, perm: ir.Value, k: int) -> bool:
    """True when ``value`` is ``perm // k`` given ``perm >= 0`` (argsort indices are).

    Accepts ``Div(perm, k)`` on integers (truncation equals floor for non-negative operands) and
    torch's floor-divide spelling ``Div(perm, k) - Cast(And(neg, Cast(Mod(perm, k))))`` whose
    correction is zero because ``neg`` is a ``perm < 0`` test.
    """
    if not _is_integer(perm):
        return False

    def is_trunc_div(v: ir.Value) -> bool:
        div = producer_op(v, "Div")
        return (
            div is not None
            and div.inputs[0] is perm
            and _is_const(div.inputs[1], lambda c: c.dtype.kind in "iu" and int(c) == k)
        )

    if is_trunc_div(value):
        return True
    sub = producer_op(value, "Sub")
    if sub is None or not is_trunc_div(sub.inputs[0]):
        return False
    cast = producer_op(sub.inputs[1], "Cast")
    conj = producer_op(cast.inputs[0] if cast is not None else None, "And")
    if conj is None:
        return False
    return any(_false_when_nonnegative(v, perm) for v in conj.inputs)


def offset_position(value: ir.Value) -> tuple[ir.Value, int] | None:
    """``(offsets, i)`` when ``value`` is the scalar ``offsets[i]`` of a 1-D ``offsets``.

    Spellings: ``Squeeze(Split(offsets, axis=0)[i])`` with one element per output, or
    ``Gather(offsets, i, axis=0)`` with a constant scalar ``i``.
    """
    inner = strip(value, lambda n: n.op_type in ("Squeeze", "Identity") or _is_scalar_reshape(n))
    gather = producer_op(inner, "Gather")
    if gather is not None:
        index = small_const(gather.inputs[1])
        if attr_int(gather, "axis", 0) != 0 or index is None or index.shape != ():
            return None
        offsets = gather.inputs[0]
        n = offsets.shape[0] if offsets.shape is not None and len(offsets.shape) == 1 else None
        if not isinstance(n, int) or not 0 <= int(index) < n:
            return None
        return offsets, int(index)
    split = producer_op(inner, "Split")
    if split is None or attr_int(split, "axis", 0) != 0:
        return None
    offsets = split.inputs[0]
    if _rank(offsets) != 1:
        return None
    parts = len(split.outputs)
    sizes = const_ints(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] else None
    if sizes is None:
        n = offsets.shape[0]
        if not isinstance(n, int) or n != parts:
            return None
    elif sizes != [1] * parts:
        return None
    return offsets, inner.index()


def _is_scalar_reshape(node: ir.Node) -> bool:
    return node.op_type == "Reshape" and const_ints(node.inputs[1]) == []


# -- elementwise chains ------------------------------------------------------------------------


def elementwise_eval(value: ir.Value, leaf: ir.Value, samples: np.ndarray) -> np.ndarray | None:
    """``value`` evaluated with ``leaf`` set to ``samples``, when ``value`` is elementwise in it.

    Every node between ``leaf`` and ``value`` must be an elementwise op whose other operands are
    one-element constants (a Reshape to ``[-1]`` of a 1-D value counts, it keeps the elements);
    otherwise None. Because each output element depends on the matching leaf element alone, the
    result for ``samples`` holding every value the leaf can take is a complete description of the
    chain.
    """
    memo: dict[int, np.ndarray] = {}

    def ev(v: ir.Value, depth: int) -> np.ndarray | None:
        if v is leaf:
            return samples
        if id(v) in memo:
            return memo[id(v)]
        if const_shape(v) is not None:
            arr = small_const(v)
            return arr.reshape(()) if arr is not None else None
        node = v.producer()
        if node is None or node.domain not in _DEFAULT_DOMAINS or depth > 64:
            return None
        out = _eval_node(node, lambda x: ev(x, depth + 1))
        if out is not None:
            memo[id(v)] = out
        return out

    result = ev(value, 0)
    if result is None or result.shape != samples.shape:
        return None
    return result


def _eval_node(node: ir.Node, ev: Callable[[ir.Value], np.ndarray | None]) -> np.ndarray | None:
    op = node.op_type
    if op == "Cast":
        to = node.attributes.get("to")
        if to is None:
            return None
        a = ev(node.inputs[0])
        return None if a is None else a.astype(ir.DataType(to.value).numpy())
    if op == "Reshape":
        if const_ints(node.inputs[1]) != [-1] or _rank(node.inputs[0]) != 1:
            return None
        return ev(node.inputs[0])
    if op == "Where":
        args = [ev(x) for x in node.inputs]
        return None if any(a is None for a in args) else np.where(*args)
    fn = BINARY_OPS.get(op)
    if fn is not None and len(node.inputs) == 2:
        a, b = ev(node.inputs[0]), ev(node.inputs[1])
        if a is None or b is None:
            return None
        with np.errstate(all="ignore"):
            return np.asarray(fn(a, b))
    if op in UNARY_OPS:
        a = ev(node.inputs[0])
        return None if a is None else np.asarray(UNARY_OPS[op](a))
    return None
