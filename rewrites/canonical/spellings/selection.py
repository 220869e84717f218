"""Top-1 selection spellings: ``ArgMax`` and the ``ReduceMax`` beside it -> ``TopK(k=1)``.

A Switch-style router picks each token's expert with ``ArgMax`` and weighs it by the largest
probability, ``ReduceMax`` of the same row (``torch.max(x, dim)`` exports as that pair). The
layer rules read the selection from a ``TopK``; the two rules here rewrite the pair into that
form on the working copy:

* ``ArgMax(S, axis=a, keepdims, select_last_index=0)`` -> ``TopK(S, [1], axis=a).indices``,
  followed by ``Squeeze(axes=[a])`` when ``keepdims=0``. Both return int64 and, on ties, the
  lowest index (ONNX: ``ArgMax`` without ``select_last_index`` takes the first maximum; ``TopK``
  breaks ties by the lower index), so they are the same tensor on NaN-free scores.
  ``select_last_index=1`` (the last maximum) is left alone.
* ``ReduceMax(S, axes=[a], keepdims)`` -> ``TopK(S, [1], axis=a).values`` (+ ``Squeeze``), only
  when the same ``S`` is also read by such an ``ArgMax`` or by a ``TopK(k=1, largest)`` along
  that axis: then the maximum is the value at the selected expert, which is what the layer
  proof (``moe.selected_weights``) reads as a per-slot weight. A ``ReduceMax`` elsewhere (the
  shift of a written-out softmax) is not touched.

* ``Concat(r_0, ..., r_{m-1})`` of the indices of top-1 rounds, round ``j`` a TopK-1 of the
  router logits with the experts of the earlier rounds scattered to ``-inf`` (PhiMoE's sparse
  mixer) -> the indices of ``TopK(L, m)``: round ``j`` is its column ``j``
  (:mod:`onnx_moe_fuse.rewrites.graph.selection_rounds` says when).

Only types TopK takes in every opset it is rewritten for (not bfloat16, which TopK gains in
opset 24 and ORT's CPU TopK lacks), and only from opset 13, where ``Squeeze`` takes its axes as
an input and ``TopK`` reads ``K`` as an input and a negative axis.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.rewrites.canonical.spellings.common import (
    SpellingRule,
    dtype_of,
    has_attribute_refs,
    small_ints,
)
from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_array, static_rank
from onnx_moe_fuse.rewrites.graph.selection_rounds import selection_round

__all__ = ["ArgMaxToTopK", "ReduceMaxToTopK", "RoundsToTopK", "selection_rules"]

_MIN_OPSET = 13
_T = ir.DataType
#: Score types every TopK from opset 13 takes (and ORT's CPU TopK runs).
_TOPK_TYPES = frozenset({_T.FLOAT16, _T.FLOAT, _T.DOUBLE, _T.INT32, _T.INT64})


def _normalised(axis: int | None, value: ir.Value) -> int | None:
    """``axis`` of ``value`` made non-negative when its rank is known; as it is otherwise.

    Two axes compare equal when these are equal: a negative and a non-negative axis of a value
    of unknown rank never do (which leaves the pair alone).
    """
    rank = static_rank(value)
    if axis is None or rank is None:
        return axis
    return axis % rank if -rank <= axis < rank else None


def _axis(node: ir.Node, value: ir.Value, name: str, default: int) -> int | None:
    """``node``'s axis attribute, normalised by ``value``'s rank where it is known."""
    return _normalised(attr_int(node, name, default), value)


def _argmax_axis(node: ir.Node) -> int | None:
    """The normalised axis of an ``ArgMax`` the rule rewrites, else None."""
    if node.op_type != "ArgMax" or node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    if has_attribute_refs(node) or attr_int(node, "select_last_index", 0) != 0:
        return None
    scores = node.inputs[0]
    return None if scores is None else _axis(node, scores, "axis", 0)


def _top1_axis(node: ir.Node) -> int | None:
    """The normalised axis of a ``TopK(k=1, largest=1)``, else None."""
    if node.op_type != "TopK" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    k = const_array(node.inputs[1])
    if k is None or np.asarray(k).size != 1 or int(np.asarray(k).reshape(-1)[0]) != 1:
        return None
    if has_attribute_refs(node) or attr_int(node, "largest", 1) != 1:
        return None
    scores = node.inputs[0]
    return None if scores is None else _axis(node, scores, "axis", -1)


def _checked(result: pattern.MatchResult, opset: int, scores: ir.Value, node: ir.Node):
    if opset < _MIN_OPSET:
        return result.fail(f"opset {opset} < {_MIN_OPSET}", node)
    if dtype_of(scores) not in _TOPK_TYPES:
        return result.fail(f"the scores are {dtype_of(scores)}, which TopK may not take", scores)
    if has_attribute_refs(node):
        return result.fail("attribute references", node)
    return result


def _top1(op, names, scores: ir.Value, replaced: ir.Value, axis: int, keepdims: int, output: int):
    """``TopK(scores, [1], axis)``'s values (``output`` 0) or indices (1), squeezed or not."""
    k = op.Constant(value_ints=[1], _outputs=[names(f"{replaced.name}_k")])
    outs = [names(f"{replaced.name}_top1_values"), names(f"{replaced.name}_top1_indices")]
    top = op.TopK(scores, k, axis=axis, largest=1, sorted=1, _outputs=outs)[output]
    if keepdims:
        return top
    axes = op.Constant(value_ints=[axis], _outputs=[names(f"{replaced.name}_axis")])
    return op.Squeeze(top, axes)


