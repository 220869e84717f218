"""What arithmetic does to meanings: elementwise ops, projections, sums over the slots.

* Elementwise ops of FC1's projections (with constants that broadcast over the feature axis
  only, or with each other row for row) are the activation: an :class:`~.terms.Act` keeping its
  nodes. On the routing alone they stay routing values; on FC2's output only the product with
  the routing weights (:class:`~.terms.Weighted`) and the bias of FC2 are described.
* ``MatMul`` of the tokens (FC1) or of the activations (FC2) by an expert stack gathered at the
  ids is a :class:`~.terms.Proj` when every output row meets its own token and its own expert:
  the batch axes align (repeats matched to the slots) and no token index appears twice.
  ``MatMul`` of the weights ``[.., 1, k]`` by FC2's ``[.., k, H]`` sums over the slots.
* ``GroupedMatMul`` is FC1/FC2 by its ONNX definition (``out[m, s] = in[m] @ W[idx[m, s]]``).
* ``ReduceSum`` over the slot axis of the weighted outputs is the combine.
Every refusal is a :class:`~.layout.Departure` whose text says what the node computes instead.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning import dense, index_arith, sorted_rows
from onnx_moe_fuse.rewrites.canonical.experts.meaning.context import Context
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import (
    Departure,
    broadcast_axes,
    normalise,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import (
    SORTED,
    AccRows,
    Act,
    Axis,
    BranchUpdate,
    Chosen,
    Counts,
    DenseWeights,
    ExpertSum,
    Factor,
    Ids,
    Mask,
    Meaning,
    Param,
    Proj,
    Routing,
    RowIndex,
    SlotSum,
    Term,
    Tokens,
    Weighted,
    Weights,
    WeightSource,
    axis_size,
    filtered_expert,
    is_repeat,
    is_row_var,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import (
    const_shape,
    is_const,
    is_zeros,
    small_const,
)
from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import attr_int, node_axes, normalize_axes

__all__ = [
    "ELEMENTWISE",
    "elementwise",
    "feature_select",
    "grouped_matmul",
    "matmul",
    "reduce_sum",
    "routing_value",
]

#: Ops computing each output element from the elements at its position (broadcast).
ELEMENTWISE = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Where", "Clip",
        "Sigmoid", "HardSigmoid", "Tanh", "Relu", "LeakyRelu", "Exp", "Log", "Abs", "Neg",
        "Sqrt", "Reciprocal", "Erf", "Softplus", "Softsign", "Swish", "Gelu", "Elu", "Selu",
        "Celu", "Mish", "HardSwish", "ThresholdedRelu", "PRelu", "Sign", "Identity", "Cast",
        "Dropout", "Mod", "Floor",
    }
)  # fmt: skip

_FEATURE = "f"  # the activation's feature index: FC1's output columns, however sliced


def _is_expert(term: Term) -> bool:
    return isinstance(term, Act) or (isinstance(term, Proj) and term.stage == 1)


def _routing(term: Term) -> bool:
    return isinstance(term, Weights | Routing)


def _feature(m: Meaning) -> Factor:
    """The feature factor of an FC1 / activation value: its last axis, one feature index."""
    last = m.axes[-1] if m.axes else ()
    if len(last) != 1 or is_row_var(last[0].var):
        raise Departure(f"a value whose last axis {m.layout()} is not FC1's features")
    return last[0]


def _as_activation(m: Meaning) -> Meaning:
    """``m`` with its feature index written ``f`` (activation operands align on it)."""
    f = _feature(m)
    return Meaning((*m.axes[:-1], (Factor(_FEATURE, f.size),)), m.term)


def _const_fits(shape: tuple[int, ...], feature: Dim) -> bool:
    """A constant broadcast over the feature axis only: ``[.., 1, N]``, ``[N]``, a scalar."""
    if not shape:
        return True
    *lead, last = shape
    return all(d == 1 for d in lead) and (last == 1 or Dim.of(last) == feature)


def elementwise(node: ir.Node, ins: list[Meaning | None], ctx: Context) -> Meaning:
    """An elementwise node's output meaning (inputs: meanings, None for constants/others)."""
    k = ctx.k
    described = [m for m in ins if m is not None]
    terms = [m.term for m in described]
    op = node.op_type
    foreign = [v for v, m in zip(node.inputs, ins, strict=False) if m is None and v is not None]
    if op == "Add" and len(described) == 1 and isinstance(terms[0], ExpertSum):
        if len(foreign) == 1 and is_zeros(foreign[0]):  # the accumulator started from zeros
            return described[0]
    if any(not is_const(v) for v in foreign):
        name = next(v.name for v in foreign if not is_const(v))
        raise Departure(f"{op} with '{name}', a value this analysis does not describe")
    if op in ("Identity", "Dropout"):
        return described[0]
    if op == "Cast" and _int_like(terms):
        return index_arith.cast_index(node, described[0], k)
    if all(_routing(t) for t in terms):
        return routing_value(node, described, ctx)
    if any(isinstance(t, Ids) for t in terms):
        raise Departure(f"{op} of the expert indices (they may only select experts)")
    if all(isinstance(t, RowIndex) for t in terms):
        return index_arith.index_arithmetic(node, ins, k)
    if op == "Add" and len(described) == 1 and isinstance(terms[0], Proj):
        if terms[0].expert is not None or terms[0].stage == 2:
            return _const_bias(node, ins, described[0])
    if all(_is_expert(t) for t in terms):
        return _activation(node, ins)
    if op == "Mul" and len(described) == 2:
        product = dense.dense_product(described)
        return product if product is not None else _weighted(described)
    if op in ("Add", "Sum") and len(described) == 2:
        return _added(described)
    kinds = ", ".join(t.text() for t in terms)
    raise Departure(f"{op} of {kinds}")


