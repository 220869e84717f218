"""Symbolic dimensions: :class:`Dim` products, and what single ops do to lists of them.

A :class:`Dim` is ``coef * sym_1 * sym_2 ...``: an integer times named factors (a symbolic dim of
a declared shape, or an unknown size tied to the value and axis it comes from).
:func:`reshape_dims` applies a ``Reshape`` target to symbolic dims; :func:`broadcast_dims`,
:func:`reduced_dims`, :func:`split_dims` and :func:`sliced_dims` give the dims of one op's output
from the dims of its input. Nothing here follows the graph: :mod:`.symbolic_dims` does, and calls
these for each op it meets.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_ints, node_axes, normalize_axes

__all__ = [
    "Dim",
    "broadcast_dims",
    "product",
    "reduced_dims",
    "reshape_dims",
    "sliced_dims",
    "split_dims",
    "unknown_dim",
]


@dataclass(frozen=True)
class Dim:
    """A dimension as a product ``coef * sym_1 * sym_2 ...`` of an int and named factors."""

    coef: int = 1
    syms: tuple[str, ...] = ()

    @staticmethod
    def sym(name: str) -> Dim:
        """A named, unknown dimension."""
        return Dim(1, (name,))

    @staticmethod
    def of(n: int) -> Dim:
        """A known dimension."""
        return Dim(int(n), ())

    def __mul__(self, other: Dim) -> Dim:
        """The product of two dims."""
        return Dim(self.coef * other.coef, tuple(sorted(self.syms + other.syms)))

    def divide(self, other: Dim) -> Dim | None:
        """``self / other`` when it is exact (as a product of factors), else None."""
        if other.coef == 0 or self.coef % other.coef:
            return None
        mine, theirs = Counter(self.syms), Counter(other.syms)
        if theirs - mine:
            return None
        return Dim(self.coef // other.coef, tuple(sorted((mine - theirs).elements())))

    def __str__(self) -> str:
        """E.g. ``2*M`` or ``64``."""
        parts = ([str(self.coef)] if self.coef != 1 or not self.syms else []) + list(self.syms)
        return "*".join(parts)


def product(dims: Sequence[Dim]) -> Dim:
    """The product of ``dims``."""
    out = Dim.of(1)
    for d in dims:
        out = out * d
    return out


def reshape_dims(
    in_dims: Sequence[Dim], shape: Sequence[int | Dim], allowzero: int = 0
) -> list[Dim] | None:
    """Apply ``Reshape(shape)`` to a symbolic input shape; None if not provably valid.

    ``0`` copies the input dim at the same position (``allowzero=0``), ``-1`` takes what is left.
    A target computed in the graph may hold symbolic entries (a :class:`Dim` with factors): such
    an entry is that size, as the graph computed it.
    """
    out: list[Dim | None] = []
    infer_at = None
    for i, s in enumerate(shape):
        if isinstance(s, Dim):
            if s.syms:
                out.append(s)
                continue
            s = s.coef
        if s == 0 and not allowzero:
            if i >= len(in_dims):
                return None
            out.append(in_dims[i])
        elif s == -1:
            if infer_at is not None:
                return None
            infer_at = i
            out.append(None)
        elif s > 0:
            out.append(Dim.of(s))
        else:
            return None
    total = product(in_dims)
    known = product([d for d in out if d is not None])
    if infer_at is None:
        return out if known == total else None  # type: ignore[return-value]
    rest = total.divide(known)
    if rest is None:
        return None
    out[infer_at] = rest
    return out  # type: ignore[return-value]


def unknown_dim(value: ir.Value, axis: int) -> Dim:
    """A symbol for an unknown dim of ``value``, shared only with dims proved equal to it."""
    return Dim.sym(f"{value.name or id(value)}[{axis}]")


def broadcast_dims(a: list[Dim], b: list[Dim], out_value: ir.Value) -> list[Dim] | None:
    """Multidirectional broadcasting of two symbolic shapes (None for an invalid pair).

    Two different unknown dims make an unknown dim of ``out_value`` (the larger, at run time).
    """
    n = max(len(a), len(b))
    a = [Dim.of(1)] * (n - len(a)) + a
    b = [Dim.of(1)] * (n - len(b)) + b
    out = []
    for x, y in zip(a, b, strict=True):
        if x == y or y == Dim.of(1):
            out.append(x)
        elif x == Dim.of(1):
            out.append(y)
        elif not y.syms and x.syms:  # x unknown, y a size: a valid model has x == y or x == 1
            out.append(y)
        elif not x.syms and y.syms:
            out.append(x)
        elif x.syms and y.syms:
            out.append(unknown_dim(out_value, len(out)))
        else:
            return None  # two different sizes, neither 1: not a valid graph
    return out


def reduced_dims(node: ir.Node, first: list[Dim]) -> list[Dim] | None:
    """A reduction's dims: the reduced axes dropped, or kept as 1 (``keepdims``, the default)."""
    axes = node_axes(node)
    if axes is None:
        return None
    if not axes:  # no axes: all of them, unless noop_with_empty_axes
        if attr_int(node, "noop_with_empty_axes", 0):
            return first
        axes = list(range(len(first)))
    normal = normalize_axes(axes, len(first))
    if normal is None:
        return None
    keep = attr_int(node, "keepdims", 1)
    return [Dim.of(1) if i in normal else d for i, d in enumerate(first) if keep or i not in normal]


