"""What indexing ops do to meanings: gathers that select experts or rows, masks, accumulators.

* ``Gather(W, ids)`` / ``GatherND(W, ids[.., None])`` of a constant ``[E, ...]`` stack selects
  each row's expert: the expert axis is replaced by the ids' axes. ``DequantizeLinear`` of codes,
  scales and zero points gathered at the same ids is the gathered dequantized stack.
* A gather along an axis of indices ``F`` (``t``, or ``(t, j)`` flattened) at an integer index
  holding exactly the row-major flat index of ``F`` (``Range(T*k) // k`` holds ``t``; a loop
  branch's ``t(r)`` from ``NonZero``; ``t(r) * k + j(r)``) replaces that axis by the index's axes:
  the same values, laid out as the index is. ``GatherND`` at index tuples does it for several
  leading axes at once.
* Masks: ``Equal(ids, e)`` is the mask of expert ``e``; ``OneHot(ids, E)`` all masks along an
  ``e`` axis, one of which a Gather at a constant ``e`` picks. ``NonZero`` of expert ``e``'s
  mask enumerates the (token, slot) pairs that chose ``e``: the filtered rows ``@e``, each with
  its index tuple.
* ``GatherElements(scores [T, E], ids)`` of router values are routing weights.
* The accumulator a combine's scatters add into (zeros of the tokens' shape); the scatters
  themselves are :mod:`.scatters`.
* ``Range(0, n, 1)`` is the row index of ``n`` = ``T`` or ``T*k`` rows.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning import index_arith
from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import (
    Departure,
    broadcast_axes,
    normalise,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    AccRows,
    Axis,
    Coords,
    ExpertSum,
    Factor,
    Ids,
    Mask,
    Meaning,
    Param,
    RowIndex,
    Tokens,
    Weights,
    WeightSource,
    axis_size,
    filtered_var,
    fresh_repeat,
    is_repeat,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import (
    const_shape,
    is_const,
    is_zeros,
    small_const,
    target_dims,
    value_dims,
)
from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import attr_int
from onnx_moe_fuse.rewrites.graph.symbolic_dims import shape_value

__all__ = [
    "accumulator",
    "coords_select",
    "dequantize",
    "equal",
    "expert_stack",
    "gather",
    "gather_elements",
    "gather_nd",
    "nonzero",
    "one_hot",
    "row_range",
    "single_weight",
    "zeros_dims",
]


def _const_source(value: ir.Value | None) -> tuple[tuple[int, ...], WeightSource] | None:
    """A constant (or a DequantizeLinear of constants): its shape and source."""
    if value is None:
        return None
    shape = const_shape(value)
    node = value.producer()
    if shape is None and node is not None and node.op_type == "DequantizeLinear":
        if not all(v is None or is_const(v) for v in node.inputs):
            return None
        shape = const_shape(node.inputs[0])
    return None if shape is None else (shape, WeightSource(value))


def expert_stack(value: ir.Value | None, experts: int) -> Meaning | None:
    """A constant ``[E, ...]`` stack of expert weights (or a DQ of constants), unselected."""
    found = _const_source(value)
    if found is None or len(found[0]) < 2 or found[0][0] != experts:
        return None
    shape, source = found
    name = value.name or "W"  # type: ignore[union-attr]
    feats = tuple(f"{name}#{i}" for i in range(1, len(shape)) if shape[i] != 1)
    axes: list[Axis] = [(Factor("e", Dim.of(experts)),)]
    it = iter(feats)
    for d in shape[1:]:
        axes.append(() if d == 1 else (Factor(next(it), Dim.of(d)),))
    return Meaning(tuple(axes), Param(source, feats))


def single_weight(value: ir.Value | None) -> Meaning | None:
    """One expert's ``[K, N]`` weight: a 2-D constant, a DQ of constants, or its Transpose."""
    perm = None
    node = value.producer() if value is not None else None
    if node is not None and node.op_type == "Transpose" and const_shape(value) is None:
        attr = node.attributes.get("perm")
        perm = list(attr.value) if attr is not None else [1, 0]
        value = node.inputs[0]
    found = _const_source(value)
    if found is None or len(found[0]) != 2:
        return None
    shape, source = found
    name = value.name or "W"  # type: ignore[union-attr]
    feats = (f"{name}#0", f"{name}#1")
    axes = tuple((Factor(f, Dim.of(d)),) for f, d in zip(feats, shape, strict=True))
    if perm is not None:
        axes = tuple(axes[p] for p in perm)
    return Meaning(axes, Param(source, feats, single=True))


