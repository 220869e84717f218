"""Row-split spellings: Reshapes that only regroup token rows, moved out of the combine.

Some exporters keep the tokens' ``[B, S]`` split through the experts' combine. optimum-onnx's
dense gpt-oss, for one, computes every expert on flat rows ``Y [E, T, H]`` and then mixes::

    Y4  = Reshape(Y, [E, B, -1, H])                        # [E, B, S, H]
    W4  = Unsqueeze(Reshape(Transpose(dense), [E, B, -1]), [3])    # [E, B, S, 1]
    out = ReduceSum(Mul(Y4, W4), [0], keepdims=0)          # [B, S, H]

The layer rules read the combine over flat rows (``ReduceSum(Mul(Y, Unsqueeze(W, [2])), [0])``,
:mod:`~onnx_moe_fuse.rewrites.canonical.experts.dense.combine`). Reshape only renumbers elements in row-major order, so the split can
move below the arithmetic; the rules here do that, each exact (the same products of the same
elements, summed over the same axis in the same order):

* :class:`MulOfSplitRows`: ``Mul(Reshape(y, t), Unsqueeze(Reshape(w, s), [r]))`` ->
  ``Reshape(Mul(y, Unsqueeze(w, [r'])), t)`` when ``w``'s dims are ``y``'s without the last,
  both Reshapes split them the same way and keep ``y``'s last axis (so element ``(p, h)`` of
  ``y`` and element ``p`` of ``w`` land on the same place);
* :class:`SumOverKeptAxis`: ``ReduceSum(Reshape(m, t), [a'], keepdims=0)`` ->
  ``Reshape(ReduceSum(m, [a], keepdims=0), t less entry a')`` when the Reshape leaves the summed
  axis whole (axis ``a`` of ``m``; the axes before it and after it hold as many elements on both
  sides): the experts' axis of ``[E, T, H] -> [E, B, S, H]``, or the slots' of
  ``[T, k, H] -> [B, S, k, H]``. The cut target reads the sum as ``t`` read ``m`` less that axis
  (a ``-1`` infers the same size; a ``0`` copies the same dim when ``a == a'``, and a target
  that may hold one is refused otherwise);
* :class:`TiledRowsAsExpand`: ``Reshape(Tile(x, [r, 1, ...]), t)`` with result ``[r, *dims(x)]``
  -> ``Expand(Unsqueeze(x, [0]), [r, 1, ...])``: Tile stacks ``r`` copies of ``x`` along axis 0,
  which the Reshape then splits into the copy and the row (the dense experts' token broadcast).

The dims are read symbolically (:func:`~onnx_moe_fuse.rewrites.graph.facts.value_dims`, which
evaluates targets computed from ``Shape``), so ``B`` and ``S`` need not be known: the proof asks
only that the two Reshapes give the same symbols. Anything not proved is left as it was.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.rewrites.canonical.spellings.common import (
    SpellingRule,
    int64_const,
    reduce_sum,
    small_ints,
    unsqueeze,
)
from onnx_moe_fuse.rewrites.graph.dims import Dim, product
from onnx_moe_fuse.rewrites.graph.facts import attr_int, node_axes, normalize_axes, static_rank
from onnx_moe_fuse.rewrites.graph.symbolic_dims import fill_dims, shape_value, value_dims

__all__ = ["MulOfSplitRows", "SumOverKeptAxis", "TiledRowsAsExpand", "split_rows_rules"]

#: ``Slice`` end that reaches past the end of any shape vector.
_TO_THE_END = 2**63 - 1


def _dims(value: ir.Value | None) -> list[Dim] | None:
    return value_dims(value) if value is not None else None


def _unsqueeze_axes(node: ir.Node, rank_out: int) -> list[int] | None:
    """The Unsqueeze node's axes, normalised against its output rank."""
    axes = node_axes(node)
    return None if axes is None else normalize_axes(axes, rank_out)


class _SplitRule(SpellingRule):
    """A row-split rule; ``proved=False`` makes its diagnostic twin (see :func:`split_rows_rules`)."""

    def __init__(self, names, opset: int, proved: bool = True) -> None:
        """``proved``: rewrite only what the check proves (False: the structure alone)."""
        super().__init__(names, opset)
        self.proved = proved


