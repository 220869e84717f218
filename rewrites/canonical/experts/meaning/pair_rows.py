"""Each expert's rows written back at their own (token, slot) positions: a boolean index_put.

torch's ``out[mask_e] = rows_e`` (DeepSeek-V2's experts over ``repeat_interleave``'d rows,
Switch's ``next_states[mask_e] = expert_e(x[mask_e])``) exports by dynamo as an element-wise
ScatterND::

    where = Transpose(NonZero(Expand(Unsqueeze(mask_e, -1), [..., O])))   (pair..., o) tuples
    flat  = Reshape(Expand(rows_e, Concat(ReduceSum(Cast(mask_e)), [O])), [-1])
    out   = ScatterND(base, where, flat)

* a ReduceSum of expert ``e``'s mask over every (token, slot) pair is its row count;
* a Concat of that count and the row width is the shape of expert ``e``'s rows ``[R_e, O]``,
  and an Expand of those rows ``[@e, o]`` to it leaves them as they are;
* a NonZero of expert ``e``'s mask repeated along a last axis of ``O`` enumerates each of its
  rows' elements: the pair's coordinates, then the feature;
* the ScatterND of expert ``e``'s rows, flattened in the same row-major order, at those tuples
  writes each row at its pair: a :class:`PairRows` branch. Once every expert has written its
  rows, every pair ``(t, j)`` holds ``FC2_{idx[t, j]}`` (it chose exactly one expert, and the
  masks of two experts share no pair), whatever the base held;
* times ``w[t, j]`` and summed over the slots, that is the layer (an
  :class:`~.terms.ExpertSum` over every expert); at ``k = 1`` the product already is.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.indexing import accumulator, zeros_dims
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import Departure, broadcast_axes
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    Axis,
    BranchUpdate,
    Chosen,
    Coords,
    Counts,
    ExpertSum,
    Factor,
    Mask,
    Meaning,
    Proj,
    Term,
    Weighted,
    Weights,
    axis_size,
    filtered_expert,
    filtered_var,
    is_repeat,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import small_const, value_dims
from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import attr_int, attr_str, node_axes

__all__ = ["PairRows", "RowsShape", "pair_transfer"]

#: The token indices a pair's coordinates may hold (a [B, S] token is two).
_TOKEN_VARS = ({"t"}, {"t.hi", "t.lo"})


@dataclass(frozen=True)
class RowsShape(Term):
    """``[R_e, *width]``: the shape of expert ``expert``'s rows."""

    expert: int
    width: tuple[int, ...]

    progress = 1

    def text(self) -> str:
        """The shape."""
        return f"the shape of expert {self.expert}'s rows [R, {', '.join(map(str, self.width))}]"


@dataclass(frozen=True, eq=False)
class PairRows(Term):
    """Each expert of ``branches`` wrote its FC2 rows at its own (token, slot) pairs."""

    branches: tuple[tuple[int, Proj], ...]

    progress = 4

    @property
    def experts(self) -> frozenset[int]:
        """The experts written so far."""
        return frozenset(e for e, _ in self.branches)

    def text(self) -> str:
        """The experts written."""
        return f"FC2 rows of experts {sorted(self.experts)} written at their (token, slot) pairs"


@dataclass(frozen=True, eq=False)
class WeightedPairs(Term):
    """``w[t, j]`` times every expert's FC2 rows at their pairs (not yet summed over j)."""

    weights: Weights
    pairs: PairRows

    progress = 5

    def text(self) -> str:
        """The product."""
        return f"w[t, j] times the {self.pairs.text()}"


def _pair_vars(axes: tuple[Axis, ...], ctx: Context) -> list[str] | None:
    """The vars of a layout of every (token, slot) pair, one coordinate per axis, or None."""
    names = [[f.var for f in a] for a in axes if a]
    if len(names) != len(axes):
        return None
    flat = {v for n in names for v in n}
    if ("j" in flat) != (ctx.k > 1) or not any(flat - {"j"} == t for t in _TOKEN_VARS):
        return None
    if len(flat) != sum(len(n) for n in names):
        return None
    return [",".join(n) for n in names]


def _expert_count(node: ir.Node, m: Meaning, ctx: Context) -> Meaning | None:
    """A ReduceSum of expert ``e``'s mask (as integers) over every pair: its row count."""
    if not isinstance(m.term, Mask) or m.term.expert is None or _pair_vars(m.axes, ctx) is None:
        return None
    axes = node_axes(node, 1)
    if axes is None or (axes and sorted(a % len(m.axes) for a in axes) != list(range(len(m.axes)))):
        return None
    if not axes and attr_int(node, "noop_with_empty_axes", 0):
        return None
    return Meaning(((),), Counts((m.term.expert,)))


