"""Whole-layer rules for the flattened-rows layout of torch.onnx ``batched_mm`` exports.

transformers' MoE experts with ``experts_implementation="batched_mm"``, exported by torch.onnx
(dynamo), run each (token, slot) pair as one of ``R = T*k`` flattened rows (see
``docs/exported-models.md``). The rules here match such a layer whole and emit the same
``com.microsoft.MoE`` / ``QMoE`` node as the per-slot rules of :mod:`.moe_layer`, which list them
in their catalogue. Pattern (``|`` alternatives, ``?`` optional)::

    routing   w, idx = routing_pattern(TopK(scores, k))            shared with the per-slot rules
    ids       Unsqueeze(Reshape(idx, s), a)                        [R, 1], one for every GatherND
    rows      Reshape(Expand(Unsqueeze(x, a), s) | Tile(Unsqueeze(x, a), reps), s)     [R, H]
    fc(a)     drop(MatMul(GatherND(W, ids), Unsqueeze(a, ax))      W [E, N, K] ("nk")
                 | MatMul(Unsqueeze(a, ax), GatherND(W, ids)))     W [E, K, N] ("kn")
              drop = Squeeze(_, axes) | Reshape(_, shape)
              + Add(_, GatherND(b, ids))?  (either order), then Squeeze(Unsqueeze(_, a), a)?
    act       activation_pattern(family, fc1 = fc(rows))           shared with the per-slot rules
    combine   ReduceSum(Reshape(Mul(fc2(act), Unsqueeze(Reshape(w, s), a)), s), axes)
              (either Mul order)

``check`` proves the meaning with :func:`~._moe_rows_analysis.analyse_rows_layer`: every Reshape
target, Unsqueeze/Squeeze axis, the repeat count k, GatherND ``batch_dims=0``, the weight layout
given by the MatMul operand order, and then, shared with the per-slot rules, the routing form,
constant (or symmetric DequantizeLinear) weights, biases, the activation and the target op.
"""

from __future__ import annotations

from typing import Any, ClassVar

from onnxscript.rewriter import pattern

from ._moe_analysis import LayerPlan
from ._moe_rows_analysis import analyse_rows_layer
from ._moe_rule import MoELayerRule, routing_pattern, var

__all__ = [
    "BATCHED_COMBINES",
    "BATCHED_RULE_CLASSES",
    "BatchedElementwiseMoELayer",
    "BatchedFusedSwiGLUMoELayer",
    "BatchedGatedSwiGLUMoELayer",
]

#: The combine spelling of the flattened-rows layout (weighted rows -> [T, k, H] -> sum).
BATCHED_COMBINES = ("reshape_reduce_sum",)


def _fc_rows(op, lhs, ids, tag: str) -> Any:
    """A projection of rows ``[R, K]`` by each row's expert -> ``[R, N]`` (bound ``{tag}_out``)."""
    selected = op.GatherND(var(f"{tag}_weight"), ids, _outputs=[f"{tag}_gather"])
    unsq = op.Unsqueeze(lhs, var(f"{tag}_lhs_axes", True), _outputs=[f"{tag}_lhs_unsq"])
    mm = pattern.OrValue(
        [op.MatMul(selected, unsq), op.MatMul(unsq, selected)],
        tag_var=f"{tag}_layout",
        tag_values=["nk", "kn"],
    )
    drop = pattern.OrValue(
        [op.Squeeze(mm, var(f"{tag}_drop_axes", True)), op.Reshape(mm, var(f"{tag}_drop_shape"))],
        name=f"{tag}_drop",
    )
    bias_sel = op.GatherND(var(f"{tag}_bias"), ids, _outputs=[f"{tag}_bias_gather"])
    biased = pattern.OrValue([op.Add(drop, bias_sel), op.Add(bias_sel, drop), drop])
    # torch's in-place bias add leaves a no-op Unsqueeze/Squeeze pair behind (gpt-oss)
    noop_unsq = op.Unsqueeze(biased, var(f"{tag}_noop_axes", True), _outputs=[f"{tag}_noop_unsq"])
    noop = op.Squeeze(noop_unsq, var(f"{tag}_noop_sq_axes", True), _outputs=[f"{tag}_noop"])
    return pattern.OrValue([noop, biased], name=f"{tag}_out")


class _BatchedMoELayerRule(MoELayerRule):
    """The flattened-rows layout: projections on ``[T*k, N]`` rows, summed per token."""

    combines: ClassVar[tuple[str, ...]] = BATCHED_COMBINES

    def pattern(self, op, tokens):
        """The whole layer: routing, token rows and expert ids, FC1, activation, FC2, combine."""
        weights, indices = routing_pattern(op)
        flat_ids = op.Reshape(indices, var("ids_flat_shape"), _outputs=["expert_ids_flat"])
        ids = op.Unsqueeze(flat_ids, var("ids_axes", True), _outputs=["expert_ids"])
        unsq = op.Unsqueeze(tokens, var("repeat_axes", True), _outputs=["token_repeat_unsq"])
        repeated = pattern.OrValue(
            [op.Expand(unsq, var("repeat_shape")), op.Tile(unsq, var("repeat_reps"))],
            name="token_repeat",
        )
        rows = op.Reshape(repeated, var("rows_shape"), _outputs=["token_rows"])
        act = self._activation(op, lambda tag: _fc_rows(op, rows, ids, tag))
        expert_out = _fc_rows(op, act, ids, "fc2")
        flat_w = op.Reshape(weights, var("weights_flat_shape"), _outputs=["weights_flat"])
        col_w = op.Unsqueeze(flat_w, var("weights_col_axes", True), _outputs=["weights_col"])
        weighted = pattern.OrValue([op.Mul(expert_out, col_w), op.Mul(col_w, expert_out)])
        slots = op.Reshape(weighted, var("combine_shape"), _outputs=["combine_unflat"])
        return op.ReduceSum(slots, var("combine_axes", True), _outputs=["layer_out"])

    def _analyse(self, bindings: dict[str, Any], matched=None) -> LayerPlan:
        return analyse_rows_layer(bindings, family=self.family, emit=self._emit, matched=matched)


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