class MulOfSplitRows(_SplitRule):
    """``Mul(Reshape(y, t), Unsqueeze(Reshape(w, s), [last]))`` -> ``Reshape(Mul(y, w'), t)``."""

    def pattern(self, op, y, target, w, w_target, axes):
        """The weighted split rows."""
        split_y = op.Reshape(y, target, _allow_other_attributes=True, _outputs=["split_y"])
        split_w = op.Reshape(w, w_target, _allow_other_attributes=True)
        return op.Mul(split_y, op.Unsqueeze(split_w, axes, _outputs=["weights"]))

    def check(self, context, y, w, split_y, weights, **_) -> pattern.MatchResult:
        """``w`` is ``y`` less its last axis, and both are split the same way."""
        result = pattern.MatchResult()
        if not self.proved:
            return result
        # through fills: the dense weights are a scatter into zeros_like(logits), a fill
        dims_y, dims_w = fill_dims(y), fill_dims(w)
        split_dims, weight_dims = fill_dims(split_y), fill_dims(weights)
        if dims_y is None or dims_w is None or split_dims is None or weight_dims is None:
            return result.fail("the dims of the split rows are not known", split_y)
        if len(dims_y) < 2 or dims_w != dims_y[:-1]:
            return result.fail("the weights are not the rows less their last axis", w)
        if split_dims[-1] != dims_y[-1]:
            return result.fail("the split does not keep the rows' last axis", split_y)
        unsq = weights.producer()
        if _unsqueeze_axes(unsq, len(weight_dims)) != [len(weight_dims) - 1]:
            return result.fail("the weights' unit axis is not the last", weights)
        if weight_dims != [*split_dims[:-1], Dim.of(1)]:
            return result.fail("the weights are not split like the rows", weights)
        return result

    def rewrite(self, op, y, target, w, split_y, **_):
        """The product on the flat rows, split afterwards with the rows' own target."""
        dims_w = _dims(w)
        weights = unsqueeze(op, w, [len(dims_w) if dims_w is not None else -1], self)
        product = op.Mul(y, weights, _outputs=[self.names(split_y.name)])
        return _reshape_like(op, split_y.producer(), product, target)


class MulOfSplitRowsCommuted(MulOfSplitRows):
    """The same with the weights first: ``Mul(Unsqueeze(Reshape(w, s)), Reshape(y, t))``."""

    def pattern(self, op, y, target, w, w_target, axes):
        """The weighted split rows, weights first."""
        split_y = op.Reshape(y, target, _allow_other_attributes=True, _outputs=["split_y"])
        split_w = op.Reshape(w, w_target, _allow_other_attributes=True)
        return op.Mul(op.Unsqueeze(split_w, axes, _outputs=["weights"]), split_y)


def _reshape_like(op, reshape: ir.Node, data: ir.Value, target: ir.Value) -> ir.Value:
    """``Reshape(data, target)`` with the ``allowzero`` of the Reshape it replaces."""
    allowzero = attr_int(reshape, "allowzero", 0)
    if allowzero:
        return op.Reshape(data, target, allowzero=allowzero)
    return op.Reshape(data, target)


class SumOverKeptAxis(_SplitRule):
    """``ReduceSum(Reshape(m, t), [a'], keepdims=0)`` -> ``Reshape(ReduceSum(m, [a]), t - t[a'])``.

    The Reshape must leave the summed axis whole: ``t`` regroups the axes before it and the
    axes after it separately (``[E, T, H] -> [E, B, S, H]`` summed over ``E``; ``[T, k, H] ->
    [B, S, k, H]`` summed over ``k``).
    """

    def pattern(self, op, m, target):
        """A sum over one axis of a Reshape (axes an input or an attribute, by opset)."""
        split = op.Reshape(m, target, _allow_other_attributes=True, _outputs=["split"])
        return op.ReduceSum(
            split, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["total"]
        )

    def check(self, context, m, target, split, total, **_) -> pattern.MatchResult:
        """One axis summed without keepdims, left whole by the Reshape; the target can be cut."""
        result = pattern.MatchResult()
        red = total.producer()
        if not self.proved:
            if _guessed_axis(m, split, red) is None or self.opset < 10:
                return result.fail("the summed axis cannot be placed", split)
            return result
        dims_m, dims_split = fill_dims(m), fill_dims(split)  # the weights may be a fill's
        if dims_m is None or dims_split is None or len(dims_m) < 2 or len(dims_split) < 2:
            return result.fail("the dims around the sum are not known", split)
        axes = node_axes(red)
        axes = None if axes is None else normalize_axes(axes, len(dims_split))
        if axes is None or len(axes) != 1:
            return result.fail("the sum is not over one axis", total)
        if attr_int(red, "keepdims", 1):
            return result.fail("the sum keeps its axis", total)
        axis = _kept_axis(dims_m, dims_split, axes[0])
        if axis is None:
            return result.fail("the Reshape does not leave the summed axis whole", split)
        if axis != axes[0] and len(dims_m) == 2 and product(dims_split[: axes[0]]) == Dim.of(1):
            # only unit axes put before the summed one of [T*k, H] rows: no split of token rows,
            # but a one-token static export's un-flatten into [T = 1, k, H] slots, which the
            # layer rules read as it is
            return result.fail("the Reshape only puts unit axes before the summed axis", split)
        if axis != axes[0] and not _no_copy_markers(
            target, attr_int(split.producer(), "allowzero", 0)
        ):
            return result.fail("the target may copy dims, which move when the axis goes", target)
        cut = small_ints(target) is not None or _cut(target, axes[0]) is not None
        if not cut and self.opset < 10:
            return result.fail(
                "a computed target is cut by Slice, which takes inputs from 10", target
            )
        return result

    def rewrite(self, op, m, target, split, total, **_):
        """The sum first, over the same elements, then the Reshape to the target less the axis."""
        reshape, red = split.producer(), total.producer()
        if self.proved:
            position = normalize_axes(node_axes(red), len(fill_dims(split)))[0]
            axis = _kept_axis(fill_dims(m), fill_dims(split), position)
        else:
            position, axis = _guessed_axis(m, split, red)  # type: ignore[misc]
        summed = reduce_sum(op, m, [axis], self)
        name = self.names(target.name)
        ints = small_ints(target)
        if ints is not None:
            new_target = int64_const(op, ints[:position] + ints[position + 1 :], name)
            return _reshape_like(op, reshape, summed, new_target)
        pieces = _cut(target, position)
        if pieces is None:  # a computed target that is no Concat of pieces: Slice around it
            before = [
                op.Slice(target, int64_const(op, [0], name), int64_const(op, [position], name))
            ] if position else []  # fmt: skip
            after = op.Slice(
                target, int64_const(op, [position + 1], name), int64_const(op, [_TO_THE_END], name)
            )
            pieces = [*before, after]
        elif not pieces:
            pieces = [int64_const(op, [], name)]
        new_target = pieces[0] if len(pieces) == 1 else op.Concat(*pieces, axis=0, _outputs=[name])
        return _reshape_like(op, reshape, summed, new_target)


