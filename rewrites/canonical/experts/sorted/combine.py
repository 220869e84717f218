"""The tail of a sorted-experts block: the un-sort by the inverse permutation, and the combine.

After the second projection the rows are in sorted order. The block weights them by the routing
weights gathered with the same permutation, puts them back in slot order (the inverse
permutation) and sums the k slots of each token, in one of these spellings:

* un-sort: ``GatherND(rows, Unsqueeze(inv, -1))`` or ``Gather(rows, inv)`` with
  ``inv = ScatterND(blank, Unsqueeze(perm, -1), Range(0, n, 1))`` (or ``ScatterElements``), or
  the direct ``ScatterND(blank, Unsqueeze(perm, -1), rows)``, ``blank`` shaped exactly like what
  is scattered into it (``Expand(c, Shape(_))`` or ``ConstantOfShape``), so every element is
  overwritten; static exports fold ``blank`` into a constant of that shape and ``Range(0, n, 1)``
  into the constant ``arange(n)``, which is checked value by value;
* weighting before the un-sort (weights gathered by ``perm``) or after it (flat weights);
* then ``Reshape(_, [-1, k, H])`` (static: ``[T, k, H]`` with ``T * k`` rows) and
  ``ReduceSum(axes=[1], keepdims=0)``;
* in a float16/bfloat16 export, a widening Cast to float32 of FC2's rows before the weighting,
  or of the reshaped slots before the sum (exact: the sum is over float32 values).

:func:`combine` proves one of them for the ``perm`` of the block's argsort (an un-sort by another
permutation is refused) and returns the layer output and the ``[T, k]`` routing weights. Only
reads the graph.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.value_proofs import (
    const_shape,
    is_unsqueeze_last,
    producer_op,
    small_const,
    uses,
)
from onnx_moe_fuse.rewrites.graph.facts import attr_int, attr_str, const_ints
from onnx_moe_fuse.rewrites.graph.facts import node_axes as _axes
from onnx_moe_fuse.rewrites.graph.refusals import Refusal

__all__ = ["combine"]


def _is_blank_like(data: ir.Value, like: ir.Value) -> bool:
    """``data`` has exactly ``like``'s shape: ``Expand(c, Shape(like))`` / ``ConstantOfShape``.

    A scatter into it by a permutation of ``like``'s rows then overwrites every element, and
    the result has no rows beyond the scattered ones.
    """
    if _static_dims(like) is not None and const_shape(data) == _static_dims(like):
        # A static export folds the blank into a constant of exactly that shape (its values are
        # all overwritten, so only the shape matters and the data is not read).
        return True
    node = producer_op(data, "Expand", "ConstantOfShape")
    if node is None:
        return False
    if node.op_type == "Expand" and const_shape(node.inputs[0]) not in ((), (1,)):
        return False
    shape = producer_op(node.inputs[-1], "Shape")
    return (
        shape is not None
        and shape.inputs[0] is like
        and attr_int(shape, "start", 0) == 0
        and attr_int(shape, "end", None) is None
    )


def _is_inverse_of(inv: ir.Value, perm: ir.Value) -> bool:
    """``inv`` is the inverse permutation of ``perm``: ``inv[perm[p]] = p``."""
    node = producer_op(inv, "ScatterND", "ScatterElements")
    if node is None or attr_str(node, "reduction", "none") != "none":
        return False
    if not _is_blank_like(node.inputs[0], perm):
        return False
    if node.op_type == "ScatterND":
        if not is_unsqueeze_last(node.inputs[1], perm):
            return False
    elif node.inputs[1] is not perm or attr_int(node, "axis", 0) != 0:
        return False
    return _is_arange(node.inputs[2], perm)


def _static_dims(value: ir.Value) -> tuple[int, ...] | None:
    """``value``'s shape when every dim is a known integer, else None."""
    if value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return tuple(value.shape)


def _is_arange(value: ir.Value, perm: ir.Value) -> bool:
    """``value`` holds ``0, 1, ..., n-1``: ``Range(0, _, 1)``, or a constant of ``perm``'s length.

    A static export folds ``Range(0, n, 1)`` into its values; they are read and compared with
    ``arange(n)``, ``n`` the static length of ``perm``. (A Range's length is not proved: ScatterND
    needs as many updates as indices, so on a model that runs it is ``perm``'s.)
    """
    rng = producer_op(value, "Range")
    if rng is not None:
        return const_ints(rng.inputs[0]) == [0] and const_ints(rng.inputs[2]) == [1]
    dims = _static_dims(perm)
    if dims is None or len(dims) != 1 or const_shape(value) != dims:
        return False
    arange = small_const(value, limit=dims[0])
    return (
        arange is not None
        and arange.dtype.kind in "iu"
        and np.array_equal(arange, np.arange(dims[0]))
    )


def _sole_user(value: ir.Value) -> ir.Node | None:
    """The one user of ``value`` besides ``Shape`` nodes (which read its shape only), or None."""
    users = [n for n in uses(value) if n.op_type != "Shape"]
    return users[0] if len(users) == 1 else None


