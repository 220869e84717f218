"""Functions of the expert ids and of the row indices that are the same for every token.

Two facts the sorted forms need, read exactly from what the ops compute:

* **Per-expert counts by a histogram** (torch's ``histc`` over the float ids, as exported:
  ``Where(0 <= x <= E and not isnan(x), x, -1)``, ``Less`` against the bin edges, a sum over
  the rows, the difference of neighbouring sums). A TopK over ``E`` scores yields ids in
  ``[0, E)``, so any elementwise function of the ids is a *table* over those ``E`` values:
  :class:`IdTable` ``f[b, e]`` holds ``f(idx[t, j])`` (``b``: at most one axis of constants,
  such as the bin edges). Every op on tables is evaluated on the ``E`` values in the value's own
  type (numpy's comparisons, logic, ``Where`` and casts are ONNX's on these small integers). A
  sum over every (token, slot) row of a table is :class:`CountMix` ``sum_e M[b, e] * n_e``
  (``n_e`` the rows that chose ``e``); differences and slices of it stay mixes; where ``M`` is
  the identity, it is every expert's own count (:class:`~.terms.Counts`). An off-by-one range
  (``min=1``) gives a shifted ``M``, which stays a mix, and the Split that reads it departs.
  The sums are float32 in the model: exact while a count stays below 2**24 rows (the model's
  own split breaks past that too).
* **Uniform facts of row indices**: a row index ``sum c_v * v`` with non-negative
  coefficients is never negative, so ``Less(index, 0)`` is :class:`Uniform` ``False`` at every
  row. torch's floor division of an index (``q - ((index < 0) & (index % k != 0))``) is then
  the truncating division less a uniform 0: the index itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import (
    Departure,
    broadcast_axes,
    unify_axis,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    SORTED,
    Axis,
    Counts,
    Factor,
    Ids,
    Meaning,
    RowIndex,
    Term,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import is_const, small_const
from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import attr_int, node_axes, normalize_axes
from onnx_moe_fuse.rewrites.graph.numpy_ops import BINARY_OPS, COMPARISONS, UNARY_OPS

__all__ = ["CountMix", "IdTable", "Uniform", "id_transfer"]

_BINS = count()

#: Elementwise ops evaluated on tables: numpy's are ONNX's on small integer-valued inputs.
_TABLE_OPS = {**BINARY_OPS, **UNARY_OPS, "Where": np.where}
_COMPARE = COMPARISONS


@dataclass(frozen=True, eq=False)
class IdTable(Term):
    """``f(idx[t, j])`` for a known ``f``: ``table[b, e]`` (``[E]`` without a constants axis)."""

    table: np.ndarray

    progress = 1

    def text(self) -> str:
        """The table."""
        return f"a function of the expert indices, f(e) = {self.table.tolist()}"


@dataclass(frozen=True, eq=False)
class CountMix(Term):
    """``sum_e M[b, e] * n_e``, ``n_e`` the number of (token, slot) rows that chose ``e``."""

    matrix: np.ndarray

    progress = 1

    def text(self) -> str:
        """The mix."""
        return (
            f"the row counts mixed as sum_e M[b, e] * n_e with M = {self.matrix.tolist()} "
            "(not each expert's own count)"
        )


@dataclass(frozen=True)
class Uniform(Term):
    """The same value at every position (a fact of the indices, e.g. ``index < 0`` is False)."""

    value: bool | int | float

    progress = 1

    def text(self) -> str:
        """The value."""
        return f"{self.value} at every row"


def _is_bin(axis: Axis) -> bool:
    return len(axis) == 1 and axis[0].var.startswith("%bin")


def _numpy_type(value: ir.Value | None) -> np.dtype | None:
    dtype = value.dtype if value is not None else None
    try:
        return np.dtype(dtype.numpy()) if dtype is not None else None
    except (TypeError, ValueError):
        return None


def id_transfer(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> list | None:
    """The outputs' meanings where ``node`` computes a table, a count mix or a uniform value.

    None where the node is none of these (the other transfers take it).
    """
    described = [m for m in ins if m is not None]
    terms = [m.term for m in described]
    op = node.op_type
    if any(isinstance(t, Uniform) for t in terms) or (
        op in _COMPARE and terms and all(isinstance(t, RowIndex) for t in terms)
    ):
        return [_uniform(node, ins)]
    if any(isinstance(t, CountMix) for t in terms):
        return [_mix(node, ins, ctx)]
    tables = any(isinstance(t, IdTable) for t in terms)
    on_ids = op in (*_COMPARE, "IsNaN", "Where") and any(isinstance(t, Ids) for t in terms)
    if not tables and not on_ids:
        return None
    if op == "ReduceSum":
        return [_summed(node, described[0], ctx)]
    if op == "Cast":
        m = described[0]
        to = ir.DataType(attr_int(node, "to", 0))
        return [Meaning(m.axes, IdTable(m.term.table.astype(to.numpy())))]  # type: ignore[attr-defined]
    return [_table_op(node, ins, ctx)]


def _positions(node: ir.Node, ins: list[Meaning | None]) -> tuple[list[Axis], int | None, int]:
    """The output layout, the position of its constants axis (if any) and that axis' size."""
    shapes = []
    for v, m in zip(node.inputs, ins, strict=False):
        if m is not None:
            shapes.append(("m", m.axes))
        elif v is not None:
            arr = small_const(v)
            if arr is None:
                raise Departure(
                    f"a {node.op_type} of the expert indices with '{v.name}', no constant"
                )
            shapes.append(("c", arr.shape))
    rank = max(len(s) for _, s in shapes)
    axes: list[Axis] = []
    bin_at, bins = None, 1
    for i in range(rank):
        here: list[Axis] = []
        consts: list[int] = []
        for kind, s in shapes:
            j = i - (rank - len(s))
            if j < 0:
                continue
            if kind == "m":
                here.append(s[j])
            else:
                consts.append(int(s[j]))
        binned = [a for a in here if _is_bin(a)]
        rows = [a for a in here if a and not _is_bin(a)]
        big = {c for c in consts if c != 1}
        if binned or (not rows and big):
            size = {int(a[0].size.coef) for a in binned} | big
            if rows or len(size) != 1 or bin_at is not None:
                raise Departure(
                    f"a {node.op_type} of the expert indices over constants that do not broadcast"
                )
            bin_at, bins = i, size.pop()
            axes.append(binned[0] if binned else (Factor(f"%bin{next(_BINS)}", Dim.of(bins)),))
            continue
        if big:
            raise Departure(
                f"a {node.op_type} of the expert indices with constants varying over the rows"
            )
        axis: Axis = ()
        for a in rows:
            merged = unify_axis(axis, a)
            if merged is None:
                raise Departure(f"a {node.op_type} of the expert indices at rows that do not align")
            axis = merged
        axes.append(axis)
    return axes, bin_at, bins


