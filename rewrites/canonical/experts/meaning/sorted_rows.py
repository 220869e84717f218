"""Rows sorted by expert: an argsort of the flat ids, per-expert segments, and back.

JetMoE's and Granite's ``ParallelExperts``, Megablocks and torchtitan sort the ``T*k`` (token,
slot) rows by their expert, cut them into one segment per expert by the experts' row counts, run
each expert on its own segment, put the segments back together and scatter-add every row at its
token. As meanings:

* ``TopK(flat ids, T*k, largest=0)`` (an ascending sort) gives the sorted rows ``@s``: its
  values are the ids at each sorted row, its indices the rows' flat index ``t*k + j``;
* the counts: ``ScatterElements(zeros [T, E], ids, 1, axis=1)`` is the 0/1 choice of each
  token (or the one-hot masks), summed over the tokens; pieces of it put back in expert order;
* ``Split`` of sorted rows by the counts of every expert gives segment ``@es``: the rows that
  chose ``e`` (ascending ids make each expert's rows contiguous); each expert's projection of
  its segment, ``Concat``-ed in expert order, is the sorted rows' projection by their own
  experts' weights (a stack of the experts' own);
* a scatter-add of the weighted sorted rows at their tokens sums every (token, slot) pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.indexing import zeros_dims
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import Departure, normalise
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    SORTED,
    Chosen,
    Counts,
    Factor,
    Ids,
    Mask,
    Meaning,
    Param,
    Proj,
    RowIndex,
    filtered_var,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import small_const
from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import attr_int
from onnx_moe_fuse.rewrites.graph.symbolic_dims import shape_value

__all__ = [
    "SegmentsProj",
    "argsort",
    "chosen",
    "concat_segments",
    "count_pick",
    "counts",
    "split_segments",
]


def argsort(node: ir.Node, ids: Meaning | None, ctx: Context) -> list[Meaning | None]:
    """``TopK(flat ids, T*k, largest=0)``: the rows sorted by expert."""
    if ids is None or not isinstance(ids.term, Ids):
        raise Departure("a TopK of other than the expert indices")
    largest = attr_int(node, "largest", 1)
    if largest != 0 or attr_int(node, "sorted", 1) != 1 or len(ids.axes) != 1:
        raise Departure("a TopK of the expert indices that is not an ascending sort of all rows")
    if sorted(f.var for f in ids.axes[0]) != ["j", "t"] and not (
        ctx.k == 1 and [f.var for f in ids.axes[0]] == ["t"]
    ):
        raise Departure("a sort of the expert indices of other than every (token, slot) row")
    count = shape_value(node.inputs[1])
    rows = ctx.tokens * Dim.of(ctx.k)
    if count is None or len(count.dims) != 1 or count.dims[0] != rows:
        raise Departure("a TopK of the expert indices keeping other than all T*k rows")
    coefs = dict(("t", ctx.k) if f.var == "t" else ("j", 1) for f in ids.axes[0])
    if ctx.k == 1:
        coefs = {"t": 1}
    axis = ((Factor(SORTED, rows),),)
    return [Meaning(axis, Ids()), Meaning(axis, RowIndex(tuple(sorted(coefs.items()))))]


def _ones(value: ir.Value | None) -> bool:
    """A tensor of ones: a constant, ConstantOfShape of 1, an Expand of 1."""
    arr = small_const(value)
    if arr is not None:
        return bool(arr.size) and bool((arr == 1).all())
    node = value.producer() if value is not None else None
    if node is not None and node.op_type == "ConstantOfShape":
        fill = node.attributes.get("value")
        return fill is not None and bool((fill.value.numpy() == 1).all())
    if node is not None and node.op_type in ("Expand", "Cast"):
        return _ones(node.inputs[0])
    return False


def chosen(node: ir.Node, ins: list[Meaning | None], zeros: bool) -> Meaning | None:
    """``ScatterElements(zeros [T, E], ids, 1, axis=1)``: 1 where a token chose an expert."""
    if node.op_type != "ScatterElements" or len(ins) < 3 or not zeros:
        return None
    index = ins[1]
    if index is None or not isinstance(index.term, Ids) or not _ones(node.inputs[2]):
        return None
    if attr_int(node, "axis", 0) not in (1, -1) or len(index.axes) != 2:
        return None
    dims = zeros_dims(node.inputs[0])
    if dims is None or len(dims) != 2 or dims[1].syms:
        return None
    return Meaning((index.axes[0], (Factor("e", dims[1]),)), Chosen())


def counts(node: ir.Node, m: Meaning, summed: list[tuple], out: list) -> Meaning | None:
    """A ReduceSum over the tokens (and slots) of the choices or masks: each expert's count."""
    names = sorted(f.var for a in summed for f in a)
    if isinstance(m.term, Chosen) and m.term.expert is None and names == ["t"]:
        return Meaning(normalise(out), Counts(None))
    if isinstance(m.term, Mask) and m.term.expert is None and names == ["j", "t"]:
        return Meaning(normalise(out), Counts(None))
    return None