def _select(data: Meaning, ids: Meaning, axis: int) -> Meaning:
    """An expert stack gathered at the ids along its expert axis."""
    p = data.term
    assert isinstance(p, Param)
    if p.selected or p.single or axis != 0:
        raise Departure("a Gather of expert weights along other than the expert axis")
    axes = normalise((*ids.axes, *data.axes[1:]))
    return Meaning(axes, Param(p.source, p.feats, selected=True))


def _flat_coefs(axis: Axis) -> dict[str, int] | None:
    """The row-major flat index of an axis' factors as coefficients (static strides only)."""
    coefs: dict[str, int] = {}
    stride = 1
    for f in reversed(axis):
        coefs[f.var] = stride
        if f.size.syms:
            stride = -1  # a stride past a symbolic factor is not a number
        elif stride > 0:
            stride *= f.size.coef
    return None if any(c < 0 for c in coefs.values()) else coefs


def _rows_at(data: Meaning, index: Meaning, axis: int) -> Meaning:
    """``data`` gathered along ``axis`` at an index holding that axis' flat index."""
    term = index.term
    assert isinstance(term, RowIndex)
    if 0 <= axis < len(data.axes) and not data.axes[axis] and not isinstance(data.term, ExpertSum):
        # a unit axis (one token, at k = 1: Range(T*k) // k is [0]): every index Gather
        # accepts (0 or -1) reads its one row, so the content repeats over the index's axes
        rows = tuple(tuple(fresh_repeat(f.size) for f in a) for a in index.axes)
        return Meaning(normalise((*data.axes[:axis], *rows, *data.axes[axis + 1 :])), data.term)
    if not 0 <= axis < len(data.axes) or not data.axes[axis]:
        raise Departure("a Gather along a unit axis")
    coefs = _flat_coefs(_repeats_as(data.axes[axis], index.term))
    if coefs is None or dict(term.coefs) != coefs:
        names = ", ".join(f.var for f in data.axes[axis])
        raise Departure(
            f"a Gather along the axis ({names}) of {data.term.text()} at {term.text()}, not "
            "that axis' own index"
        )
    axes = normalise((*data.axes[:axis], *index.axes, *data.axes[axis + 1 :]))
    return Meaning(axes, _read_back(data.term))


def _repeats_as(axis: Axis, index: RowIndex) -> Axis:
    """``axis`` with each repeat named as the index's variable of its stride, where one is free.

    A repeat matches any index of its size: tokens repeated k times (``repeat_interleave``,
    ``[(t, *), h]``) read at ``t*k + j`` are ``x[t]`` for every slot ``j``.
    """
    by_stride = dict((c, v) for v, c in index.coefs)
    coefs = _flat_coefs(axis) or {}
    named = {f.var for f in axis}
    out = []
    for f in axis:
        free = by_stride.get(coefs.get(f.var, 0))
        if is_repeat(f.var) and free is not None and free not in named:
            f = Factor(free, f.size)
            named.add(free)
        out.append(f)
    return tuple(out)


def _read_back(term):  # noqa: ANN001, ANN202 - any term
    """What rows of ``term`` hold: the same, or an accumulator's rows read back."""
    return AccRows(term) if isinstance(term, ExpertSum) else term


