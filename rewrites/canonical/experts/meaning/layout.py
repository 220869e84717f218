"""What layout ops do to a :class:`~.terms.Meaning`: regroup, reorder, add or drop axes.

Reshape/Flatten regroup the row-major sequence of factors into the target's dims (symbolic dims
included: a target ``[-1, k, H]`` on ``[(t, j), h]`` gives ``[t, j, h]`` for every ``T``); a
static factor may be split (``h`` of 16 into ``h.hi`` 4 and ``h.lo`` 4), and adjacent halves
merge back. Transpose permutes axes, Squeeze/Unsqueeze drop or add unit axes, Expand/Tile add
repeats. The term is unchanged: where an element sits changes, not what it is. Each function
raises :class:`Departure` when the op cannot be described (a Reshape that splits a symbolic
factor, a Squeeze of a non-unit axis).
"""

from __future__ import annotations

from collections.abc import Sequence

from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    Axis,
    Factor,
    Meaning,
    axis_size,
    fresh_repeat,
)
from onnx_moe_fuse.rewrites.graph.dims import Dim, reshape_dims

__all__ = [
    "Departure",
    "broadcast_axes",
    "expand",
    "flatten",
    "normalise",
    "reshape",
    "squeeze",
    "tile",
    "transpose",
    "unsqueeze",
]

ONE = Dim.of(1)


class Departure(Exception):
    """A node whose output cannot be described from its inputs' meanings (the reason)."""


def normalise(axes: Sequence[Axis]) -> tuple[Axis, ...]:
    """Drop unit factors; merge split halves ``v.hi, v.lo`` back into ``v``."""
    out = []
    for axis in axes:
        factors = [f for f in axis if f.size != ONE]
        merged: list[Factor] = []
        for f in factors:
            if merged and f.var.endswith(".lo") and merged[-1].var == f.var[:-3] + ".hi":
                hi = merged.pop()
                merged.append(Factor(f.var[:-3], hi.size * f.size))
            else:
                merged.append(f)
        out.append(tuple(merged))
    return tuple(out)


def _split(f: Factor, head: Dim) -> tuple[Factor, Factor] | None:
    """``f`` as (``head``, rest) halves, where ``head`` divides the size (symbols included)."""
    if head.coef <= 0:
        return None
    rest = f.size.divide(head)
    if rest is None or rest == Dim.of(1) or head == Dim.of(1):
        return None
    return Factor(f"{f.var}.hi", head), Factor(f"{f.var}.lo", rest)


def regroup(factors: list[Factor], dims: Sequence[Dim]) -> tuple[Axis, ...]:
    """Group the row-major ``factors`` into axes of sizes ``dims``."""
    todo = list(factors)
    out: list[Axis] = []
    for d in dims:
        if d == ONE:
            out.append(())
            continue
        axis: list[Factor] = []
        size = ONE
        while size != d:
            if not todo:
                raise Departure(f"a Reshape to a dim {d} that the row-major factors do not fill")
            f = todo.pop(0)
            if (size * f.size) == d or d.divide(size * f.size) is not None:
                axis.append(f)
                size = size * f.size
                continue
            need = d.divide(size)
            halves = _split(f, need) if need is not None else None
            if halves is None:
                raise Departure(
                    f"a Reshape that splits the index {f.var} (size {f.size}) to fill a dim {d}"
                )
            axis.append(halves[0])
            todo.insert(0, halves[1])
            size = size * halves[0].size
        out.append(tuple(axis))
    if todo:
        raise Departure("a Reshape whose dims leave indices over")
    return normalise(out)


def reshape(m: Meaning, target: Sequence[int | Dim], allowzero: int = 0) -> Meaning:
    """``Reshape(m, target)``."""
    dims = reshape_dims([axis_size(a) for a in m.axes], target, allowzero)
    if dims is None:
        shown = [str(t) for t in target]
        if any(f.var.startswith("@") for f in m.factors()) and all(
            not t.syms for t in target if isinstance(t, Dim)
        ):
            raise Departure(
                f"a Reshape to the fixed shape {shown} of rows whose number depends on the "
                "routing (a trace specialised to its example input)"
            )
        raise Departure(f"a Reshape to {shown} not provable on the input dims")
    return Meaning(regroup(m.factors(), dims), m.term)


