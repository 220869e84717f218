"""What indexing ops do to meanings: gathers that select experts or tokens, scatters that sum.

* ``Gather(W, ids)`` / ``GatherND(W, ids[.., None])`` of a constant ``[E, ...]`` stack selects
  each row's expert: the expert axis is replaced by the ids' axes. ``DequantizeLinear`` of codes,
  scales and zero points gathered at the same ids is the gathered dequantized stack.
* ``Gather(X, r)`` of the tokens along their token axis, at a row index ``r`` holding ``t``
  (``Range(T*k) // k``, an expanded ``Range(T)``), repeats the tokens the way ``r`` is laid out.
* ``GatherElements(scores, ids)`` of ``[T, E]`` router values are routing weights.
* ``ScatterElements``/``ScatterND`` with ``reduction="add"`` of the weighted outputs into zeros
  ``[T, O]`` at the rows' token index sums over the slots (``index_add_``); without a reduction
  only at ``k = 1`` (each token written once).
* ``Range(0, n, 1)`` is the row index of ``n`` = ``T`` or ``T*k`` rows.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import (
    Departure,
    normalise,
    unify_axis,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    Axis,
    Factor,
    Ids,
    Meaning,
    Param,
    RowIndex,
    SlotSum,
    Tokens,
    Weighted,
    Weights,
    WeightSource,
    axis_size,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import (
    const_shape,
    is_const,
    is_zeros,
    small_const,
    value_dims,
)
from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import attr_int, attr_str
from onnx_moe_fuse.rewrites.graph.symbolic_dims import shape_value

__all__ = [
    "dequantize",
    "expert_stack",
    "gather",
    "gather_elements",
    "gather_nd",
    "row_range",
    "scatter",
]


def expert_stack(value: ir.Value | None, experts: int) -> Meaning | None:
    """A constant ``[E, ...]`` stack of expert weights (or a DQ of constants), unselected."""
    if value is None:
        return None
    node = value.producer()
    shape = const_shape(value)
    source = WeightSource(value)
    if shape is None and node is not None and node.op_type == "DequantizeLinear":
        if not all(v is None or is_const(v) for v in node.inputs):
            return None
        shape = const_shape(node.inputs[0])
    if shape is None or len(shape) < 2 or shape[0] != experts:
        return None
    name = value.name or "W"
    feats = tuple(f"{name}#{i}" for i in range(1, len(shape)) if shape[i] != 1)
    axes: list[Axis] = [(Factor("e", Dim.of(experts)),)]
    it = iter(feats)
    for d in shape[1:]:
        axes.append(() if d == 1 else (Factor(next(it), Dim.of(d)),))
    return Meaning(tuple(axes), Param(source, feats))


def _select(data: Meaning, ids: Meaning, axis: int) -> Meaning:
    """An expert stack gathered at the ids along its expert axis."""
    p = data.term
    assert isinstance(p, Param)
    if p.selected or axis != 0:
        raise Departure("a Gather of expert weights along other than the expert axis")
    axes = normalise((*ids.axes, *data.axes[1:]))
    return Meaning(axes, Param(p.source, p.feats, selected=True))


def _token_rows(data: Meaning, index: Meaning, axis: int) -> Meaning:
    """The tokens gathered along their token axis at a row index holding ``t``."""
    term = index.term
    assert isinstance(term, RowIndex)
    token_axis = data.axes[axis] if 0 <= axis < len(data.axes) else None
    if token_axis is None or [f.var for f in token_axis] != ["t"]:
        raise Departure("a Gather of the tokens along other than their token axis")
    if term.coefs != (("t", 1),):
        raise Departure(f"a Gather of the tokens at {term.text()} (expected the token index t)")
    axes = normalise((*data.axes[:axis], *index.axes, *data.axes[axis + 1 :]))
    return Meaning(axes, Tokens())


def gather(node: ir.Node, data: Meaning | None, index: Meaning | None, experts: int) -> Meaning:
    """``Gather(data, indices, axis)``."""
    if data is None:
        data = expert_stack(node.inputs[0], experts)
    if data is None or index is None:
        raise Departure("a Gather of values this analysis does not describe")
    axis = attr_int(node, "axis", 0)
    axis = axis + len(data.axes) if axis < 0 else axis
    if isinstance(data.term, Param) and isinstance(index.term, Ids):
        return _select(data, index, axis)
    if isinstance(data.term, Tokens) and isinstance(index.term, RowIndex):
        return _token_rows(data, index, axis)
    raise Departure(f"a Gather of {data.term.text()} at {index.term.text()}")


def gather_nd(node: ir.Node, data: Meaning | None, index: Meaning | None, experts: int) -> Meaning:
    """``GatherND(data, indices[.., 1])`` (batch_dims 0): a Gather along axis 0."""
    if attr_int(node, "batch_dims", 0) != 0 or index is None or not index.axes:
        raise Departure("a GatherND with batch dims, or of an undescribed index")
    if index.axes[-1] != ():
        raise Departure("a GatherND whose index tuples are longer than one")
    trimmed = Meaning(index.axes[:-1], index.term)
    if data is None:
        data = expert_stack(node.inputs[0], experts)
    if data is None:
        raise Departure("a GatherND of values this analysis does not describe")
    if isinstance(data.term, Param) and isinstance(index.term, Ids):
        return _select(data, trimmed, 0)
    if isinstance(data.term, Tokens) and isinstance(index.term, RowIndex):
        return _token_rows(data, trimmed, 0)
    raise Departure(f"a GatherND of {data.term.text()} at {index.term.text()}")


def gather_elements(node: ir.Node, index: Meaning | None, tokens: Dim, experts: int) -> Meaning:
    """``GatherElements(scores [T, E], ids, axis=-1)``: routing weights."""
    if index is None or not isinstance(index.term, Ids):
        raise Departure("a GatherElements at other than the expert indices")
    dims = value_dims(node.inputs[0])
    axis = attr_int(node, "axis", 0)
    if dims is None or len(dims) != 2 or axis not in (1, -1) or dims[1] != Dim.of(experts):
        raise Departure("a GatherElements of the ids from other than [T, E] router values")
    if [[f.var for f in a] for a in index.axes] != [["t"], ["j"]]:
        raise Departure("a GatherElements at ids laid out other than [t, j]")
    return Meaning(index.axes, Weights(node.outputs[0]))


def dequantize(node: ir.Node, ins: list[Meaning | None]) -> Meaning:
    """``DequantizeLinear`` of codes, scales (and zero points) gathered at the same ids."""
    codes = ins[0]
    if codes is None or not isinstance(codes.term, Param) or not codes.term.selected:
        raise Departure("a DequantizeLinear of other than gathered expert codes")
    rows = [f.var for f in codes.factors() if f.var in ("t", "j")]
    sources: list[ir.Value | None] = []
    for v, m in zip(node.inputs, ins, strict=False):
        if v is None:
            sources.append(None)
            continue
        if m is None or not isinstance(m.term, Param) or not m.term.selected:
            raise Departure(f"a DequantizeLinear whose '{v.name}' is not gathered at the ids")
        if [f.var for f in m.factors() if f.var in ("t", "j")] != rows:
            raise Departure(f"a DequantizeLinear whose '{v.name}' is gathered at other rows")
        sources.append(m.term.source.value)
    source = WeightSource(None, tuple(sources), node)
    return Meaning(codes.axes, Param(source, codes.term.feats, selected=True))


def row_range(node: ir.Node, tokens: Dim, k: int) -> Meaning | None:
    """``Range(0, n, 1)``: the row index of ``T`` (``t``) or ``T*k`` (``t*k + j``) rows."""
    start, limit, delta = (shape_value(v) for v in node.inputs[:3])
    if start is None or delta is None or start.ints != [0] or delta.ints != [1]:
        return None
    if limit is None or len(limit.dims) != 1:
        return None
    n = limit.dims[0]
    t = Factor("t", tokens)
    if n == tokens:
        return Meaning(((t,),), RowIndex((("t", 1),)))
    if n == tokens * Dim.of(k):
        return Meaning(((t, Factor("j", Dim.of(k))),), RowIndex((("t", k), ("j", 1))))
    return None


def scatter(node: ir.Node, ins: list[Meaning | None], tokens: Dim, k: int) -> Meaning:
    """``ScatterElements``/``ScatterND`` of the weighted outputs into zeros at their tokens."""
    data, index, updates = ins[:3]
    reduction = attr_str(node, "reduction", "none")
    if updates is None or not isinstance(updates.term, Weighted):
        what = updates.term.text() if updates is not None else "an undescribed value"
        raise Departure(f"a {node.op_type} of {what} (expected the weighted expert outputs)")
    if reduction != "add" and not (reduction == "none" and k == 1):
        raise Departure(
            f"a {node.op_type} with reduction '{reduction}': a token's slots overwrite each "
            "other instead of adding up"
        )
    if data is not None or not is_zeros(node.inputs[0]):
        raise Departure(f"a {node.op_type} into other than zeros")
    dims = value_dims(node.inputs[0])
    out_width = axis_size(updates.axes[-1]) if updates.axes else None
    if dims is None or len(dims) != 2 or dims[0] != tokens or dims[1] != out_width:
        raise Departure(f"a {node.op_type} into zeros that are not [T, {out_width}]")
    if index is None or not isinstance(index.term, RowIndex) or index.term.coefs != (("t", 1),):
        what = index.term.text() if index is not None else "an undescribed index"
        raise Departure(f"a {node.op_type} at {what} (expected each row's token index t)")
    index_axes = index.axes
    if node.op_type == "ScatterND":
        if not index_axes or index_axes[-1] != ():
            raise Departure("a ScatterND whose index tuples are longer than one")
        index_axes = index_axes[:-1]
        upd_rows = updates.axes[: len(index_axes)]
    else:
        if attr_int(node, "axis", 0) not in (0, -2):
            raise Departure("a ScatterElements along other than the token axis")
        upd_rows = updates.axes[: len(index_axes) - 1]
        index_axes = index_axes[:-1]
    if len(upd_rows) != len(index_axes) or len(updates.axes) != len(index_axes) + 1:
        raise Departure(f"a {node.op_type} whose updates are not rows of [R, O]")
    for ia, ua in zip(index_axes, upd_rows, strict=True):
        if unify_axis(ia, ua) is None:
            raise Departure(f"a {node.op_type} whose index rows are not the updates' rows")
    row_vars = sorted(f.var for a in upd_rows for f in a)
    if row_vars != ["j", "t"]:
        raise Departure(f"a {node.op_type} of rows over {row_vars}, not every (token, slot)")
    t = (Factor("t", tokens),)
    return Meaning((t, updates.axes[-1]), SlotSum(updates.term, frozenset(range(k))))


def _is_int_const(value: ir.Value | None) -> bool:
    arr = small_const(value)
    return arr is not None and arr.dtype.kind in "iu"
