"""Whole-layer rules: a mixture-of-experts layer in standard ONNX -> ``com.microsoft.MoE``/``QMoE``.

One rule matches one whole layer, from the routing TopK and the expert projections to the
combine, in every spelling it knows (onnxscript ``OrValue`` alternatives, so spellings add up
instead of multiplying). This module holds the per-slot layout, whose projections are
``[*, k, N]``, and the rule catalogue (:func:`moe_layer_rules`), which also takes the
flattened-rows layout of torch.onnx ``batched_mm`` exports from :mod:`.moe_layer_batched`:

* routing (shared, :func:`._moe_rule.routing_pattern`): ``TopK(scores, k)`` with the weights
  ``Div(v, ReduceSum(v))`` / ``Mul(v, Reciprocal(ReduceSum(v)))`` (renormalised), ``Softmax(v)``
  (top-k then softmax) or ``v`` as it is; whether ``scores`` is a ``Softmax`` of the logits is
  decided in ``check``;
* experts (FC1 on the tokens, FC2 on the activation): ``GroupedMatMul`` (opset 29; FC2 flattened
  to ``[M*k, I]`` rows with ``[M*k, 1]`` indices and reshaped back) or its decomposition
  ``Gather(weights, indices)`` + ``Unsqueeze`` (+ ``Expand``) + ``MatMul`` + ``Squeeze`` /
  ``Reshape``; biases as GroupedMatMul's 4th input or ``Gather(bias, indices)`` + ``Add``;
* activation (shared, :func:`._moe_rule.activation_pattern`), one rule class per family:
  :class:`GatedSwiGLUMoELayer` (SwiGLU from separate gate and up experts),
  :class:`FusedSwiGLUMoELayer` (SwiGLU from one FC1 cut by ``Slice`` - halves or strided - or
  ``Split``), :class:`ElementwiseMoELayer` (Relu, Gelu, SiLU, identity, and the exact-GELU
  spellings it must refuse); SwiGLU with optional ``Clip`` limits, alpha and beta;
* combine: ``ReduceSum(Mul(expert_out, Unsqueeze(weights, -1)), k axis)`` or ``MatMul`` of the
  weights as a row vector with the expert outputs (then ``Squeeze`` or ``Reshape``).

The pattern proves structure only; ``check`` proves meaning with
:func:`~._moe_analysis.analyse_layer` (axes, ``k``, Reshape targets, constants, indices, dtypes,
zero points, clamp limits, the routing form, the escapes of the router probabilities and the
dequantized weights) and returns a failed ``MatchResult`` with a plain-words reason otherwise.
``rewrite`` (:class:`._moe_rule.MoELayerRule`) runs the same analysis again (nothing is kept on
the rule between the two calls), repacks the weights (:mod:`._moe_emit`) and emits one node with
every attribute written and its inputs at ORT's positions (``""`` for an absent optional input).
The matched nodes are removed by the rewriter; what becomes dead outside the pattern (the router
Softmax, DequantizeLinear nodes, Constants) is left to a dead-code pass
(``onnx_moe_fuse.passes``).

Exports: the rule classes, :func:`moe_layer_rules`, :func:`moe_layer_rule_set` and the default
:data:`moe_layer_ruleset` (every target op, both layouts).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from onnxscript.rewriter import pattern

from ._moe_analysis import LayerPlan, analyse_layer
from ._moe_rule import FUSED_OPS, REPLACED_KEY, MoELayerRule, routing_pattern, var
from .moe_layer_batched import BATCHED_RULE_CLASSES

__all__ = [
    "COMBINES",
    "FUSED_OPS",
    "REPLACED_KEY",
    "RULE_CLASSES",
    "GatedSwiGLUMoELayer",
    "FusedSwiGLUMoELayer",
    "ElementwiseMoELayer",
    "moe_layer_rules",
    "moe_layer_rule_set",
    "moe_layer_ruleset",
]

#: The combine spellings of the per-slot layout; one rule instance each.
COMBINES = ("reduce_sum", "matmul_squeeze", "matmul_reshape")


# -- pattern pieces ----------------------------------------------------------------------------


def _selected_tail(op, lhs, tag: str, gmm_alternative) -> Any:
    """Gather/MatMul/unit-axis-drop (+ Gather/Add bias), or the GroupedMatMul alternative."""
    weight, idx = var(f"{tag}_weight"), var(f"{tag}_indices")
    selected = op.Gather(weight, idx, _outputs=[f"{tag}_gather"])
    mm = op.MatMul(lhs, selected, _outputs=[f"{tag}_matmul"])
    drop = pattern.OrValue(
        [op.Squeeze(mm, var(f"{tag}_drop_axes", True)), op.Reshape(mm, var(f"{tag}_drop_shape"))],
        name=f"{tag}_drop",
    )
    bias_sel = op.Gather(
        var(f"{tag}_bias", True), var(f"{tag}_bias_indices"), _outputs=[f"{tag}_bias_gather"]
    )
    return pattern.OrValue(
        [gmm_alternative, op.Add(drop, bias_sel), op.Add(bias_sel, drop), drop],
        name=f"{tag}_out",
    )


def _fc_tokens(op, tokens, tag: str) -> Any:
    """A projection of the tokens ``[*, K]`` by each token's k experts -> ``[*, k, N]``."""
    weight, idx, bias = var(f"{tag}_weight"), var(f"{tag}_indices"), var(f"{tag}_bias", True)
    gmm = op.GroupedMatMul(tokens, weight, idx, bias, _outputs=[f"{tag}_gmm"])
    unsq = op.Unsqueeze(tokens, var(f"{tag}_lhs_axes", True), _outputs=[f"{tag}_lhs_unsq"])
    lhs = pattern.OrValue(
        [op.Expand(unsq, var(f"{tag}_expand_shape"), _outputs=[f"{tag}_expand"]), unsq]
    )
    return _selected_tail(op, lhs, tag, gmm)