def _table_op(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> Meaning:
    """An elementwise op of tables, the ids and constants: a table."""
    fn = _TABLE_OPS.get(node.op_type)
    if fn is None:
        raise Departure(f"a {node.op_type} of a function of the expert indices")
    axes, bin_at, bins = _positions(node, ins)
    rank = len(axes)
    operands = []
    for v, m in zip(node.inputs, ins, strict=False):
        if v is None:
            continue
        if m is not None and isinstance(m.term, IdTable):
            t = m.term.table
            operands.append(t if t.ndim == 2 else t[None, :])
        elif m is not None and isinstance(m.term, Ids):
            dtype = _numpy_type(v)
            if dtype is None:
                raise Departure(f"a {node.op_type} of the expert indices of an unknown type")
            operands.append(np.arange(ctx.experts).astype(dtype)[None, :])
        elif m is not None:
            raise Departure(f"a {node.op_type} of the expert indices and {m.term.text()}")
        else:
            arr = small_const(v)
            assert arr is not None
            full = arr.reshape((1,) * (rank - arr.ndim) + arr.shape)
            along = full.shape[bin_at] if bin_at is not None else 1
            operands.append(
                full.reshape(-1)[:along].reshape(along, 1) if along > 1 else full.reshape(1, 1)
            )
    with np.errstate(all="ignore"):
        out = np.asarray(fn(*operands))
    if out.dtype.kind == "f" and not np.isfinite(out).all():
        raise Departure(f"a {node.op_type} of the expert indices that is not finite")
    out = np.broadcast_to(out, (bins if bin_at is not None else 1, ctx.experts)).copy()
    return Meaning(tuple(axes), IdTable(out if bin_at is not None else out[0]))


def _every_row(names: list[str], k: int) -> bool:
    return sorted(names) == ["j", "t"] or names == [SORTED] or (k == 1 and names == ["t"])


def _summed(node: ir.Node, m: Meaning, ctx: Context) -> Meaning:
    """A ReduceSum over every (token, slot) row of a table: ``sum_e table[b, e] * n_e``."""
    if node.op_type != "ReduceSum":
        raise Departure("a reduction of a function of the expert indices other than a sum")
    rank = len(m.axes)
    axes = node_axes(node, 1)
    axes = normalize_axes(axes, rank) if axes is not None else list(range(rank))
    if axes is None:
        raise Departure("a ReduceSum whose axes are not constant")
    names = [f.var for i in axes for f in m.axes[i]]
    if any(_is_bin(m.axes[i]) for i in axes) or not _every_row(names, ctx.k):
        raise Departure(
            f"a ReduceSum of a function of the expert indices over ({', '.join(names)}), "
            "not every (token, slot) row"
        )
    keep = attr_int(node, "keepdims", 1)
    out = tuple(() if i in axes else a for i, a in enumerate(m.axes) if keep or i not in axes)
    table = m.term.table  # type: ignore[attr-defined]
    if table.dtype.kind == "b" or not np.array_equal(table, np.round(table)):
        raise Departure("a ReduceSum of a function of the expert indices that is not integral")
    return _counts_or_mix(out, table.astype(np.float64))


def _counts_or_mix(axes: tuple[Axis, ...], matrix: np.ndarray) -> Meaning:
    """Every expert's own count where ``M`` is the identity, else the mix."""
    if matrix.ndim == 2 and matrix.shape[0] == matrix.shape[1]:
        if np.array_equal(matrix, np.eye(matrix.shape[0])) and [a for a in axes if a] == [
            a for a in axes if _is_bin(a)
        ]:
            e = Factor("e", Dim.of(matrix.shape[0]))
            return Meaning(tuple((e,) if _is_bin(a) else a for a in axes), Counts(None))
    return Meaning(axes, CountMix(matrix))


def _mix(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> Meaning:
    """Slices, casts, sums and differences of count mixes."""
    op = node.op_type
    m = ins[0]
    if op in ("Cast", "Identity") and m is not None and isinstance(m.term, CountMix):
        return m  # integer-valued counts: every numeric type holds them
    if op == "Slice" and m is not None and isinstance(m.term, CountMix):
        return _mix_slice(node, m)
    if op in ("Add", "Sub") and len(ins) == 2 and all(x is not None for x in ins):
        a, b = ins
        if isinstance(a.term, CountMix) and isinstance(b.term, CountMix):  # type: ignore[union-attr]
            if len(a.axes) != len(b.axes) or [len(x) for x in a.axes] != [len(x) for x in b.axes]:  # type: ignore[union-attr]
                raise Departure(f"a {op} of count mixes laid out differently")
            ma, mb = a.term.matrix, b.term.matrix  # type: ignore[union-attr]
            if ma.shape != mb.shape:
                raise Departure(f"a {op} of count mixes of different sizes")
            return _counts_or_mix(a.axes, ma - mb if op == "Sub" else ma + mb)  # type: ignore[union-attr]
    raise Departure(f"a {op} of row counts mixed by the experts")


def _mix_slice(node: ir.Node, m: Meaning) -> Meaning:
    matrix = m.term.matrix  # type: ignore[attr-defined]
    at = [i for i, a in enumerate(m.axes) if _is_bin(a)]
    starts, ends = small_const(node.inputs[1]), small_const(node.inputs[2])
    steps = small_const(node.inputs[4]) if len(node.inputs) > 4 else None
    axes = node_axes(node, 3)
    rank = len(m.axes)
    axes = normalize_axes(axes, rank) if axes is not None else [0]
    if len(at) != 1 or axes != at or starts is None or ends is None or matrix.ndim != 2:
        raise Departure("a Slice of count mixes along other than their constants axis")
    if starts.size != 1 or ends.size != 1 or (steps is not None and steps.size != 1):
        raise Departure("a Slice of count mixes at other than one constant range")
    step = int(steps.reshape(-1)[0]) if steps is not None else 1
    picked = matrix[int(starts.reshape(-1)[0]) : int(ends.reshape(-1)[0]) : step]
    var = m.axes[at[0]][0].var
    out = list(m.axes)
    out[at[0]] = (Factor(var, Dim.of(picked.shape[0])),) if picked.shape[0] != 1 else ()
    if picked.shape[0] == 1:
        return Meaning(tuple(out), CountMix(picked[0]))
    return _counts_or_mix(tuple(out), picked)


def _nonneg(t: RowIndex) -> bool:
    return all(c >= 0 for _, c in t.coefs) and not t.sign


def _uniform(node: ir.Node, ins: list[Meaning | None]) -> Meaning:
    """Values the same at every row: row-index signs, and what ops of them compute."""
    op = node.op_type
    described = [m for m in ins if m is not None]
    axes: tuple[Axis, ...] = described[0].axes
    for m in described[1:]:
        axes = broadcast_axes(axes, m.axes)
    consts = []
    for v, m in zip(node.inputs, ins, strict=False):
        if m is None and v is not None:
            arr = small_const(v)
            if arr is None or arr.size != 1 or not is_const(v):
                raise Departure(f"a {op} of a value the same at every row and '{v.name}'")
            consts.append(arr.reshape(-1)[0])
    terms = [m.term for m in described]
    if op in _COMPARE and len(terms) == 1 and isinstance(terms[0], RowIndex) and consts:
        if not _nonneg(terms[0]) or ins[0] is None:
            raise Departure(f"a {op} of a row index that may be negative")
        c = float(consts[0])
        if (op == "Less" and c <= 0) or (op == "LessOrEqual" and c < 0):
            return Meaning(axes, Uniform(False))
        if (op == "GreaterOrEqual" and c <= 0) or (op == "Greater" and c < 0):
            return Meaning(axes, Uniform(True))
        raise Departure(f"a {op} of a row index with {c}, which differs between rows")
    uniform = [t.value for t in terms if isinstance(t, Uniform)]
    others = [m for m in described if not isinstance(m.term, Uniform)]
    if op in ("Equal", "Not", "Cast", "Identity") and not others:
        values = [*uniform, *consts]
        if op == "Equal" and len(values) == 2:
            return Meaning(axes, Uniform(bool(values[0] == values[1])))
        if op == "Not" and len(values) == 1:
            return Meaning(axes, Uniform(not values[0]))
        if op == "Cast":
            to = ir.DataType(attr_int(node, "to", 0))
            return Meaning(axes, Uniform(np.asarray(values[0]).astype(to.numpy()).item()))
        if op == "Identity":
            return Meaning(axes, Uniform(values[0]))
    if op == "And" and False in uniform:  # False and anything: False, whatever the other holds
        return Meaning(axes, Uniform(False))
    if op == "Or" and True in uniform:
        return Meaning(axes, Uniform(True))
    if op in ("Sub", "Add") and len(others) == 1 and uniform == [0] and not consts:
        if op == "Sub" and isinstance(ins[0].term if ins[0] is not None else None, Uniform):
            raise Departure("a Sub from a uniform 0 (a negation)")
        return Meaning(axes, others[0].term)
    raise Departure(f"a {op} of values the same at every row ({uniform}) and others")
