"""Small readers the capacity-dispatch proof shares: users, casts, one-hots, lowered einsums.

Each reader checks the structural constants of what it reads (axes, depth, one-hot values, the
range) and raises a :class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` naming the node at
fault; the einsums are read as :mod:`~onnx_moe_fuse.rewrites.canonical.spellings.einsum` lowers
them (Unsqueeze, MatMul or Mul, Squeeze).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.dense.consts import consumers, is_op, other_operand
from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_array, label, node_axes
from onnx_moe_fuse.rewrites.graph.refusals import Refusal

__all__ = [
    "cast_of",
    "lowered_dot",
    "one_hot_of",
    "single",
    "unsqueeze_of",
    "users_of",
]

_INTS = (ir.DataType.INT64, ir.DataType.INT32)


def users_of(value: ir.Value | None) -> list[ir.Node]:
    """The nodes reading ``value``, each once (none for None)."""
    return [] if value is None else consumers(value)


def single(found: list, at: ir.Node | ir.Value, what: str):
    """The one item of ``found``; a refusal at ``at`` saying ``what`` otherwise."""
    if len(found) != 1:
        name = label(at) if isinstance(at, ir.Node) else at.name
        raise Refusal(f"{name}: {what} ({len(found)} found, one expected)", at)
    return found[0]


def cast_of(node: ir.Node, to: ir.DataType | tuple[ir.DataType, ...]) -> bool:
    """``node`` is a ``Cast`` to ``to`` (one type or any of several)."""
    wanted = to if isinstance(to, tuple) else (to,)
    return is_op(node, "Cast") and attr_int(node, "to", None) in [int(t) for t in wanted]


def _axes_match(node: ir.Node, rank: int, want: list[int]) -> bool:
    """``node``'s axes are ``want`` for an output (Unsqueeze) or input (Squeeze) of ``rank``."""
    axes = node_axes(node)
    return axes is not None and sorted(a % rank for a in axes) == want


def unsqueeze_of(value: ir.Value, rank: int, axis: int) -> list[ir.Value]:
    """The outputs of ``Unsqueeze(value, [axis])`` (``value`` of ``rank``)."""
    return [
        n.outputs[0]
        for n in users_of(value)
        if is_op(n, "Unsqueeze") and _axes_match(n, rank + 1, [axis])
    ]


def _is_range(value: ir.Value | None, size: int) -> bool:
    arr = const_array(value)
    return arr is not None and arr.size == size and np.array_equal(arr.reshape(-1), np.arange(size))


def one_hot_of(indices: ir.Value, experts: int) -> tuple[ir.Value, ir.Value | None]:
    """The integer one-hot ``[T, E]`` of a TopK-1's ``[T, 1]`` indices, and its bool form.

    ``OneHot(Squeeze(idx, [1]), E, [0, 1])`` (the bool form is then a Cast of it, found by the
    caller), or ``Cast(Equal(idx, arange(E)), int)`` (the bool form is the Equal).
    """
    for sq in users_of(indices):
        if not (is_op(sq, "Squeeze") and _axes_match(sq, 2, [1])):
            continue
        for oh in users_of(sq.outputs[0]):
            if not is_op(oh, "OneHot") or oh.inputs[0] is not sq.outputs[0]:
                continue
            depth, values = const_array(oh.inputs[1]), const_array(oh.inputs[2])
            if (
                depth is None
                or int(depth.reshape(-1)[0]) != experts
                or values is None
                or values.reshape(-1).tolist() != [0, 1]
                or attr_int(oh, "axis", -1) not in (-1, 1)
            ):
                raise Refusal(f"{label(oh)}: not a one-hot of the choice over the E experts", oh)
            return oh.outputs[0], None
    for eq in users_of(indices):
        if is_op(eq, "Equal") and _is_range(other_operand(eq, indices), experts):
            casts = [n for n in users_of(eq.outputs[0]) if cast_of(n, _INTS)]
            cast = single(casts, eq, "the choice's one-hot as integers")
            return cast.outputs[0], eq.outputs[0]
    raise Refusal(f"{indices.name}: the choice is not one-hot encoded over the experts", indices)


def lowered_dot(probs: ir.Value, mask: ir.Value) -> list[ir.Value]:
    """``sum_e probs[t, e] * mask[t, e]`` ([T]) as the einsum ``se,se->s`` is lowered.

    ``Squeeze(MatMul(Unsqueeze(probs, [1]), Unsqueeze(mask, [2])), [1, 2])``: a ``[T, 1, E]``
    row times a ``[T, E, 1]`` column.
    """
    found = []
    for row in unsqueeze_of(probs, 2, 1):
        for col in unsqueeze_of(mask, 2, 2):
            for mm in users_of(row):
                if is_op(mm, "MatMul") and mm.inputs[0] is row and mm.inputs[1] is col:
                    for sq in users_of(mm.outputs[0]):
                        if is_op(sq, "Squeeze") and _axes_match(sq, 3, [1, 2]):
                            found.append(sq.outputs[0])
    return found