def _rows_shape(node: ir.Node, ins: list[Meaning | None]) -> Meaning | None:
    """``Concat(count_e, [O...])``: the shape of expert ``e``'s rows."""
    if not ins or ins[0] is None or not isinstance(ins[0].term, Counts):
        return None
    experts = ins[0].term.experts
    if experts is None or len(experts) != 1 or any(m is not None for m in ins[1:]):
        return None
    width = [small_const(v) for v in node.inputs[1:]]
    if any(w is None or w.dtype.kind not in "iu" or w.ndim != 1 for w in width):
        return None
    return Meaning(((Factor("c", Dim.of(1 + len(width))),),), RowsShape(experts[0], tuple(
        int(x) for w in width for x in w.tolist()  # type: ignore[union-attr]
    )))  # fmt: skip


def _expand_rows(rows: Meaning, shape: RowsShape) -> Meaning:
    """Expert ``e``'s rows ``[@e, o]`` expanded to their own shape: the same rows."""
    names = [[f.var for f in a] for a in rows.axes]
    sizes = [axis_size(a) for a in rows.axes[1:]]
    if names[:1] != [[filtered_var(shape.expert)]] or sizes != [Dim.of(w) for w in shape.width]:
        raise Departure(
            f"an Expand of rows laid out {rows.layout()} to {shape.text()} (expected expert "
            f"{shape.expert}'s own rows)"
        )
    return rows


def _element_tuples(mask: Meaning, ctx: Context) -> Meaning | None:
    """NonZero of expert ``e``'s mask repeated along a last feature axis: its rows' elements.

    Of the tokens that chose ``e`` (``Chosen(e)``) repeated so: the same rows ``@e`` (each is
    one pair), each element's tuple the token's coordinates, then the feature.
    """
    term = mask.term
    if not isinstance(term, Mask | Chosen) or term.expert is None or len(mask.axes) < 2:
        return None
    last = mask.axes[-1]
    if len(last) != 1 or not is_repeat(last[0].var):
        return None
    if isinstance(term, Chosen):
        names = [[f.var for f in a] for a in mask.axes[:-1]]
        pairs = [n[0] for n in names] if names in ([["t"]], [["t.hi"], ["t.lo"]]) else None
    else:
        pairs = _pair_vars(mask.axes[:-1], ctx)
    if pairs is None:
        return None
    e = term.expert
    rows = (Factor(filtered_var(e), Dim.sym(f"R{e}")), last[0])
    coords = Factor("c", Dim.of(len(pairs) + 1))
    return Meaning(((coords,), rows), Coords((*pairs, last[0].var)))


def _base_axes(node: ir.Node, base: Meaning | None, pairs: list[str], ctx: Context) -> tuple:
    """The layout of the scatter's base: its own meaning's, or its dims' as the pairs."""
    if isinstance(base, Meaning) and isinstance(base.term, PairRows):
        return base.axes
    dims = value_dims(node.inputs[0]) if base is not None else zeros_dims(node.inputs[0])
    sizes = {"t": ctx.tokens, "j": Dim.of(ctx.k)}
    if base is not None and base.axes:
        sizes.update({f.var: f.size for f in base.factors()})
    axes = []
    for p in pairs:
        factors = tuple(Factor(v, sizes[v]) for v in p.split(",") if v in sizes)
        if len(factors) != len(p.split(",")):
            raise Departure(f"a ScatterND at index tuples ({', '.join(pairs)}) of unknown sizes")
        axes.append(factors)
    if dims is None or len(dims) != len(axes) + 1:
        raise Departure("a ScatterND of rows into a value of another rank than the pairs'")
    if any(axis_size(a) != d for a, d in zip(axes, dims, strict=False)):
        shown = ", ".join(str(d) for d in dims)
        raise Departure(f"a ScatterND of rows into a value [{shown}] whose dims are not the pairs'")
    return (*axes, (Factor("o", dims[-1]),))