def _unsorted(value: ir.Value, perm: ir.Value) -> ir.Value | None:
    """The un-sort of ``value`` by ``perm`` when its one user is one; else None."""
    node = _sole_user(value)
    if node is None:
        return None
    if (
        node.op_type == "GatherND"
        and node.inputs[0] is value
        and attr_int(node, "batch_dims", 0) == 0
    ):
        index = producer_op(node.inputs[1], "Unsqueeze")
        if index is not None and is_unsqueeze_last(node.inputs[1], index.inputs[0]):
            if _is_inverse_of(index.inputs[0], perm):
                return node.outputs[0]
    if node.op_type == "Gather" and node.inputs[0] is value and attr_int(node, "axis", 0) == 0:
        if _is_inverse_of(node.inputs[1], perm):
            return node.outputs[0]
    if (
        node.op_type == "ScatterND"
        and node.inputs[2] is value
        and attr_str(node, "reduction", "none") == "none"
        and is_unsqueeze_last(node.inputs[1], perm)
        and _is_blank_like(node.inputs[0], value)
    ):
        return node.outputs[0]
    return None


def _weights_column(value: ir.Value, perm: ir.Value | None) -> ir.Value | None:
    """The ``[T, k]`` routing weights when ``value`` is their flat column (sorted by ``perm``)."""
    unsq = producer_op(value, "Unsqueeze")
    if unsq is None or _axes(unsq) not in ([-1], [1]):
        return None
    flat = unsq.inputs[0]
    if perm is not None:
        gnd = producer_op(flat, "GatherND")
        gat = producer_op(flat, "Gather")
        if (
            gnd is not None
            and attr_int(gnd, "batch_dims", 0) == 0
            and is_unsqueeze_last(gnd.inputs[1], perm)
        ):
            flat = gnd.inputs[0]
        elif gat is not None and attr_int(gat, "axis", 0) == 0 and gat.inputs[1] is perm:
            flat = gat.inputs[0]
        else:
            return None
    reshape = producer_op(flat, "Reshape")
    if reshape is None or const_ints(reshape.inputs[1]) != [-1]:
        return None
    return reshape.inputs[0]


def _weighted(value: ir.Value, perm: ir.Value | None) -> tuple[ir.Value, ir.Value] | None:
    """``(product, weights)`` when the one user of ``value`` multiplies it by a weight column."""
    mul = _sole_user(value)
    if mul is None or mul.op_type != "Mul":
        return None
    other = mul.inputs[1] if mul.inputs[0] is value else mul.inputs[0]
    weights = _weights_column(other, perm)
    return (mul.outputs[0], weights) if weights is not None else None


def _is_slots_shape(shape: list[int] | None, perm: ir.Value, k: int, hidden: int) -> bool:
    """``shape`` splits the ``n`` rows into ``[n // k, k, hidden]``: ``[-1, k, H]`` or static.

    A static export writes ``[T, k, H]``; that is the same split when ``T * k`` is ``perm``'s
    static length ``n`` (the number of rows).
    """
    if shape is None or len(shape) != 3 or shape[1:] != [k, hidden]:
        return False
    if shape[0] == -1:
        return True
    dims = _static_dims(perm)
    return dims is not None and len(dims) == 1 and shape[0] * k == dims[0]


_HALF = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_WIDE = (ir.DataType.FLOAT, ir.DataType.DOUBLE)


def _upcast(value: ir.Value) -> ir.Node | None:
    """The one user of ``value`` when it is a widening float Cast (float16 -> float32), else None.

    A float16/bfloat16 grouped_mm export sums its experts' outputs in float32: the Cast is exact.
    """
    node = _sole_user(value)
    if node is None or node.op_type != "Cast" or value.dtype not in _HALF:
        return None
    to = attr_int(node, "to", 0)
    return node if to and ir.DataType(to) in _WIDE else None


def combine(
    fc2: ir.Value, perm: ir.Value, k: int, hidden: int
) -> tuple[ir.Value, ir.Value, ir.DataType | None]:
    """Prove un-sort + weighting + sum over k.

    Returns ``(layer_out, weights [T, k], upcast)``: ``upcast`` is the wider float type a
    half-precision block casts FC2's rows to before it weights them, or the weighted slots to
    before it sums them (None: no cast).
    """
    upcast: ir.DataType | None = None
    cast = _upcast(fc2)
    if cast is not None:
        fc2, upcast = cast.outputs[0], ir.DataType(attr_int(cast, "to", 0))
    weighted = _weighted(fc2, perm)
    if weighted is not None:
        product, weights = weighted
        rows = _unsorted(product, perm)
    else:
        unsorted = _unsorted(fc2, perm)
        weighted = _weighted(unsorted, None) if unsorted is not None else None
        if weighted is None:
            raise Refusal(
                f"{fc2.name!r} is not weighted and un-sorted by the inverse of the same permutation"
            )
        rows, weights = weighted
    if rows is None:
        raise Refusal("the weighted rows are not un-sorted by the inverse of the same permutation")
    users = uses(rows)
    reshape = users[0] if len(users) == 1 and users[0].op_type == "Reshape" else None
    if reshape is None or not _is_slots_shape(const_ints(reshape.inputs[1]), perm, k, hidden):
        raise Refusal(f"the un-sorted rows {rows.name!r} are not reshaped to [-1, {k}, {hidden}]")
    summed = reshape.outputs[0]
    cast = _upcast(summed) if upcast is None else None
    if cast is not None:
        summed, upcast = cast.outputs[0], ir.DataType(attr_int(cast, "to", 0))
    users = uses(summed)
    reduce = users[0] if len(users) == 1 and users[0].op_type == "ReduceSum" else None
    if reduce is None or _axes(reduce) != [1] or attr_int(reduce, "keepdims", 1) != 0:
        raise Refusal(f"{summed.name!r} is not summed over the k slots (axes=[1])")
    if weights.shape is None or len(weights.shape) != 2 or weights.shape[1] != k:
        raise Refusal(f"the routing weights {weights.name!r} are not [T, {k}]")
    return reduce.outputs[0], weights, upcast