def _int_like(terms: list[Term]) -> bool:
    return bool(terms) and all(
        isinstance(t, Ids | RowIndex | Mask | Chosen | Counts) for t in terms
    )


def routing_value(node: ir.Node, described: list[Meaning], ctx: Context) -> Meaning:
    """A routing value: ``[T, k]`` weights where the broadcast layout is ``[t, j]``."""
    out = node.outputs[0]
    try:
        axes = described[0].axes
        for m in described[1:]:
            axes = broadcast_axes(axes, m.axes)
    except Departure:
        return Meaning(described[0].axes, Routing())
    if ctx.per_slot([[f.var for f in a] for a in axes]):
        return Meaning(axes, Weights(out))
    return Meaning(axes, Routing())


def _activation(node: ir.Node, ins: list[Meaning | None]) -> Meaning:
    """FC1's projections combined elementwise (with constants on the feature axis)."""
    described = [_as_activation(m) for m in ins if m is not None]
    feature = _feature(described[0]).size
    for v, m in zip(node.inputs, ins, strict=False):
        if m is None and v is not None:
            shape = const_shape(v)
            if shape is None:
                raise Departure(f"{node.op_type} of FC1's output and '{v.name}', no constant")
            if not _const_fits(shape, feature):
                raise Departure(
                    f"{node.op_type} of FC1's output with a constant of shape {list(shape)} "
                    "(not broadcast over the features alone)"
                )
    if any(_feature(m).size != feature for m in described):
        raise Departure(f"{node.op_type} of activation operands of different widths")
    axes = described[0].axes
    for m in described[1:]:
        axes = broadcast_axes(axes, m.axes)
    leaves: list[Proj] = []
    nodes: list[ir.Node] = []
    for m in described:
        t = m.term
        if isinstance(t, Proj):
            leaves.append(t)
        else:
            assert isinstance(t, Act)
            leaves.extend(t.leaves)
            nodes.extend(t.nodes)
    unique_leaves = tuple(dict.fromkeys(leaves))
    return Meaning(normalise(axes), Act(unique_leaves, (*dict.fromkeys(nodes), node)))