def _kept_axis(dims_m: list[Dim], dims_split: list[Dim], position: int) -> int | None:
    """The axis of ``m`` that is axis ``position`` of its Reshape ``split``, left whole.

    It has the same size, and the axes before it hold as many elements on both sides (so do the
    axes after it, then): row-major order puts element ``(p, i, q)`` at the same place.
    """
    before = product(dims_split[:position])
    # unit dims make several axes fit (all-1 static shapes): the same distance from the end
    # first (a split before the summed axis), then the same place (a split after it)
    from_end = len(dims_m) - (len(dims_split) - position)
    order = [from_end, position, *range(len(dims_m))]
    for axis in dict.fromkeys(a for a in order if 0 <= a < len(dims_m)):
        if product(dims_m[:axis]) == before and dims_m[axis] == dims_split[position]:
            if product(dims_m[axis + 1 :]) == product(dims_split[position + 1 :]):
                return axis
    return None


def _guessed_axis(m: ir.Value, split: ir.Value, red: ir.Node) -> tuple[int, int] | None:
    """``(position, axis)`` for the diagnostic twin: the summed axis read from ranks alone.

    Axis 0 stays axis 0 (the experts' sum); another axis keeps its distance from the end
    (the slots' sum of ``[B, S, k, H]``, ``k`` second to last in ``[T, k, H]`` too).
    """
    rank_m, rank_split = _rank(m), _rank(split)
    axes = node_axes(red)
    if rank_m is None or rank_split is None or axes is None or len(axes) != 1:
        return None
    if attr_int(red, "keepdims", 1):
        return None
    position = axes[0] % rank_split
    axis = 0 if position == 0 else rank_m - (rank_split - position)
    return (position, axis) if 0 <= axis < rank_m else None


#: Ops whose output has the rank of their first input (for :func:`_rank`).
_SAME_RANK = frozenset(
    {"Softmax", "Sigmoid", "Relu", "Tanh", "Cast", "Clip", "Identity", "Neg", "Slice", "TopK",
     "Gelu", "Erf", "Exp", "Reciprocal", "Sqrt", "Transpose", "Expand", "Tile", "Split"}
)  # fmt: skip
_BINARY = frozenset({"Mul", "Add", "Sub", "Div", "Pow", "Max", "Min", "MatMul"})


