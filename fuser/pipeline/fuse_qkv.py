"""The attention-prelude pass: RMSNorm + three 4-bit projections -> ``com.microsoft.MatMulNBitsQkv``.

Runs the rules of :mod:`onnx_moe_fuse.rewrites.qkv.rule` (only for a target with the
op), applies the target's attributes, and restores the names and types the rules' matching
touched on models where nothing fused (so those stay byte-identical).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import onnx_ir as ir

from onnx_moe_fuse.contract.targets import DEFAULT, Target
from onnx_moe_fuse.pipeline.common import (
    fused_nodes,
    label,
    rule_name,
)
from onnx_moe_fuse.pipeline.fuse_moe_layers import (
    apply_target_attributes,
    emitted,
    shared_tensor_names,
)
from onnx_moe_fuse.pipeline.report import (
    FusionReport,
    report_fusions,
)
from onnx_moe_fuse.rewrites.graph.refusals import NearMiss
from onnx_moe_fuse.rewrites.graph.weight_sink import WeightSink
from onnx_moe_fuse.rewrites.moe.layer_rules import (
    REPLACED_KEY,
)
from onnx_moe_fuse.rewrites.qkv import rule as qkv


class FuseQkvPass(ir.passes.InPlacePass):
    """Rewrite RMSNorm + three 4-bit projections into ``com.microsoft.MatMulNBitsQkv``.

    Runs when ``only`` (default: every op) names MatMulNBitsQkv. Near misses come from the
    rule module's own dry run (:func:`onnx_moe_fuse.rewrites.qkv.rule.near_misses`),
    which also sees norms read by other than three projections. When ``target`` has no
    MatMulNBitsQkv kernel (ORT CPU and CUDA), the model is left as it is and every prelude that
    would have fused is a near miss of part ``target`` saying so (found by fusing a clone).
    """

    def __init__(
        self,
        report: FusionReport | None = None,
        only: Iterable[str] | None = None,
        target: Target = DEFAULT,
        weight_sink: WeightSink | None = None,
    ):
        """Set up the pass; ``report`` receives what it did, ``weight_sink`` the weights."""
        super().__init__()
        self.weight_sink = weight_sink
        self.enabled = qkv.FUSED_OP in emitted(only)
        self.target = target
        self.report = report if report is not None else FusionReport()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Dry-run for near misses, then rewrite; fill the report."""
        if not self.enabled:
            return ir.passes.PassResult(model, modified=False)
        # the rule runs name values and type constants they read; that is put back, so that
        # what does not fuse stays as it was
        names, untyped = _names(model.graph), _untyped(model.graph)
        misses = qkv.near_misses(model)
        reason = self.target.refusal(qkv.FUSED_OP, None)
        count = 0
        if reason is None:
            count = qkv.rules(self.weight_sink).apply_to_model(model)
            _restore_names(names)
            _restore_untyped(untyped)
            for node in fused_nodes(model.graph):
                if node.op_type == qkv.FUSED_OP:
                    apply_target_attributes(node, self.target)
            report_fusions(model.graph, self.report)
        else:
            _restore_names(names)
            _restore_untyped(untyped)
            self._refuse_for_target(model, reason)
        for miss in misses:
            self.report.add_near_miss(miss)
        return ir.passes.PassResult(model, modified=count > 0)

    def _refuse_for_target(self, model: ir.Model, reason: str) -> None:
        """A near miss for every prelude that would fuse; ``model`` is not changed."""
        tensor_names = shared_tensor_names(model.graph)
        work = model.clone()
        qkv.rules(self.weight_sink).apply_to_model(work)  # spilled, not kept: memory stays flat
        for node in fused_nodes(work.graph):
            if node.op_type != qkv.FUSED_OP:
                continue
            replaced = json.loads(node.metadata_props[REPLACED_KEY])
            self.report.add_near_miss(
                NearMiss(
                    rule=rule_name(node),
                    part="target",
                    node=replaced[0] if replaced else label(node),
                    reason=reason,
                    root=replaced[0] if replaced else label(node),
                    topk=None,
                    router=None,
                    values=tuple(replaced),
                )
            )
        for tensor, name in tensor_names:
            if tensor.name != name:
                tensor.name = name


def _names(graph: ir.Graph) -> list[tuple[ir.Node | ir.Value, str | None]]:
    names: list[tuple[ir.Node | ir.Value, str | None]] = []
    for node in graph:
        names.append((node, node.name))
        names.extend((v, v.name) for v in node.outputs)
    names.extend((v, v.name) for v in graph.inputs)
    return names


def _restore_names(names: list[tuple[ir.Node | ir.Value, str | None]]) -> None:
    for item, name in names:
        if isinstance(item, ir.Node):
            if item.graph is not None and item.name != name:
                item.name = name
        elif item.name != name and (item.producer() is None or item.producer().graph is not None):
            item.name = name


def _untyped(graph: ir.Graph) -> list[tuple[ir.Value, bool, bool]]:
    """Every node output with no type or no shape: ``(value, lacks type, lacks shape)``."""
    return [
        (v, v.type is None, v.shape is None)
        for node in graph
        for v in node.outputs
        if v.type is None or v.shape is None
    ]


def _restore_untyped(untyped: list[tuple[ir.Value, bool, bool]]) -> None:
    """Take back the types and shapes a rule run gave values (onnx-ir's constant readers do)."""
    for value, no_type, no_shape in untyped:
        if no_type:
            value.type = None
        if no_shape:
            value.shape = None
