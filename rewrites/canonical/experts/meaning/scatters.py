"""What scatters do to meanings: the weighted rows summed into each token's output.

``ScatterElements``/``ScatterND`` with ``reduction="add"`` of the weighted outputs into zeros
``[T, O]`` at the rows' token index sum over the slots (``index_add_``; without a reduction only
at ``k = 1``). In a loop over experts each branch adds its expert's weighted rows into the
accumulator (:func:`.indexing.accumulator`) at their tokens (added, or read back, added and
written: each token chose an expert at most once, so no row of a branch shares a token): an
:class:`~.terms.ExpertSum`, the layer once every expert has its branch. Split from
:mod:`.indexing`, whose gathers and accumulators these read.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning import index_arith
from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.indexing import accumulator, zeros_dims
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import (
    Departure,
    normalise,
    unify_axis,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    SORTED,
    BranchUpdate,
    ExpertSum,
    Factor,
    Meaning,
    RowIndex,
    SlotSum,
    Weighted,
    axis_size,
    filtered_expert,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import (
    is_zeros,
    small_const,
)
from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import attr_int, attr_str

__all__ = ["scatter"]


def scatter(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> Meaning:
    """``ScatterElements``/``ScatterND`` of weighted outputs into zeros or an accumulator."""
    data, index, updates = ins[:3]
    reduction = attr_str(node, "reduction", "none")
    unsorted = _unsort(node, data, index, updates, ctx)
    if unsorted is not None:
        return unsorted
    if data is None:
        data = accumulator(ctx, node.inputs[0])
    if data is None or not isinstance(data.term, ExpertSum):
        raise Departure(
            f"a {node.op_type} into other than zeros or the experts' accumulated sum"
            + _zeros_of_other_rows(node.inputs[0], ctx)
        )
    if updates is None:
        raise Departure(f"a {node.op_type} of an undescribed value")
    if index is None:
        index = _constant_scatter_index(node, ctx)
    rows = _scatter_rows(node, index, updates)
    total = data.term
    width = axis_size(updates.axes[-1])
    if axis_size(data.axes[-1]) != width:
        raise Departure(
            f"a {node.op_type} of rows {width} wide into [T, {axis_size(data.axes[-1])}]"
        )
    term = updates.term
    filtered = [filtered_expert(v) for v in rows if filtered_expert(v) is not None]
    if not filtered:  # every (token, slot) row at once: the per-slot combine
        if not isinstance(term, Weighted) or total.branches:
            raise Departure(f"a {node.op_type} of {term.text()} (expected the weighted outputs)")
        every = sorted(rows) == sorted(ctx.names(("t", "j"))[0]) or rows == [SORTED]
        if not every:
            raise Departure(f"a {node.op_type} of rows over {sorted(rows)}, not every (t, j)")
        if reduction != "add" and not (reduction == "none" and ctx.k == 1):
            raise Departure(
                f"a {node.op_type} with reduction '{reduction}': a token's slots overwrite each "
                "other instead of adding up"
            )
        return Meaning(data.axes, SlotSum(term, frozenset(range(ctx.k))))
    (e,) = filtered if len(filtered) == 1 else (None,)
    if e is None or len(rows) != 1:
        raise Departure(f"a {node.op_type} of rows of several experts at once")
    if e in total.experts:
        raise Departure(f"a {node.op_type} adding expert {e}'s rows a second time")
    if isinstance(term, Weighted) and (reduction == "add" or not total.branches):
        # into zeros a branch's rows (one per token) are written once: as good as added
        weighted = term
    elif reduction == "none" and isinstance(term, BranchUpdate) and term.total is total:
        weighted = term.weighted
    else:
        raise Departure(
            f"a {node.op_type} (reduction '{reduction}') of {term.text()} into "
            f"{total.text()} (expected its rows plus expert {e}'s weighted rows)"
        )
    if weighted.expert.expert != e:
        raise Departure(f"a {node.op_type} of another expert's outputs at expert {e}'s rows")
    return Meaning(data.axes, ExpertSum((*total.branches, (e, weighted))))


def _unsort(
    node: ir.Node,
    data: Meaning | None,
    index: Meaning | None,
    updates: Meaning | None,
    ctx: Context,
) -> Meaning | None:
    """Sorted rows written back at their flat (token, slot) index into zeros ``[T*k, ..]``.

    The argsort's indices hold every row's index once, so this is the permutation undone: the
    same values laid out over ``(t, j)`` again.
    """
    if data is not None or index is None or updates is None or not updates.axes:
        return None
    if [f.var for f in updates.axes[0]] != [SORTED] or not isinstance(index.term, RowIndex):
        return None
    flat = {"t": ctx.k, "j": 1} if ctx.k > 1 else {"t": 1}
    index_axes = index.axes[:-1] if node.op_type == "ScatterND" else index.axes[:1]
    if dict(index.term.coefs) != flat or [[f.var for f in a] for a in index_axes[:1]] != [[SORTED]]:
        return None
    if node.op_type == "ScatterND" and index.axes[-1] != ():
        return None
    if node.op_type == "ScatterElements" and attr_int(node, "axis", 0) != 0:
        return None
    dims = zeros_dims(node.inputs[0])
    rows = ctx.tokens * Dim.of(ctx.k)
    if not is_zeros(node.inputs[0]) or dims is None or not dims or dims[0] != rows:
        return None
    t, j = Factor("t", ctx.tokens), Factor("j", Dim.of(ctx.k))
    lead = normalise(((t, j),))
    return Meaning((*lead, *updates.axes[1:]), updates.term)


def _constant_scatter_index(node: ir.Node, ctx: Context) -> Meaning | None:
    """A constant scatter index (a static token count folded) read as each row's token.

    ScatterND's ``[R, 1]`` tuples, or ScatterElements' ``[R, W]`` index whose columns are all
    the same row index (one token per row, every column of it).
    """
    c = small_const(node.inputs[1]) if len(node.inputs) > 1 else None
    if c is None or c.ndim != 2 or c.shape[1] < 1 or c.dtype.kind not in "iu":
        return None
    if node.op_type == "ScatterND" and c.shape[1] != 1:
        return None
    if not (c == c[:, :1]).all():
        return None
    rows = index_arith.constant_rows(c[:, 0], ctx.tokens, ctx.k)
    return None if rows is None else Meaning((*rows.axes, ()), rows.term)


def _scatter_rows(node: ir.Node, index: Meaning | None, updates: Meaning) -> list[str]:
    """The row indices of the updates, checked against a scatter index holding their ``t``."""
    if index is None or not isinstance(index.term, RowIndex) or index.term.coefs != (("t", 1),):
        what = index.term.text() if index is not None else "an undescribed index"
        raise Departure(f"a {node.op_type} at {what} (expected each row's token index t)")
    index_axes = index.axes
    if node.op_type == "ScatterND":
        if not index_axes or index_axes[-1] != ():
            raise Departure("a ScatterND whose index tuples are longer than one")
        index_axes = index_axes[:-1]
    else:
        if attr_int(node, "axis", 0) not in (0, -2):
            raise Departure("a ScatterElements along other than the token axis")
        index_axes = index_axes[:-1]
    upd_rows = updates.axes[: len(index_axes)]
    if len(updates.axes) != len(index_axes) + 1:
        raise Departure(f"a {node.op_type} whose updates are not rows of [R, O]")
    for ia, ua in zip(index_axes, upd_rows, strict=True):
        if unify_axis(ia, ua) is None:
            raise Departure(f"a {node.op_type} whose index rows are not the updates' rows")
    return [f.var for a in upd_rows for f in a]


def _zeros_of_other_rows(value: ir.Value | None, ctx: Context) -> str:
    """Why zeros ``[N, O]`` are no accumulator: ``N`` not proved to be the token count."""
    dims = zeros_dims(value) if value is not None and is_zeros(value) else None
    if dims is None or len(dims) != 2 or dims[0] == ctx.tokens:
        return ""
    return f" (zeros of {dims[0]} rows, not proved to be the {ctx.tokens} tokens)"