def flatten(m: Meaning, axis: int) -> Meaning:
    """``Flatten(m, axis)``: two axes."""
    axis = axis + len(m.axes) if axis < 0 else axis
    head = tuple(f for a in m.axes[:axis] for f in a)
    tail = tuple(f for a in m.axes[axis:] for f in a)
    return Meaning(normalise((head, tail)), m.term)


def transpose(m: Meaning, perm: Sequence[int] | None) -> Meaning:
    """``Transpose(m, perm)`` (reversed axes by default)."""
    perm = list(perm) if perm is not None else list(range(len(m.axes)))[::-1]
    if sorted(perm) != list(range(len(m.axes))):
        raise Departure(f"a Transpose perm {perm} for rank {len(m.axes)}")
    return Meaning(tuple(m.axes[p] for p in perm), m.term)


def squeeze(m: Meaning, axes: Sequence[int] | None) -> Meaning:
    """``Squeeze(m, axes)``: only unit axes."""
    rank = len(m.axes)
    if axes is None:
        return Meaning(tuple(a for a in m.axes if a), m.term)
    drop = {a + rank if a < 0 else a for a in axes}
    if any(not 0 <= a < rank or m.axes[a] for a in drop):
        raise Departure(f"a Squeeze of axes {sorted(drop)} that are not all of size 1")
    return Meaning(tuple(a for i, a in enumerate(m.axes) if i not in drop), m.term)


def unsqueeze(m: Meaning, axes: Sequence[int]) -> Meaning:
    """``Unsqueeze(m, axes)``."""
    rank = len(m.axes) + len(axes)
    add = sorted(a + rank if a < 0 else a for a in axes)
    out = list(m.axes)
    for a in add:
        if not 0 <= a <= len(out):
            raise Departure(f"an Unsqueeze at axis {a}")
        out.insert(a, ())
    return Meaning(tuple(out), m.term)


def expand(m: Meaning, target: Sequence[Dim]) -> Meaning:
    """``Expand(m, target)``: broadcast, unit axes grown into repeats."""
    rank = max(len(m.axes), len(target))
    axes = [()] * (rank - len(m.axes)) + list(m.axes)
    dims = [ONE] * (rank - len(target)) + list(target)
    out: list[Axis] = []
    for axis, d in zip(axes, dims, strict=True):
        size = axis_size(axis)
        if size != ONE or d == ONE:
            # a valid model broadcasts a non-unit axis only to itself (the target is 1 or it)
            out.append(axis)
        else:
            out.append((fresh_repeat(d),))
    return Meaning(normalise(out), m.term)


def tile(m: Meaning, repeats: Sequence[int]) -> Meaning:
    """``Tile(m, repeats)``: each axis copied ``r`` times, copy-major."""
    if len(repeats) != len(m.axes):
        raise Departure("a Tile whose repeats do not match the rank")
    out = []
    for axis, r in zip(m.axes, repeats, strict=True):
        out.append(axis if r == 1 else (fresh_repeat(Dim.of(r)), *axis))
    return Meaning(normalise(out), m.term)


def unify_axis(a: Axis, b: Axis) -> Axis | None:
    """One axis for two aligned ones: equal, one a unit, or repeats matched to indices."""
    if not a:
        return b
    if not b:
        return a
    if len(a) != len(b):
        return None
    out = []
    for fa, fb in zip(a, b, strict=True):
        if fa.var == fb.var:
            out.append(fa)
        elif fa.size != fb.size:
            return None
        elif fa.var.startswith("*"):
            out.append(fb)
        elif fb.var.startswith("*"):
            out.append(fa)
        else:
            return None
    return tuple(out)


def broadcast_axes(a: Sequence[Axis], b: Sequence[Axis]) -> tuple[Axis, ...]:
    """Numpy-style broadcast of two layouts (right-aligned), repeats matched to indices."""
    rank = max(len(a), len(b))
    pa = [()] * (rank - len(a)) + list(a)
    pb = [()] * (rank - len(b)) + list(b)
    out = []
    for x, y in zip(pa, pb, strict=True):
        axis = unify_axis(x, y)
        if axis is None:
            names = lambda ax: "(" + ", ".join(f.var for f in ax) + ")"  # noqa: E731
            raise Departure(f"operands whose axes {names(x)} and {names(y)} do not align")
        out.append(axis)
    return tuple(out)
