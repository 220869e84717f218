"""MoE layer rules: a mixture-of-experts layer in standard ONNX -> ``com.microsoft.MoE``/``QMoE``.

Each rule anchors at a small pattern, the combine that ends a layer weighted by the values of a
routing TopK, and recognises the rest part by part (:mod:`.parts`): routing (``TopK`` values
renormalised, softmaxed over k, or as they are), FC2 from what the combine reads, the activation
from FC2's input, FC1 (+ the up projection) from the activation's operands. Part spellings
compose: any known FC1 x activation x FC2 x combine spelling is one layer, in either layout:

* per slot (this module's combines): projections ``[*, k, N]``, ``GroupedMatMul`` (opset 29)
  or ``Gather(weights, indices)`` + ``Unsqueeze`` (+ ``Expand``) + ``MatMul`` + ``Squeeze`` /
  ``Reshape``, biases as GroupedMatMul's 4th input or ``Gather(bias, indices)`` + ``Add``;
  combined by ``ReduceSum(Mul(expert_out, Unsqueeze(weights, -1)), k axis)`` or ``MatMul`` of
  the weights as a row vector (then ``Squeeze`` or ``Reshape``); FC2 may also be flattened
  ``[T*k, H]`` rows un-flattened by a ``Reshape`` (:mod:`.batched_rules` for the rows'
  own combine);
* activation: SwiGLU of separate gate and up experts (:class:`GatedSwiGLUMoELayer`) or of one
  FC1 cut by ``Slice``/``Split`` (:class:`FusedSwiGLUMoELayer`), with optional ``Clip`` limits,
  alpha and beta; Relu, tanh Gelu, SiLU, identity, and the exact-GELU spellings it must refuse
  (:class:`ElementwiseMoELayer`). A rule recognises every family and fuses its own.

``check`` proves the meaning with :func:`~.analysis.analyse_layer` or
:func:`~.rows_analysis.analyse_rows_layer` (axes, ``k``, Reshape targets, constants, the
same TopK indices everywhere, dtypes, zero points, clamp limits, the routing form, the router
reading the experts' token rows, escapes) and returns a failed ``MatchResult`` whose reason
names the part (``"fc2: ..."``) otherwise. ``rewrite`` (:class:`.rule_base.MoELayerRule`)
recognises and proves again (nothing is kept on the rule), repacks the weights
(:mod:`.emit`) and emits one node with every attribute written and its inputs at ORT's
positions. The rest of the layer is left dead for a dead-code pass (``onnx_moe_fuse.pipeline``;
a rule set used alone sweeps it itself).

Exports: the rule classes, :func:`moe_layer_rules`, :func:`moe_layer_rule_set` and the default
:data:`moe_layer_ruleset` (every target op, both layouts).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from onnxscript.rewriter import pattern

from onnx_moe_fuse.contract.targets import DEFAULT, Target
from onnx_moe_fuse.rewrites.graph.weight_sink import WeightSink
from onnx_moe_fuse.rewrites.moe.batched_rules import BATCHED_RULE_CLASSES
from onnx_moe_fuse.rewrites.moe.parts.combine import SLOT_COMBINES
from onnx_moe_fuse.rewrites.moe.quantize import Quantization
from onnx_moe_fuse.rewrites.moe.rule_base import FUSED_OPS, REPLACED_KEY, MoELayerRule

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

#: The combine forms of the per-slot layout; one rule instance each.
COMBINES = SLOT_COMBINES


class _SlotMoELayerRule(MoELayerRule):
    """Anchored at a slot combine (``[*, k, H]`` expert outputs summed over the k axis)."""

    combines: ClassVar[tuple[str, ...]] = COMBINES


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
    emit: Iterable[str] = FUSED_OPS,
    *,
    probe: bool = False,
    splice: bool = False,
    weight_sink: WeightSink | None = None,
    target: Target | str = DEFAULT,
    quantize: Quantization | None = None,
) -> list[pattern.RewriteRule]:
    """Every layer rule (each class x each of its combine forms), emitting only ``emit``.

    ``probe``, ``splice``, ``weight_sink``, ``target`` and ``quantize``: see
    :class:`.rule_base.MoELayerRule`.
    """
    emit = frozenset(emit)
    return [
        cls.rule(
            combine=c,
            emit=emit,
            probe=probe,
            splice=splice,
            weight_sink=weight_sink,
            target=target,
            quantize=quantize,
        )
        for cls in RULE_CLASSES
        for c in cls.combines
    ]


def moe_layer_rule_set(
    emit: Iterable[str] = FUSED_OPS,
    *,
    probe: bool = False,
    splice: bool = False,
    weight_sink: WeightSink | None = None,
    target: Target | str = DEFAULT,
    quantize: Quantization | None = None,
) -> pattern.RewriteRuleSet:
    """A rule set of :func:`moe_layer_rules`.

    Used alone it sweeps what a fused layer leaves dead; a ``splice`` set (the pipeline's) never
    does, the pipeline sweeps the original graph after splicing.
    """
    rules = moe_layer_rules(
        emit, probe=probe, splice=splice, weight_sink=weight_sink, target=target, quantize=quantize
    )
    rule_set = pattern.RewriteRuleSet(rules)
    rule_set.remove_unused_nodes = not splice
    return rule_set


moe_layer_ruleset = moe_layer_rule_set()