def feature_select(node: ir.Node, m: Meaning, out: ir.Value) -> Meaning:
    """A Slice/Split/Gather of FC1's output columns (the gate and linear halves)."""
    if not _is_expert(m.term):
        raise Departure(f"{node.op_type} of {m.term.text()}")
    a = _as_activation(m)
    rank = len(a.axes)
    if node.op_type == "Slice":
        axes = node_axes(node, 3)
        starts = const_shape(node.inputs[1]) or (0,)
        axes = normalize_axes(axes, rank) if axes is not None else list(range(starts[0]))
    elif node.op_type == "Split":
        axes = [attr_int(node, "axis", 0) % rank]
    else:  # Gather
        axes = [attr_int(node, "axis", 0) % rank]
        if const_shape(node.inputs[1]) is None or len(const_shape(node.inputs[1]) or ()) != 1:
            raise Departure("a Gather of FC1's columns by other than a 1-D constant")
    if axes != [rank - 1]:
        raise Departure(f"a {node.op_type} of FC1's output along the rows (axes {axes})")
    width = _selected_width(node, out, _feature(a).size, rank)
    if width is None:
        raise Departure(f"a {node.op_type} of FC1's columns of unknown width")
    t = m.term
    leaves = (t,) if isinstance(t, Proj) else t.leaves  # type: ignore[union-attr]
    nodes = () if isinstance(t, Proj) else t.nodes  # type: ignore[union-attr]
    axes_out = (*a.axes[:-1], (Factor(_FEATURE, Dim.of(width)),))
    return Meaning(axes_out, Act(tuple(leaves), (*nodes, node)))


def _selected_width(node: ir.Node, out: ir.Value, size: Dim, rank: int) -> int | None:
    """How many columns a Slice/Split/Gather of ``size`` feature columns keeps."""
    dims = out.shape
    if dims is not None and len(dims) == rank and isinstance(dims[-1], int):
        return dims[-1]
    if size.syms:
        return None
    columns = np.arange(size.coef)
    if node.op_type == "Gather":
        index = small_const(node.inputs[1])
        return None if index is None else int(index.size)
    if node.op_type == "Slice":
        starts, ends = small_const(node.inputs[1]), small_const(node.inputs[2])
        steps = small_const(node.inputs[4]) if len(node.inputs) > 4 else None
        if starts is None or ends is None or starts.size != 1 or ends.size != 1:
            return None
        step = int(steps.reshape(-1)[0]) if steps is not None else 1
        lo, hi = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
        return len(columns[lo:hi:step])
    split = small_const(node.inputs[1]) if len(node.inputs) > 1 else None
    if split is not None:
        return int(split.reshape(-1)[out.index()])
    count = attr_int(node, "num_outputs", len(node.outputs)) or len(node.outputs)
    return size.coef // count if size.coef % count == 0 else None


def _weighted(described: list[Meaning]) -> Meaning:
    """``w[t, j] * FC2[t, j, o]`` with the two laid out alike (broadcast)."""
    w = next((m for m in described if isinstance(m.term, Weights)), None)
    y = next((m for m in described if isinstance(m.term, Proj) and m.term.stage == 2), None)
    if w is None or y is None:
        kinds = " and ".join(m.term.text() for m in described)
        raise Departure(f"a product of {kinds} (expected w[t, j] * FC2[t, j, o])")
    axes = broadcast_axes(w.axes, y.axes)
    return Meaning(normalise(axes), Weighted(w.term, y.term))  # type: ignore[arg-type]


