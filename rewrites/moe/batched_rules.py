"""MoE layer rules anchored at the flattened-rows combine of torch.onnx ``batched_mm`` exports.

transformers' MoE experts with ``experts_implementation="batched_mm"``, exported by torch.onnx
(dynamo), run each (token, slot) pair as one of ``R = T*k`` flattened rows (see
``docs/exported-models.md``) and combine them as::

    ReduceSum(Reshape(Mul(fc2_rows, Unsqueeze(Reshape(w, [-1]), -1)), [-1, k, H]), [1])

The rules here anchor at that combine (:mod:`.parts.combine`, form ``reshape_reduce_sum``) and
recognise the rest part by part like the per-slot rules of :mod:`.layer_rules`, which list them in
their catalogue: FC2 and FC1 as GatherND + MatMul projections of rows
(:mod:`.parts.projections`), the token rows ``Reshape(Expand|Tile(Unsqueeze(x)))`` (no repeat
for k = 1), any activation. ``check`` proves the meaning with
:func:`~.rows_analysis.analyse_rows_layer` (every Reshape target, Unsqueeze/Squeeze axis,
the repeat count k, each projection's ids chain from the TopK indices, GatherND
``batch_dims=0``, the weight layout given by the MatMul operand order, then the shared routing,
weight, activation and target steps).
"""

from __future__ import annotations

from typing import ClassVar

from onnx_moe_fuse.rewrites.moe.rule_base import MoELayerRule

__all__ = [
    "BATCHED_COMBINES",
    "BATCHED_RULE_CLASSES",
    "BatchedElementwiseMoELayer",
    "BatchedFusedSwiGLUMoELayer",
    "BatchedGatedSwiGLUMoELayer",
]

#: The combine form of the flattened-rows layout (weighted rows -> [T, k, H] -> sum).
BATCHED_COMBINES = ("reshape_reduce_sum",)


class _BatchedMoELayerRule(MoELayerRule):
    """Anchored at the flattened-rows combine (weighted ``[T*k, H]`` rows summed per token)."""

    combines: ClassVar[tuple[str, ...]] = BATCHED_COMBINES


class BatchedGatedSwiGLUMoELayer(_BatchedMoELayerRule):
    """SwiGLU from separate gate and up experts, each a GatherND/MatMul projection of the rows."""

    family = "gated"


class BatchedFusedSwiGLUMoELayer(_BatchedMoELayerRule):
    """SwiGLU from one ``gate_up`` projection cut by ``Split`` (halves) or step-2 ``Slice``."""

    family = "fused_gated"


class BatchedElementwiseMoELayer(_BatchedMoELayerRule):
    """One ``up`` projection and an element-wise activation (transformers' ``has_gate=False``)."""

    family = "elementwise"


BATCHED_RULE_CLASSES: tuple[type[MoELayerRule], ...] = (
    BatchedGatedSwiGLUMoELayer,
    BatchedFusedSwiGLUMoELayer,
    BatchedElementwiseMoELayer,
)