def _write_rows(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> Meaning | None:
    """``ScatterND(base, element tuples of expert e, its FC2 rows flattened)``."""
    base, where, rows = ins[:3]
    if where is None or not isinstance(where.term, Coords) or len(where.axes) != 2:
        return None
    *pairs, feature = where.term.vars
    if not is_repeat(feature) or not pairs:
        return None
    e = filtered_expert(where.axes[0][0].var)
    if e is None or attr_str(node, "reduction", "none") != "none":
        raise Departure("a ScatterND of an expert's rows element by element, not overwriting")
    if rows is not None and isinstance(rows.term, BranchUpdate):
        return _write_back(node, base, where, rows, pairs, ctx)
    if rows is None or not isinstance(rows.term, Proj) or rows.term.stage != 2:
        raise Departure("a ScatterND at an expert's rows' elements of other than its FC2 rows")
    if rows.term.expert != e:
        raise Departure(f"a ScatterND of another expert's FC2 rows at expert {e}'s pairs")
    flat = [f.var for a in rows.axes for f in a]
    if len(rows.axes) != 1 or flat[:1] != [filtered_var(e)] or len(flat) != 2:
        raise Departure(
            f"a ScatterND at expert {e}'s element tuples of rows laid out {rows.layout()}"
        )
    if rows.axes[0][1].size != where.axes[0][1].size:
        raise Departure("a ScatterND whose rows are not as wide as the tuples' feature axis")
    if rows.axes[0][0].size != where.axes[0][0].size:  # the same pairs, in the same order
        raise Departure(f"a ScatterND of expert {e}'s rows enumerated in another order")
    axes = _base_axes(node, base, pairs, ctx)
    if axis_size(axes[-1]) != where.axes[0][1].size:  # every column of a row written
        raise Departure("a ScatterND of expert rows narrower than the rows they overwrite")
    if [",".join(f.var for f in a) for a in axes[:-1]] != pairs:
        raise Departure(f"a ScatterND at ({', '.join(pairs)}) into a value laid out otherwise")
    done: tuple[tuple[int, Proj], ...] = ()
    if base is not None and isinstance(base.term, PairRows):
        done = base.term.branches
    if e in {b for b, _ in done}:
        raise Departure(f"a ScatterND writing expert {e}'s rows a second time")
    out_axes = (*axes[:-1], (Factor(rows.axes[0][1].var, axes[-1][0].size),))
    return Meaning(out_axes, PairRows((*done, (e, rows.term))))


def _write_back(
    node: ir.Node,
    base: Meaning | None,
    where: Meaning,
    rows: Meaning,
    pairs: list[str],
    ctx: Context,
) -> Meaning:
    """``acc[mask_e] = acc[mask_e] + w * FC2_e`` written element by element: a loop branch.

    The rows are the accumulator read at expert ``e``'s tokens plus its weighted rows; each
    token chose ``e`` once, so writing them back at those tokens' elements adds the branch.
    """
    update = rows.term
    assert isinstance(update, BranchUpdate)
    e = filtered_expert(where.axes[0][0].var)
    total = base.term if base is not None else None
    if base is None:
        total_m = accumulator(ctx, node.inputs[0])
        base, total = total_m, total_m.term if total_m is not None else None
    if base is None or not isinstance(total, ExpertSum) or update.total is not total:
        raise Departure(f"a ScatterND of {update.text()} into other than that accumulator")
    if update.weighted.expert.expert != e:
        raise Departure(f"a ScatterND of another expert's update at expert {e}'s tokens")
    if e in total.experts:
        raise Departure(f"a ScatterND adding expert {e}'s rows a second time")
    flat = [f.var for a in rows.axes for f in a]
    if len(rows.axes) != 1 or flat[:1] != [filtered_var(e)] or len(flat) != 2:  # type: ignore[arg-type]
        raise Departure(
            f"a ScatterND at expert {e}'s element tuples of rows laid out {rows.layout()}"
        )
    if (
        rows.axes[0][0].size != where.axes[0][0].size
        or rows.axes[0][1].size != where.axes[0][1].size
    ):
        raise Departure(f"a ScatterND of expert {e}'s rows enumerated in another order")
    if [",".join(f.var for f in a) for a in base.axes[:-1]] != pairs:
        raise Departure(f"a ScatterND at ({', '.join(pairs)}) into a value laid out otherwise")
    if axis_size(base.axes[-1]) != where.axes[0][1].size:
        raise Departure("a ScatterND of rows narrower than the rows they overwrite")
    return Meaning(base.axes, ExpertSum((*total.branches, (e, update.weighted))))


def _whole_rows(node: ir.Node, rows: Meaning, ctx: Context) -> Meaning | None:
    """``rows[0 : Shape(tuples)[d]]`` where that dim is the rows' own length: the rows.

    TorchScript's index_put cuts the flattened values to the number of element tuples it
    writes; the tuples of expert ``e``'s rows' elements are exactly as many (``R_e * O``).
    """
    if not isinstance(rows.term, BranchUpdate | Proj) or len(rows.axes) != 1:
        return None
    starts = small_const(node.inputs[1]) if len(node.inputs) > 1 else None
    axes = small_const(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else None
    steps = small_const(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else None
    if starts is None or starts.reshape(-1).tolist() != [0]:
        return None
    if (axes is not None and axes.reshape(-1).tolist() not in ([0], [-1])) or (
        steps is not None and steps.reshape(-1).tolist() != [1]
    ):
        return None
    end = node.inputs[2] if len(node.inputs) > 2 else None
    dim = _shape_dim(end, ctx)
    if dim is None or dim != axis_size(rows.axes[0]):
        return None
    return rows


def _shape_dim(value: ir.Value | None, ctx: Context) -> Dim | None:
    """The size ``Unsqueeze(Gather(Shape(v), d))`` holds, read from ``v``'s meaning."""
    node = value.producer() if value is not None else None
    if node is not None and node.op_type in ("Unsqueeze", "Reshape", "Squeeze"):
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is None or node.op_type != "Gather" or attr_int(node, "axis", 0) != 0:
        return None
    d = small_const(node.inputs[1])
    shape = node.inputs[0].producer() if node.inputs[0] is not None else None
    if d is None or d.size != 1 or shape is None or shape.op_type != "Shape":
        return None
    if attr_int(shape, "start", 0) != 0 or "end" in shape.attributes:
        return None
    found = ctx.meanings.get(id(shape.inputs[0]))
    if found is None:
        return None
    axes = found[1].axes
    at = int(d.reshape(-1)[0])
    return axis_size(axes[at]) if -len(axes) <= at < len(axes) else None


def _complete(pairs: PairRows, ctx: Context) -> bool:
    return pairs.experts >= frozenset(range(ctx.experts))


def _weighted(described: list[Meaning], ctx: Context) -> Meaning | None:
    """``w[t, j]`` times every expert's rows at their pairs (the layer, at ``k = 1``)."""
    w = next((m for m in described if isinstance(m.term, Weights)), None)
    p = next((m for m in described if isinstance(m.term, PairRows)), None)
    if w is None or p is None:
        return None
    if not _complete(p.term, ctx):  # type: ignore[arg-type]
        missing = sorted(set(range(ctx.experts)) - p.term.experts)  # type: ignore[union-attr]
        raise Departure(f"the weights times expert rows where experts {missing} wrote none")
    axes = broadcast_axes(w.axes, p.axes)
    term = WeightedPairs(w.term, p.term)  # type: ignore[arg-type]
    return Meaning(axes, _summed(term) if ctx.k == 1 else term)


def _summed(term: WeightedPairs) -> ExpertSum:
    return ExpertSum(tuple((e, Weighted(term.weights, proj)) for e, proj in term.pairs.branches))


def _slot_sum(node: ir.Node, m: Meaning) -> Meaning | None:
    """The weighted pair rows summed over the slot axis ``j``: the layer."""
    if not isinstance(m.term, WeightedPairs):
        return None
    axes = node_axes(node, 1)
    keep = attr_int(node, "keepdims", 1)
    rank = len(m.axes)
    if not axes or len(axes) != 1 or [f.var for f in m.axes[axes[0] % rank]] != ["j"]:
        raise Departure(f"a ReduceSum of {m.term.text()} over other than the slots")
    drop = axes[0] % rank
    out = tuple(() if i == drop else a for i, a in enumerate(m.axes) if i != drop or keep != 0)
    return Meaning(out, _summed(m.term))


def pair_transfer(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> list | None:
    """The output's meaning where ``node`` is one of the ops above (else None)."""
    op = node.op_type
    first = ins[0] if ins else None
    found = None
    if op == "NonZero" and first is not None:
        found = _element_tuples(first, ctx)
    elif op == "Concat":
        found = _rows_shape(node, ins)
    elif op == "Expand" and first is not None and len(ins) > 1 and ins[1] is not None:
        if isinstance(ins[1].term, RowsShape):
            found = _expand_rows(first, ins[1].term)
    elif op == "Slice" and first is not None:
        found = _whole_rows(node, first, ctx)
    elif op == "ScatterND" and len(ins) >= 3:
        found = _write_rows(node, ins, ctx)
    elif op == "Mul":
        found = _weighted([m for m in ins if m is not None], ctx)
    elif op == "ReduceSum" and first is not None:
        found = _expert_count(node, first, ctx) or _slot_sum(node, first)
    return None if found is None else [found]