def _added(described: list[Meaning]) -> Meaning:
    """A projection plus its bias gathered at the same ids, or two partial slot sums."""
    a, b = described
    if isinstance(b.term, Proj):
        a, b = b, a
    if (
        isinstance(a.term, Proj)
        and isinstance(b.term, Param)
        and (b.term.selected or dense.is_dense(a))
    ):
        if a.term.bias is not None:
            raise Departure("a second bias added to a projection")
        if len(b.term.feats) != 1 or not b.axes or len(b.axes[-1]) != 1:
            raise Departure(f"a bias {b.term.text()} that is not one row per expert")
        if b.axes[-1][0].size != a.axes[-1][0].size if a.axes and a.axes[-1] else True:
            raise Departure("a bias whose width is not the projection's")
        bias_axes = (*b.axes[:-1], a.axes[-1])
        axes = broadcast_axes(a.axes, bias_axes)
        p = a.term
        biased = Proj(p.stage, p.input, p.weight, p.contracted, p.out_var, b.term)
        return Meaning(normalise(axes), biased)
    acc = next((m for m in described if isinstance(m.term, AccRows)), None)
    part = next((m for m in described if isinstance(m.term, Weighted)), None)
    if acc is not None and part is not None:
        if not part.axes or not acc.axes or axis_size(part.axes[-1]) != axis_size(acc.axes[-1]):
            raise Departure("a branch's weighted rows added to accumulator rows of another width")
        # the output features are the accumulator's: the same columns, named by it
        axes = broadcast_axes(acc.axes, (*part.axes[:-1], acc.axes[-1]))
        return Meaning(axes, BranchUpdate(acc.term.total, part.term))  # type: ignore[attr-defined]
    if isinstance(a.term, ExpertSum) and isinstance(b.term, ExpertSum):
        if a.term.experts & b.term.experts:
            raise Departure("a sum of two accumulators holding the same expert's rows")
        if not a.axes or not b.axes or axis_size(a.axes[-1]) != axis_size(b.axes[-1]):
            raise Departure("a sum of accumulators of different widths")
        axes = broadcast_axes(a.axes, (*b.axes[:-1], a.axes[-1]))
        return Meaning(axes, ExpertSum((*a.term.branches, *b.term.branches)))
    if isinstance(a.term, SlotSum) and isinstance(b.term, SlotSum):
        if a.term.inner.expert is not b.term.inner.expert or a.term.slots & b.term.slots:
            raise Departure("a sum of slot sums of other experts' outputs, or of a slot twice")
        if getattr(a.term.inner, "shared", None) is not getattr(b.term.inner, "shared", None):
            raise Departure("a sum of slot sums that add different values of the tokens")
        axes = broadcast_axes(a.axes, b.axes)
        return Meaning(axes, SlotSum(a.term.inner, a.term.slots | b.term.slots))
    raise Departure(f"a sum of {a.term.text()} and {b.term.text()}")


def _const_bias(node: ir.Node, ins: list[Meaning | None], m: Meaning) -> Meaning:
    """A loop branch's projection plus its expert's own bias ``[N]`` (or ``[1, N]``)."""
    p = m.term
    assert isinstance(p, Proj)
    value = next(v for v, x in zip(node.inputs, ins, strict=False) if x is None)
    shape = const_shape(value)
    width = axis_size(m.axes[-1]) if m.axes else None
    if p.expert is None:
        raise Departure("a constant added to FC2's outputs, not an expert's bias")
    if shape is None or [d for d in shape if d != 1] != [width.coef if width else -1]:
        raise Departure(f"a constant of shape {shape} added to a projection, not its bias")
    if p.bias is not None:
        raise Departure("a second bias added to a projection")
    bias = Param(WeightSource(value), (f"{value.name}#b",), single=True)
    return Meaning(
        m.axes, Proj(p.stage, p.input, p.weight, p.contracted, p.out_var, bias, p.expert)
    )


def _single(axis: Axis, what: str) -> Factor:
    if len(axis) != 1:
        raise Departure(f"{what} over an axis holding {len(axis)} indices")
    return axis[0]


def _check_rows(axes: tuple[Axis, ...], what: str, k: int) -> int | None:
    """Every output row meets one token and one slot, once: returns a loop branch's expert.

    Per-slot rows hold ``t`` and ``j`` once each (None is returned); a loop branch's rows are
    its filtered index alone.
    """
    row_vars = [f.var for a in axes for f in a if is_row_var(f.var) and not is_repeat(f.var)]
    if len(row_vars) != len(set(row_vars)):
        raise Departure(f"{what} in which each row meets every token's expert (not per slot)")
    if SORTED in row_vars:  # every (token, slot) row, sorted by expert
        if row_vars != [SORTED]:
            raise Departure(f"{what} whose rows mix the sorted rows with other indices")
        return None
    if "e" in row_vars:  # a dense form: every expert's output for every token
        if "t" not in row_vars and not any(v.startswith("t.") for v in row_vars):
            raise Departure(f"{what} of every expert whose rows are not the tokens")
        if "j" in row_vars:
            raise Departure(f"{what} of every expert and of the slots at once")
        return None
    branches = [filtered_expert(v) for v in row_vars if filtered_expert(v) is not None]
    if branches:
        if len(row_vars) != 1:
            raise Departure(f"{what} whose rows mix a loop branch's rows with other indices")
        return branches[0]
    if "j" not in row_vars and k > 1:  # at k = 1 the slot index is 0 everywhere: no axis
        raise Departure(f"{what} whose rows are not per slot")
    return None