def _rank(value: ir.Value | None, depth: int = 0) -> int | None:
    """The rank of ``value`` as far as its dims or its producers tell (the diagnosis's guess).

    Where one operand of a broadcasting op has no known rank the other's is taken: enough to
    place a summed axis on a throw-away copy, never for a proof.
    """
    if value is None or depth > 24:
        return None
    dims = _dims(value)
    if dims is not None:
        return len(dims)
    rank = static_rank(value)
    node = value.producer()
    if rank is not None or node is None or not node.inputs:
        return rank
    op, first = node.op_type, node.inputs[0]
    if op == "Reshape" and len(node.inputs) > 1 and node.inputs[1] is not None:
        ints = small_ints(node.inputs[1])
        entries = _target_entries(node.inputs[1]) if ints is None else ints
        return None if entries is None else len(entries)
    if op in ("Unsqueeze", "Squeeze"):
        inner, axes = _rank(first, depth + 1), node_axes(node)
        if inner is None or axes is None or (op == "Squeeze" and not axes):
            return None
        return inner + len(axes) if op == "Unsqueeze" else inner - len(axes)
    if op in _SAME_RANK:
        return _rank(first, depth + 1)
    if op == "Gather" and len(node.inputs) > 1:
        data, index = _rank(first, depth + 1), _rank(node.inputs[1], depth + 1)
        return None if data is None or index is None else data + index - 1
    if op in _BINARY:
        known = [r for r in (_rank(v, depth + 1) for v in node.inputs[:2]) if r is not None]
        return max(known) if known else None
    return None


def _no_copy_markers(target: ir.Value, allowzero: int) -> bool:
    """Whether no entry of ``target`` can be ``0`` read as "copy the input's dim"."""
    if allowzero:
        return True
    ints = small_ints(target)
    if ints is not None:
        return 0 not in ints
    dims = _target_entries(target)
    return dims is not None and all(d.syms or d.coef != 0 for d in dims)


def _target_entries(target: ir.Value) -> list[Dim] | None:
    computed = shape_value(target)
    return None if computed is None or computed.scalar else list(computed.dims)


def _cut(target: ir.Value, position: int) -> list[ir.Value] | None:
    """A computed ``target`` less entry ``position``: its Concat's other pieces, else None.

    Only where the entry is a one-element piece of its own: cutting there keeps the other
    pieces' values (the token count from ``Shape(x)``), so the new Reshape reads nothing that
    the cut-off entry was made of.
    """
    node = target.producer()
    if node is None or node.op_type != "Concat" or node.domain not in ("", "ai.onnx"):
        return None
    if attr_int(node, "axis", None) not in (0, -1) or any(v is None for v in node.inputs):
        return None
    at = 0
    for i, piece in enumerate(node.inputs):
        dims = _dims(piece)
        if dims is None or len(dims) != 1 or dims[0].syms:
            return None
        width = dims[0].coef
        if at == position:
            return list(node.inputs[:i]) + list(node.inputs[i + 1 :]) if width == 1 else None
        at += width
        if at > position:
            return None  # the entry sits inside a longer piece
    return None


class TiledRowsAsExpand(SpellingRule):
    """``Reshape(Tile(x, [r, 1, ...]), t)`` giving ``[r, *dims(x)]`` -> an Expand of ``x``."""

    def pattern(self, op, x, repeats, target):
        """Tiled rows, regrouped."""
        return op.Reshape(
            op.Tile(x, repeats), target, _allow_other_attributes=True, _outputs=["stacked"]
        )

    def check(self, context, x, repeats, stacked, **_) -> pattern.MatchResult:
        """Only axis 0 repeated, and the Reshape makes the copies an axis of their own."""
        result = pattern.MatchResult()
        counts, dims_x, dims_out = small_ints(repeats), _dims(x), _dims(stacked)
        if counts is None or dims_x is None or dims_out is None:
            return result.fail("the tiled rows' dims are not known", stacked)
        if len(counts) != len(dims_x) or counts[0] < 1 or any(c != 1 for c in counts[1:]):
            return result.fail(f"repeats {counts} do not repeat axis 0 alone", repeats)
        if dims_out != [Dim.of(counts[0]), *dims_x]:
            return result.fail("the Reshape does not split the copies from the rows", stacked)
        return result

    def rewrite(self, op, x, repeats, stacked, **_):
        """``Expand(Unsqueeze(x, [0]), [r, 1, ...])``."""
        counts = small_ints(repeats)
        rows = unsqueeze(op, x, [0], self)
        shape = int64_const(op, [counts[0], *([1] * len(counts))], self.names(stacked.name))
        return op.Expand(rows, shape)


def split_rows_rules(names, opset: int, *, proved: bool = True) -> list[pattern.RewriteRule]:
    """The row-split spelling rules.

    ``proved=False`` gives their diagnostic twins, which move a split out of a combine on its
    structure alone: NOT exact, only for a throw-away copy on which the layer rules then say
    what else is wrong with a layer whose split could not be proved (a router over other rows
    splits other rows; the fuser's near miss reports it). Never used to emit a model.
    """
    rules = [
        MulOfSplitRows.rule(names, opset, proved),
        MulOfSplitRowsCommuted.rule(names, opset, proved),
        SumOverKeptAxis.rule(names, opset, proved),
    ]
    return [*rules, TiledRowsAsExpand.rule(names, opset)] if proved else rules