def accumulator(ctx: Context, value: ir.Value) -> Meaning | None:
    """Zeros ``[T, O]`` (or ``[B, S, O]`` of split tokens) as the empty sum of the experts' outputs.

    One per value, so a scatter into it and a gather from it read the same accumulator.
    """
    if id(value) in ctx.zeros:
        return ctx.zeros[id(value)]
    dims = zeros_dims(value)
    if not is_zeros(value) or dims is None:
        return None
    split = [a for a in ctx.token_axes if a]
    if len(dims) == 3 and len(split) == 2 and [axis_size(a) for a in split] == dims[:2]:
        # zeros_like of [B, S, H] tokens: the accumulator laid out as the tokens are
        m = Meaning((*split, (Factor("o", dims[2]),)), ExpertSum(()))
        ctx.zeros[id(value)] = m
        return m
    if len(dims) != 2 or dims[0] != ctx.tokens:
        return None
    # normalised: one static token is no index (as the token axes of every other meaning)
    m = Meaning(normalise(((Factor("t", ctx.tokens),), (Factor("o", dims[1]),))), ExpertSum(()))
    ctx.zeros[id(value)] = m
    return m


def zeros_dims(value: ir.Value) -> list[Dim] | None:
    """The dims of a zeros tensor: its shape operand's where it is made from one."""
    node = value.producer()
    if node is not None and node.op_type == "ConstantOfShape":
        return target_dims(node.inputs[0])
    if node is not None and node.op_type == "Expand" and const_shape(node.inputs[0]) in ((), (1,)):
        return target_dims(node.inputs[1])
    return value_dims(value)


def _constant_data(value: ir.Value, index: Meaning | None, ctx: Context) -> Meaning | None:
    """A gathered constant: an expert stack, or zeros ``[T, O]`` as the empty accumulator.

    Read at the ids it is an expert stack; read at token rows (a row index, index tuples) the
    zeros accumulator comes first, so that ``[T, O]`` zeros with ``T == E`` (a static export's
    ``zeros_like(x)``) are not taken for an expert stack.
    """
    if index is not None and isinstance(index.term, RowIndex | Coords):
        return accumulator(ctx, value) or expert_stack(value, ctx.experts)
    return expert_stack(value, ctx.experts) or accumulator(ctx, value)


def gather(node: ir.Node, data: Meaning | None, index: Meaning | None, ctx: Context) -> Meaning:
    """``Gather(data, indices, axis)``."""
    if data is None:
        data = _constant_data(node.inputs[0], index, ctx)
    if index is None and data is not None and isinstance(data.term, Tokens):
        index = index_arith.constant_rows(small_const(node.inputs[1]), ctx.tokens, ctx.k)
    if index is None:
        return _constant_pick(node, data)
    if data is None:
        raise Departure("a Gather of values this analysis does not describe")
    axis = attr_int(node, "axis", 0) or 0
    axis = axis + len(data.axes) if axis < 0 else axis
    if isinstance(data.term, Param) and isinstance(index.term, Ids):
        return _select(data, index, axis)
    if isinstance(index.term, RowIndex):
        return _rows_at(data, index, axis)
    raise Departure(f"a Gather of {data.term.text()} at {index.term.text()}")


def _constant_pick(node: ir.Node, data: Meaning | None) -> Meaning:
    """A Gather at a constant: one expert's mask out of the one-hot masks, or index tuples."""
    picked = small_const(node.inputs[1])
    if data is None or picked is None or picked.dtype.kind not in "iu":
        raise Departure("a Gather of values this analysis does not describe")
    axis = attr_int(node, "axis", 0) or 0
    axis = axis + len(data.axes) if axis < 0 else axis
    if isinstance(data.term, Coords):
        return coords_select(node, data, axis, picked.reshape(-1).tolist(), picked.ndim == 0)
    vars_at = [f.var for f in data.axes[axis]] if 0 <= axis < len(data.axes) else []
    if isinstance(data.term, Mask) and data.term.expert is None and vars_at == ["e"]:
        if picked.ndim != 0:
            raise Departure("a Gather of several experts' masks at once")
        axes = (*data.axes[:axis], *data.axes[axis + 1 :])
        return Meaning(axes, Mask(int(picked)))
    raise Departure(f"a Gather of {data.term.text()} at a constant")