def matmul(node: ir.Node, a: Meaning | None, b: Meaning | None, k_slots: int) -> Meaning:
    """``MatMul(a, b)``: FC1/FC2 by gathered expert weights, or the combine over the slots."""
    if a is None or b is None or len(a.axes) < 2 or len(b.axes) < 2:
        raise Departure("a MatMul of a value that is not described, or of rank 1")
    ta, tb = a.term, b.term
    if isinstance(tb, Param) and tb.single:
        return _branch_projection(a, b, k_slots)
    if isinstance(tb, Param):
        if not isinstance(ta, Tokens) and not _is_expert(ta):
            raise Departure(f"a MatMul of {ta.text()} by expert weights")
        ka = _single(a.axes[-1], "a MatMul contracting")
        kb = _single(b.axes[-2], "a MatMul contracting")
        nb = _single(b.axes[-1], "a MatMul of weights")
        if ka.size != kb.size or is_row_var(kb.var) or is_row_var(nb.var):
            raise Departure("a MatMul contracting axes of different sizes")
        if isinstance(ta, Tokens) and ka.var != "h":
            raise Departure("a MatMul contracting the tokens over other than the features")
        batch = broadcast_axes(a.axes[:-2], b.axes[:-2])
        axes = normalise((*batch, a.axes[-2], b.axes[-1]))
        _check_rows(axes, "a projection", k_slots)
        stage = 1 if isinstance(ta, Tokens) else 2
        return Meaning(axes, Proj(stage, ta, tb, kb.var, nb.var))
    if isinstance(ta, DenseWeights) and isinstance(tb, Proj) and dense.is_dense(b):
        if not ta.summed or _single(a.axes[-1], "a combine").var != "e" or b.axes[-2] != a.axes[-1]:
            raise Departure("a MatMul of the dense weights and FC2 that does not sum over experts")
        batch = broadcast_axes(a.axes[:-2], b.axes[:-2])
        axes = normalise((*batch, a.axes[-2], b.axes[-1]))
        return Meaning(axes, SlotSum(Weighted(ta.weights, tb), frozenset(range(k_slots))))
    w, y, w_first = (a, b, True) if isinstance(ta, Weights) else (b, a, False)
    if isinstance(w.term, Weights) and isinstance(y.term, Proj) and y.term.stage == 2:
        left, right = (w, y) if w_first else (y, w)
        # at k = 1 the one slot is no index: the contracted axes are both of size 1
        unit_slot = k_slots == 1 and left.axes[-1] == () == right.axes[-2]
        if not unit_slot and (
            _single(left.axes[-1], "a combine").var != "j" or right.axes[-2] != left.axes[-1]
        ):
            raise Departure("a MatMul of the weights and FC2 that does not sum over the slots")
        batch = broadcast_axes(left.axes[:-2], right.axes[:-2])
        axes = normalise((*batch, left.axes[-2], right.axes[-1]))
        inner = Weighted(w.term, y.term)
        return Meaning(axes, SlotSum(inner, frozenset(range(k_slots))))
    raise Departure(f"a MatMul of {ta.text()} and {tb.text()}")


def _branch_projection(a: Meaning, b: Meaning, k: int) -> Meaning:
    """A loop branch's rows times its expert's own ``[K, N]`` weight."""
    ta, tb = a.term, b.term
    assert isinstance(tb, Param)
    if not isinstance(ta, Tokens) and not _is_expert(ta):
        raise Departure(f"a MatMul of {ta.text()} by one weight")
    ka = _single(a.axes[-1], "a MatMul contracting")
    kb, nb = _single(b.axes[-2], "a MatMul"), _single(b.axes[-1], "a MatMul")
    if ka.size != kb.size:
        raise Departure("a MatMul contracting axes of different sizes")
    axes = normalise((*a.axes[:-1], b.axes[-1]))
    expert = _check_rows(axes, "a projection by one weight", k)
    if expert is None:
        raise Departure(
            f"a projection by the single weight {tb.source.name} of rows of every expert"
        )
    leaf_expert = getattr(_leaf(ta), "expert", None)
    if not isinstance(ta, Tokens) and leaf_expert is not None and leaf_expert != expert:
        raise Departure(f"expert {expert}'s FC2 of another branch's activations")
    stage = 1 if isinstance(ta, Tokens) else 2
    return Meaning(axes, Proj(stage, ta, tb, kb.var, nb.var, expert=expert))