def count_pick(node: ir.Node, m: Meaning, picked: list[int]) -> Meaning:
    """A Slice or Gather of the counts along the experts: those experts' counts."""
    term = m.term
    assert isinstance(term, Counts)
    experts = term.experts if term.experts is not None else None
    if experts is None:
        return Meaning(((),), Counts(tuple(picked)))
    return Meaning(((),), Counts(tuple(experts[i] for i in picked)))


def concat_counts(ins: list[Meaning | None]) -> Meaning | None:
    """Pieces of the counts put together in order."""
    if not ins or any(m is None or not isinstance(m.term, Counts) for m in ins):
        return None
    experts: list[int] = []
    for m in ins:
        if m.term.experts is None:  # type: ignore[union-attr]
            return None
        experts.extend(m.term.experts)  # type: ignore[union-attr]
    return Meaning(((),), Counts(tuple(experts)))


def split_segments(
    node: ir.Node, data: Meaning, sizes: Meaning | None, ctx: Context
) -> list[Meaning | None]:
    """``Split`` of sorted rows by every expert's count: each expert's segment."""
    rank = len(data.axes)
    axis = (attr_int(node, "axis", 0) or 0) % rank
    if [f.var for f in data.axes[axis]] != [SORTED]:
        raise Departure("a Split by the experts' counts of other than the sorted rows")
    if sizes is None or not isinstance(sizes.term, Counts):
        raise Departure("a Split of the sorted rows by other than the experts' row counts")
    experts = sizes.term.experts
    if experts is None and [[f.var for f in a] for a in sizes.axes] == [["e"]]:
        experts = tuple(range(sizes.axes[0][0].size.coef))  # every expert's, in expert order
    if experts is None or list(experts) != list(range(len(node.outputs))):
        raise Departure(f"a Split of the sorted rows by the counts of experts {experts}")
    if len(node.outputs) < ctx.experts:
        raise Departure("a Split of the sorted rows into fewer segments than experts")
    outs: list[Meaning | None] = []
    for e in range(len(node.outputs)):
        axes = list(data.axes)
        axes[axis] = (Factor(filtered_var(e, sorted_rows=True), Dim.sym(f"R{e}s")),)
        outs.append(Meaning(tuple(axes), data.term))
    return outs


def concat_segments(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> Meaning | None:
    """The experts' segments put back in expert order: the sorted rows again."""
    if not ins or any(m is None for m in ins):
        return None
    rank = len(ins[0].axes)  # type: ignore[union-attr]
    axis = (attr_int(node, "axis", 0) or 0) % rank
    vars_at = [[f.var for f in m.axes[axis]] for m in ins]  # type: ignore[union-attr]
    if vars_at != [[filtered_var(e, sorted_rows=True)] for e in range(len(ins))]:
        return None
    if len(ins) < ctx.experts:
        raise Departure("a Concat of fewer expert segments than experts")
    terms = [m.term for m in ins]  # type: ignore[union-attr]
    if not all(isinstance(t, Proj) and t.expert == e for e, t in enumerate(terms)):
        kinds = ", ".join(t.text() for t in terms[:2])
        raise Departure(f"a Concat of the experts' segments holding {kinds}")
    first = terms[0]
    assert isinstance(first, Proj)
    for t in terms[1:]:
        if t.stage != first.stage or (t.bias is None) != (first.bias is None):  # type: ignore[union-attr]
            raise Departure("a Concat of expert segments computed alike but for the bias")
    weights = Param(
        first.weight.source, first.weight.feats, True, False, tuple(t.weight for t in terms)
    )  # type: ignore[union-attr]
    bias = None
    if first.bias is not None:
        bias = Param(first.bias.source, first.bias.feats, True, False, tuple(t.bias for t in terms))  # type: ignore[union-attr,misc]
    axes = list(ins[0].axes)  # type: ignore[union-attr]
    axes[axis] = (Factor(SORTED, ctx.tokens * Dim.of(ctx.k)),)
    for m in ins[1:]:
        others = [a for i, a in enumerate(m.axes) if i != axis]  # type: ignore[union-attr]
        mine = [a for i, a in enumerate(axes) if i != axis]
        if [[f.size for f in a] for a in others] != [[f.size for f in a] for a in mine]:
            raise Departure("a Concat of expert segments of different widths")
    if all(t.input is first.input for t in terms):  # one activation over every segment
        proj = Proj(first.stage, first.input, weights, first.contracted, first.out_var, bias)
    else:  # each expert's own MLP on its segment: the contract compares them (SegmentsProj)
        proj = SegmentsProj(
            first.stage, first.input, weights, first.contracted, first.out_var, bias,
            segments=tuple(terms),  # type: ignore[arg-type]
        )  # fmt: skip
    return Meaning(tuple(axes), proj)


@dataclass(frozen=True, eq=False)
class SegmentsProj(Proj):
    """The experts' projections of their segments concatenated, each reading its own input.

    ``segments``: expert e's projection (its FC2 of its own activation of its own FC1); the
    contract checks that every expert's MLP has expert 0's structure before it stacks them.
    """

    segments: tuple[Proj, ...] = ()