class ArgMaxToTopK(SpellingRule):
    """``ArgMax(S)`` (first maximum) -> the indices of ``TopK(S, 1)`` along the same axis."""

    def pattern(self, op, scores):
        """An ArgMax."""
        return op.ArgMax(scores, _outputs=["expert_index"])

    def check(self, context, scores, expert_index, **_) -> pattern.MatchResult:
        """A known axis, the first maximum on ties, a type TopK takes."""
        result = pattern.MatchResult()
        node = expert_index.producer()
        if _argmax_axis(node) is None:
            return result.fail("select_last_index=1 or an axis out of range", node)
        return _checked(result, self.opset, scores, node)

    def rewrite(self, op, scores, expert_index, **_):
        """``TopK(S, [1], axis).indices``, squeezed when the ArgMax drops the axis."""
        node = expert_index.producer()
        keepdims = attr_int(node, "keepdims", 1)
        return _top1(op, self.names, scores, expert_index, attr_int(node, "axis", 0), keepdims, 1)


class ReduceMaxToTopK(SpellingRule):
    """``ReduceMax(S, [a])`` beside a top-1 selection of ``S`` -> that selection's value."""

    def pattern(self, op, scores):
        """A ReduceMax (axes as an input or an attribute)."""
        return op.ReduceMax(scores, _allow_other_inputs=True, _outputs=["peak"])

    def check(self, context, scores, peak, **_) -> pattern.MatchResult:
        """One known axis, along which an ArgMax or a TopK(k=1) also selects from ``S``."""
        result = pattern.MatchResult()
        node = peak.producer()
        axis = self._axis(node, scores)
        if axis is None:
            return result.fail("not one constant axis", node)
        if attr_int(node, "noop_with_empty_axes", 0) != 0:
            return result.fail("noop_with_empty_axes", node)
        selections = {_argmax_axis(u) if u.op_type == "ArgMax" else _top1_axis(u)
                      for u, _ in scores.uses()}  # fmt: skip
        if axis not in selections:
            return result.fail("no top-1 selection of the same scores along that axis", scores)
        return _checked(result, self.opset, scores, node)

    def rewrite(self, op, scores, peak, **_):
        """``TopK(S, [1], axis).values``, squeezed when the ReduceMax drops the axis."""
        node = peak.producer()
        keepdims = attr_int(node, "keepdims", 1)
        return _top1(op, self.names, scores, peak, self._axes(node)[0], keepdims, 0)

    @staticmethod
    def _axes(node: ir.Node) -> list[int] | None:
        if len(node.inputs) > 1 and node.inputs[1] is not None:
            return small_ints(node.inputs[1])
        attr = node.attributes.get("axes")
        return None if attr is None or attr.is_ref() else list(attr.as_ints())

    def _axis(self, node: ir.Node, scores: ir.Value) -> int | None:
        axes = self._axes(node)
        return _normalised(axes[0], scores) if axes is not None and len(axes) == 1 else None


class RoundsToTopK(SpellingRule):
    """``Concat`` of the indices of top-1 rounds ``0..m-1`` -> ``TopK(L, m)``'s indices."""

    def pattern(self, op, first):
        """A Concat (any number of inputs)."""
        return op.Concat(first, _allow_other_inputs=True, _outputs=["joined"])

    def check(self, context, first, joined, **_) -> pattern.MatchResult:
        """Every input is the next round over the same logits, along the last axis."""
        result = pattern.MatchResult()
        node = joined.producer()
        rounds = [selection_round(v) for v in node.inputs]
        if len(rounds) < 2 or any(r is None for r in rounds):
            return result.fail("not every input is a top-1 round", node)
        if [r.column for r in rounds] != list(range(len(rounds))):
            return result.fail("the rounds are not 0..m-1 in order", node)
        if any(r.logits is not rounds[0].logits for r in rounds):
            return result.fail("the rounds select from different logits", node)
        axis = attr_int(node, "axis", None)
        rank = static_rank(rounds[0].logits)  # the rounds' indices have the logits' rank
        if axis is None or rank is None or axis % rank != rounds[0].axis:
            return result.fail("not concatenated along the selection axis", node)
        return _checked(result, self.opset, rounds[0].logits, node)

    def rewrite(self, op, first, joined, **_):
        """``TopK(L, [m], axis).indices``."""
        node = joined.producer()
        logits = selection_round(first).logits
        k = op.Constant(value_ints=[len(node.inputs)], _outputs=[self.names(f"{joined.name}_k")])
        outs = [self.names(f"{joined.name}_values"), self.names(f"{joined.name}_indices")]
        axis = selection_round(first).axis
        return op.TopK(logits, k, axis=axis, largest=1, sorted=1, _outputs=outs)[1]


def selection_rules(names, opset: int) -> list[pattern.RewriteRule]:
    """The top-1 selection spelling rules."""
    return [
        ArgMaxToTopK.rule(names, opset),
        ReduceMaxToTopK.rule(names, opset),
        RoundsToTopK.rule(names, opset),
    ]