def _fc_slots(op, inputs, tag: str) -> Any:
    """A projection of per-slot inputs ``[*, k, K]`` by the slot's expert -> ``[*, k, N]``."""
    weight, idx, bias = var(f"{tag}_weight"), var(f"{tag}_indices"), var(f"{tag}_bias", True)
    rows = op.Reshape(inputs, var(f"{tag}_rows_shape"), _outputs=[f"{tag}_rows"])
    row_idx = op.Reshape(idx, var(f"{tag}_row_idx_shape"), _outputs=[f"{tag}_row_idx"])
    grouped = op.GroupedMatMul(rows, weight, row_idx, bias, _outputs=[f"{tag}_gmm"])
    gmm = op.Reshape(grouped, var(f"{tag}_unflat_shape"), _outputs=[f"{tag}_unflat"])
    lhs = op.Unsqueeze(inputs, var(f"{tag}_lhs_axes", True), _outputs=[f"{tag}_lhs_unsq"])
    return _selected_tail(op, lhs, tag, gmm)


def _combine(op, expert_out, weights, combine: str) -> Any:
    if combine == "reduce_sum":
        w3 = op.Unsqueeze(
            weights, var("combine_unsq_axes", True), _outputs=["routing_weights_unsq"]
        )
        weighted = pattern.OrValue([op.Mul(expert_out, w3), op.Mul(w3, expert_out)])
        return op.ReduceSum(weighted, var("combine_axes", True), _outputs=["layer_out"])
    row = op.Unsqueeze(weights, var("combine_unsq_axes", True), _outputs=["routing_weights_unsq"])
    mixed = op.MatMul(row, expert_out)
    if combine == "matmul_squeeze":
        return op.Squeeze(mixed, var("combine_axes", True), _outputs=["layer_out"])
    return op.Reshape(mixed, var("combine_shape"), _outputs=["layer_out"])


# -- the rules ---------------------------------------------------------------------------------


class _SlotMoELayerRule(MoELayerRule):
    """The per-slot layout: projections ``[*, k, N]``, combined over the k axis."""

    combines: ClassVar[tuple[str, ...]] = COMBINES

    def pattern(self, op, tokens):
        """The whole layer: routing, FC1, activation, FC2, combine."""
        weights, _ = routing_pattern(op)  # the projections bind the indices as variables
        act = self._activation(op, lambda tag: _fc_tokens(op, tokens, tag))
        expert_out = _fc_slots(op, act, "fc2")
        return _combine(op, expert_out, weights, self._combine_form)

    def _analyse(self, bindings: dict[str, Any], matched=None) -> LayerPlan:
        return analyse_layer(
            bindings,
            family=self.family,
            combine=self._combine_form,
            emit=self._emit,
            matched=matched,
        )


class GatedSwiGLUMoELayer(_SlotMoELayerRule):
    """SwiGLU from separate gate and up experts (Mixtral, Qwen): two FC1 projections."""

    family = "gated"


class FusedSwiGLUMoELayer(_SlotMoELayerRule):
    """SwiGLU from one FC1 cut into gate and linear operands (halves, strided slices, Split)."""

    family = "fused_gated"


class ElementwiseMoELayer(_SlotMoELayerRule):
    """One FC1 and an element-wise activation: Relu, tanh Gelu, SiLU, identity (Erf refused)."""

    family = "elementwise"


#: Every layer rule class: the per-slot ones, then the flattened-rows (batched_mm) ones.
RULE_CLASSES: tuple[type[MoELayerRule], ...] = (
    GatedSwiGLUMoELayer,
    FusedSwiGLUMoELayer,
    ElementwiseMoELayer,
    *BATCHED_RULE_CLASSES,
)


def moe_layer_rules(
    emit: Iterable[str] = FUSED_OPS, *, probe: bool = False, splice: bool = False
) -> list[pattern.RewriteRule]:
    """Every layer rule (each class x each of its combine spellings), emitting only ``emit``.

    ``probe`` and ``splice``: see :class:`._moe_rule.MoELayerRule`.
    """
    emit = frozenset(emit)
    return [
        cls.rule(combine=c, emit=emit, probe=probe, splice=splice)
        for cls in RULE_CLASSES
        for c in cls.combines
    ]


def moe_layer_rule_set(
    emit: Iterable[str] = FUSED_OPS, *, probe: bool = False, splice: bool = False
) -> pattern.RewriteRuleSet:
    """A rule set of :func:`moe_layer_rules`; it never sweeps dead code by itself."""
    rule_set = pattern.RewriteRuleSet(moe_layer_rules(emit, probe=probe, splice=splice))
    rule_set.remove_unused_nodes = False
    return rule_set


moe_layer_ruleset = moe_layer_rule_set()