def coords_select(
    node: ir.Node, data: Meaning, axis: int, picked: list[int], drop: bool
) -> Meaning:
    """Some coordinates of index tuples along their coordinate axis."""
    term = data.term
    assert isinstance(term, Coords)
    at = [i for i, a in enumerate(data.axes) if [f.var for f in a] == ["c"]]
    if [axis] != at and not (len(term.vars) == 1 and not data.axes[axis]):
        raise Departure(f"a {node.op_type} of index tuples along other than their coordinates")
    chosen = tuple(term.vars[i] for i in picked)
    if len(chosen) == 1:
        axes = list(data.axes)
        if drop:
            del axes[axis]
        else:
            axes[axis] = ()
        return Meaning(tuple(axes), RowIndex(((chosen[0], 1),)))
    axes = list(data.axes)
    axes[axis] = (Factor("c", Dim.of(len(chosen))),)
    return Meaning(tuple(axes), Coords(chosen))


def gather_nd(node: ir.Node, data: Meaning | None, index: Meaning | None, ctx: Context) -> Meaning:
    """``GatherND(data, indices)`` (batch_dims 0): a gather along the leading axes."""
    if attr_int(node, "batch_dims", 0) != 0 or index is None or not index.axes:
        raise Departure("a GatherND with batch dims, or at an undescribed index")
    if data is None:
        data = _constant_data(node.inputs[0], index, ctx)
    if data is None:
        raise Departure("a GatherND of values this analysis does not describe")
    term = index.term
    if index.axes[-1] == () and isinstance(term, Ids | RowIndex):
        trimmed = Meaning(index.axes[:-1], term)
        if isinstance(data.term, Param) and isinstance(term, Ids):
            return _select(data, trimmed, 0)
        if isinstance(term, RowIndex):
            return _rows_at(data, trimmed, 0)
    if isinstance(term, Coords) and [f.var for f in index.axes[-1]] == ["c"]:
        n = len(term.vars)
        lead = [[f.var for f in a] for a in data.axes[:n]]
        if lead != [[v] for v in term.vars]:
            raise Departure(
                f"a GatherND at index tuples ({', '.join(term.vars)}) of {data.term.text()} "
                f"laid out {data.layout()}"
            )
        axes = normalise((*index.axes[:-1], *data.axes[n:]))
        return Meaning(axes, _read_back(data.term))
    raise Departure(f"a GatherND of {data.term.text()} at {term.text()}")


def gather_elements(node: ir.Node, index: Meaning | None, ctx: Context) -> Meaning:
    """``GatherElements(scores [T, E], ids, axis=-1)``: routing weights.

    Also ``[B, S, E]`` scores at ``[B, S, k]`` ids (a router of rank-3 rows): the ids' own
    layout. What the weights are is proved by the routing's rules on the per-slot form.
    """
    if index is None or not isinstance(index.term, Ids):
        raise Departure("a GatherElements at other than the expert indices")
    dims = value_dims(node.inputs[0])
    axis = attr_int(node, "axis", 0)
    rank = len(dims) if dims is not None else 0
    if rank not in (2, 3) or axis not in (rank - 1, -1) or dims[-1] != Dim.of(ctx.experts):  # type: ignore[index]
        raise Departure("a GatherElements of the ids from other than [T, E] router values")
    names = [[f.var for f in a] for a in index.axes]
    if len(index.axes) != rank or not ctx.per_slot(names):
        raise Departure("a GatherElements at ids laid out other than [t, j]")
    return Meaning(index.axes, Weights(node.outputs[0]))