def split_dims(node: ir.Node, value: ir.Value, first: list[Dim]) -> list[Dim] | None:
    """One ``Split`` output: its piece of the axis.

    The sizes come from the input or the attribute, else equal parts of a known size (the
    count of outputs; ``num_outputs`` rounds up, the last piece the smaller one).
    """
    axis = normalize_axes([attr_int(node, "axis", 0)], len(first))  # type: ignore[list-item]
    if axis is None:
        return None
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        sizes = const_ints(node.inputs[1])
    elif "split" in node.attributes:
        attr = node.attributes["split"]
        sizes = None if attr.is_ref() else [int(v) for v in attr.value]
    else:
        whole, parts = first[axis[0]], len(node.outputs)
        if whole.syms or parts == 0:
            return None
        step = -(-whole.coef // parts)  # ceil: num_outputs' last piece is the smaller one
        sizes = [min(step, whole.coef - i * step) for i in range(parts)]
    if sizes is None or len(sizes) != len(node.outputs) or min(sizes, default=0) < 0:
        return None
    whole = first[axis[0]]
    if not whole.syms and sum(sizes) != whole.coef:
        return None  # not a valid Split of this axis
    out = list(first)
    out[axis[0]] = Dim.of(sizes[value.index()])  # type: ignore[index]
    return out


#: ``Slice`` ends at or past this reach the end of any axis (torch writes INT64_MAX).
_TO_THE_END = 2**62


def sliced_dims(node: ir.Node, first: list[Dim]) -> list[Dim] | None:
    """``Slice`` with constant starts / ends / axes / steps; a symbolic axis only if kept whole."""
    args = [const_ints(v) if v is not None else None for v in node.inputs[1:5]]
    if (
        len(args) < 2
        or args[0] is None
        or args[1] is None
        or any(a is None for a, v in zip(args, node.inputs[1:5], strict=False) if v is not None)
    ):
        return None
    starts, ends = args[0], args[1]
    axes = args[2] if len(args) > 2 and args[2] is not None else list(range(len(starts)))
    steps = args[3] if len(args) > 3 and args[3] is not None else [1] * len(starts)
    axes = normalize_axes(axes, len(first))
    if axes is None or not len(starts) == len(ends) == len(axes) == len(steps):
        return None
    out = list(first)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        d = first[axis]
        if step == 0:
            return None
        if not d.syms:
            out[axis] = Dim.of(len(range(*slice(start, end, step).indices(d.coef))))
        elif start == 0 and end >= _TO_THE_END and step == 1:
            continue  # the whole axis, whatever its size
        else:
            return None
    return out