def _leaf(term: Term) -> Proj | None:
    if isinstance(term, Proj):
        return term
    return term.leaves[0] if isinstance(term, Act) and term.leaves else None


def grouped_matmul(
    node: ir.Node, ins: list[Meaning | None], bias: Meaning | None, k: int
) -> Meaning:
    """``GroupedMatMul(in [M, K], W [E, K, N], idx [M, S] (, b [E, N]))``."""
    a, w, idx = ins[:3]
    if a is None or w is None or idx is None or not isinstance(idx.term, Ids):
        raise Departure("a GroupedMatMul whose operands are not the tokens, weights and ids")
    if not isinstance(w.term, Param) or w.term.selected or len(w.axes) != 3:
        raise Departure("a GroupedMatMul whose weights are not a constant [E, K, N] stack")
    if not isinstance(a.term, Tokens) and not _is_expert(a.term):
        raise Departure(f"a GroupedMatMul of {a.term.text()}")
    if len(a.axes) != 2 or len(idx.axes) != 2:
        raise Departure("a GroupedMatMul of operands that are not [M, K] and [M, S]")
    rows = broadcast_axes((a.axes[0],), (idx.axes[0],))
    k_in = _single(a.axes[1], "a GroupedMatMul contracting")
    kf, nf = w.term.feats
    if k_in.size != w.axes[1][0].size:
        raise Departure("a GroupedMatMul contracting axes of different sizes")
    axes = normalise((*rows, idx.axes[1], w.axes[2]))
    _check_rows(axes, "a GroupedMatMul", k)
    selected = Param(w.term.source, w.term.feats, selected=True)
    b = None
    if bias is not None:
        if not isinstance(bias.term, Param) or bias.term.selected:
            raise Departure("a GroupedMatMul bias that is not a constant [E, N]")
        b = Param(bias.term.source, bias.term.feats, selected=True)
    stage = 1 if isinstance(a.term, Tokens) else 2
    return Meaning(axes, Proj(stage, a.term, selected, kf, nf, b))


def reduce_sum(node: ir.Node, m: Meaning, k_slots: int) -> Meaning:
    """``ReduceSum`` over the slot axis of the weighted outputs (or of a routing value)."""
    rank = len(m.axes)
    axes = node_axes(node, 1)
    if axes is None:
        raise Departure("a ReduceSum whose axes are not constant")
    if not axes and not attr_int(node, "noop_with_empty_axes", 0):
        axes = list(range(rank))  # no axes given: the sum of every element
    axes = normalize_axes(axes, rank)
    if axes is None:
        raise Departure("a ReduceSum whose axes are not constant")
    keep = attr_int(node, "keepdims", 1)
    out = [() if i in axes and keep else a for i, a in enumerate(m.axes) if keep or i not in axes]
    if isinstance(m.term, Weights | Routing):
        return Meaning(tuple(out), Routing())
    summed = [m.axes[i] for i in axes if m.axes[i]]
    by_expert = dense.summed_over_experts(m, summed, out, k_slots)
    if by_expert is None:
        by_expert = sorted_rows.counts(node, m, summed, out)
    if by_expert is not None:
        return by_expert
    if all(not m.axes[i] for i in axes):  # only unit axes: the same values, relaid
        return Meaning(normalise(out), m.term)
    if not isinstance(m.term, Weighted):
        raise Departure(f"a ReduceSum of {m.term.text()}")
    summed = [m.axes[i] for i in axes if m.axes[i]]
    if [[f.var for f in a] for a in summed] != [["j"]]:
        names = ", ".join("(" + ", ".join(f.var for f in a) + ")" for a in summed) or "none"
        raise Departure(f"a ReduceSum of the weighted outputs over axes {names}, not the slots")
    return Meaning(normalise(out), SlotSum(m.term, frozenset(range(k_slots))))