def equal(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> Meaning:
    """``Equal(ids, e)``: expert ``e``'s mask."""
    ids = next((m for m in ins if m is not None and isinstance(m.term, Ids)), None)
    other = next((v for v, m in zip(node.inputs, ins, strict=False) if m is None), None)
    e = small_const(other)
    if ids is not None and e is not None and e.ndim >= 1 and e.size > 1:
        # the ids against arange(D) along an axis of their own: every expert's mask at once
        depth = e.size
        if e.reshape(-1).tolist() != list(range(depth)) or any(d != 1 for d in e.shape[:-1]):
            raise Departure("an Equal of the expert indices with other than the expert numbers")
        _check_depth(depth, ctx)
        axes = broadcast_axes(ids.axes, ((Factor("e", Dim.of(depth)),),))
        return Meaning(axes, Mask(None))
    if ids is None or e is None or e.size != 1 or e.dtype.kind not in "iu":
        raise Departure("an Equal of the expert indices with other than one expert number")
    expert = int(e.reshape(-1)[0])
    if not 0 <= expert < 2 * ctx.experts:
        raise Departure(f"an Equal of the expert indices with {expert}, not an expert")
    return Meaning(ids.axes, Mask(expert))


def one_hot(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> Meaning:
    """``OneHot(ids, E, [0, 1])`` along a new last axis: every expert's mask."""
    ids = ins[0]
    depth, values = small_const(node.inputs[1]), small_const(node.inputs[2])
    axis = attr_int(node, "axis", -1)
    if ids is None or not isinstance(ids.term, Ids) or depth is None or values is None:
        raise Departure("a OneHot of other than the expert indices")
    if values.reshape(-1).tolist() != [0, 1]:
        raise Departure("a OneHot of the ids that is not [0, 1] over the experts")
    size = int(depth.reshape(-1)[0])
    _check_depth(size, ctx)
    if axis not in (-1, len(ids.axes)):
        raise Departure("a OneHot with its expert axis not last")
    return Meaning((*ids.axes, (Factor("e", Dim.of(size)),)), Mask(None))


def _check_depth(depth: int, ctx: Context) -> None:
    """A mask over ``depth`` experts: at least E (the masks past E are empty: ids < E)."""
    if not ctx.experts <= depth <= 2 * ctx.experts:
        raise Departure(f"masks over {depth} experts where the router scores {ctx.experts}")


def nonzero(node: ir.Node, mask: Meaning | None, ctx: Context) -> Meaning:
    """``NonZero`` of one expert's mask: ``[rank, R]`` index tuples of the pairs that chose it."""
    if mask is None or not isinstance(mask.term, Mask) or mask.term.expert is None:
        raise Departure("a NonZero of other than one expert's mask")
    names = [[f.var for f in a] for a in mask.axes]
    if names == [["t", "j"]]:  # the (token, slot) rows flattened: repeat_interleave'd tokens
        # each pair's flat row t*k + j, in the same (row-major) order as the pairs' own tuples
        e = mask.term.expert
        rows = Factor(filtered_var(e), Dim.sym(f"R{e}"))
        return Meaning(((), (rows,)), RowIndex((("t", ctx.k), ("j", 1))))
    # one index per axis: the token's (``t``, or ``t.hi, t.lo`` of [B, S] tokens) and the slot's
    # (a unit slot axis at k = 1 is none); a pair (b, s) is the token b * S + s
    pair_axes = [["j"], ["t"]], [["t"]], [["j"], ["t.hi"], ["t.lo"]], [["t.hi"], ["t.lo"]]
    if sorted(n for n in names if n) not in pair_axes or (["j"] not in names) != (ctx.k == 1):
        raise Departure(f"a NonZero of an expert's mask laid out {mask.layout()}")
    names = [n for n in names if n]
    if len(names) != len(mask.axes):
        raise Departure(f"a NonZero of an expert's mask with unit axes ({mask.layout()})")
    e = mask.term.expert
    order = [n[0] for n in names]
    # pairs enumerated slot-major (a [k, T] mask) are not in the token-major order of the
    # (token, slot) rows: their count is named apart, so the two never meet as the same rows
    slot_major = "j" in order and order.index("j") < len(order) - 1
    rows = Factor(filtered_var(e), Dim.sym(f"R{e}_slot_major" if slot_major else f"R{e}"))
    coords = Factor("c", Dim.of(len(order)))
    return Meaning(((coords,), (rows,)), Coords(tuple(order)))


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
