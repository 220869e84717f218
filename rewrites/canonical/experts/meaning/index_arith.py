"""Integer index arithmetic: what Div, Mod, Mul, Add, Cast, Floor, Abs and Sign do to a row index.

A :class:`~.terms.RowIndex` holds ``sum c_v * v`` at each position: ``Range(T*k) // k`` holds
``t`` because the low part ``j`` stays below ``k``; torch's ``div(rounding_mode="trunc")`` of a
non-negative index, exported as a float Div and ``Floor(Abs(q)) * Sign(q)`` (or a Cast back to
integers), is the floor division.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import (
    Departure,
    broadcast_axes,
    normalise,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import Factor, Meaning, RowIndex
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import small_const
from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import attr_int

__all__ = ["cast_index", "constant_rows", "index_arithmetic"]


def cast_index(node: ir.Node, m: Meaning, k: int) -> Meaning:
    """A Cast of indices: the same values; to an integer type, a float division truncated."""
    term = m.term
    to = attr_int(node, "to", 0)
    integer = to in (ir.DataType.INT64, ir.DataType.INT32, ir.DataType.INT16, ir.DataType.INT8)
    if isinstance(term, RowIndex) and term.div != 1 and integer:
        return _floor_div(node, m, term.div, k, keep_high=True)  # >= 0: trunc is floor
    return m


def _floor_div(node: ir.Node, m: Meaning, c: int, k: int, keep_high: bool) -> Meaning:
    """``floor(index / c)`` (or ``index mod c``) where the low part provably stays below c."""
    term = m.term
    assert isinstance(term, RowIndex)
    coefs = dict(term.coefs)
    sizes = {"j": Dim.of(k), **{f.var: f.size for f in m.factors()}}
    high = {v: n // c for v, n in coefs.items() if n % c == 0}
    low = {v: n for v, n in coefs.items() if n % c != 0}
    top = 0
    for v, n in low.items():
        size = sizes.get(v)
        if size is None or size.syms or n < 0:
            raise Departure(f"{node.op_type} of a row index whose low part is not bounded")
        top += n * (size.coef - 1)
    if top >= c:
        raise Departure(f"{node.op_type} by {c} of a row index whose low part reaches {top}")
    kept = high if keep_high else low
    return Meaning(m.axes, RowIndex(tuple(kept.items())))


def index_arithmetic(node: ir.Node, ins: list[Meaning | None], k: int) -> Meaning:
    """``Div``/``Mod``/``Mul`` of a row index by an integer constant; ``Add`` of two.

    Also torch's ``div(rounding_mode="trunc")`` of a non-negative index as exported: a float
    ``Div`` then ``Mul(Floor(Abs(q)), Sign(q))`` (or a Cast back to integers), which is the
    floor of the quotient.
    """
    described = [x for x in ins if x is not None]
    op = node.op_type
    if op in ("Max", "Min") and len(node.inputs) == 1 and len(described) == 1:
        return described[0]  # of one operand (torch broadcasting an index with itself): it
    if len(described) == 1 and op in ("Abs", "Floor", "Sign"):
        (m,) = described
        t = m.term
        assert isinstance(t, RowIndex)
        if any(n < 0 for _, n in t.coefs) or t.sign:
            raise Departure(f"{op} of a row index that may be negative")
        if op == "Abs":
            return m
        if op == "Sign":
            return Meaning(m.axes, RowIndex(t.coefs, t.div, sign=True))
        return _floor_div(node, m, t.div, k, keep_high=True) if t.div != 1 else m
    if len(described) == 2 and op == "Mul":
        a, b = described
        if b.term.sign and not a.term.sign:  # type: ignore[attr-defined]
            a, b = b, a
        sa, tb = a.term, b.term
        if sa.sign and not tb.sign and tb.div == 1:  # type: ignore[attr-defined]
            # floor(q) * sign(q) for q >= 0: floor(q) (0 where q is 0 either way)
            return Meaning(broadcast_axes(a.axes, b.axes), tb)
    if len(described) == 2 and op == "Add":
        a, b = described
        axes = broadcast_axes(a.axes, b.axes)
        coefs = dict(a.term.coefs)  # type: ignore[attr-defined]
        for v, n in b.term.coefs:  # type: ignore[attr-defined]
            coefs[v] = coefs.get(v, 0) + n
        return Meaning(axes, RowIndex(tuple(sorted(coefs.items()))))
    if len(described) != 1:
        raise Departure(f"{node.op_type} of two row indices")
    (m,) = described
    term = m.term
    assert isinstance(term, RowIndex)
    other = next((v for v, x in zip(node.inputs, ins, strict=False) if x is None), None)
    c = small_const(other)
    if c is not None and c.size == 1 and c.dtype.kind == "f" and op == "Div" and ins[0] is not None:
        value = float(c.reshape(-1)[0])
        if value > 0 and value == int(value) and term.div == 1 and not term.sign:
            return Meaning(m.axes, RowIndex(term.coefs, div=int(value)))
    if c is None or c.size != 1 or c.dtype.kind not in "iu" or ins[0] is None:
        raise Departure(f"{node.op_type} of a row index by other than an integer constant")
    if term.div != 1 or term.sign:
        raise Departure(f"{node.op_type} of a row index still divided or a sign")
    c = int(c.reshape(-1)[0])
    coefs = dict(term.coefs)
    if node.op_type == "Mul":
        return Meaning(m.axes, RowIndex(tuple((v, n * c) for v, n in coefs.items())))
    if node.op_type in ("Div", "Mod") and c > 0:
        return _floor_div(node, m, c, k, keep_high=node.op_type == "Div")
    raise Departure(f"{node.op_type} of a row index")


def constant_rows(c: np.ndarray | None, tokens: Dim, k: int) -> Meaning | None:
    """A constant integer vector that is a row index of ``T`` or ``T*k`` rows, or None.

    With a static token count, constant folding turns the row index an exporter computes
    (``Range(T*k) // k``, ``Range(T*k) % T``, ``Range(T)``) into a constant: read it back by
    its values, element for element, not by the ops that made it.
    """
    if c is None or c.dtype.kind not in "iu" or c.ndim != 1 or tokens.syms or k < 1:
        return None
    n_tokens = tokens.coef
    t, j = Factor("t", tokens), Factor("j", Dim.of(k))
    row = np.arange(c.size)
    candidates = []
    if c.size == n_tokens:
        candidates.append((row, (t,), (("t", 1),)))
    if c.size == n_tokens * k:
        candidates += [
            (row // k, (t, j), (("t", 1),)),  # each token repeated k times in a row
            (row % n_tokens, (j, t), (("t", 1),)),  # the k copies of all tokens, one after another
            (row, (t, j), (("t", k), ("j", 1))),  # the flat (token, slot) row number
        ]
    for values, axis, coefs in candidates:
        if np.array_equal(c, values):
            return Meaning(normalise(((*axis,),)), RowIndex(coefs if k > 1 else (("t", 1),)))
    return None
