"""Postconditions of a fused model: no internal op survives, every fused node is an op the target has, with its attribute set."""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.contract.ops import MS_DOMAIN
from onnx_moe_fuse.contract.targets import DEFAULT, Target
from onnx_moe_fuse.pipeline.common import (
    ALL_FUSED_OPS,
    INTERNAL_DOMAIN,
    label,
    rule_name,
)
from onnx_moe_fuse.rewrites.moe.layer_rules import (
    REPLACED_KEY,
)

#: Attributes every emitted node writes for the default target (ORT's defaults differ between
#: builds); :meth:`onnx_moe_fuse.contract.targets.Target.attribute_names` gives them per target.
REQUIRED_ATTRIBUTES: dict[str, frozenset[str]] = {
    op: DEFAULT.attribute_names(op) for op in DEFAULT.ops
}


class FusedNodesCheckPass(ir.passes.InPlacePass):
    """Postconditions only: no internal (private-domain) op survives, fused nodes are complete.

    A fused node must be an op ``target`` has a kernel for and carry exactly the attribute set
    the target takes (:meth:`onnx_moe_fuse.contract.targets.Target.attribute_names`).
    """

    def __init__(self, target: Target = DEFAULT):
        """``target``: the runtime the fused nodes were written for."""
        super().__init__()
        self.target = target

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Change nothing."""
        return ir.passes.PassResult(model, modified=False)

    def ensures(self, model: ir.Model) -> None:
        """Raise ``PostconditionError`` on an internal op or a fused node the target cannot run."""
        graphs: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
        for g in graphs:
            for node in ir.traversal.RecursiveGraphIterator(g):
                if node.domain.startswith(INTERNAL_DOMAIN):
                    raise ir.passes.PostconditionError(
                        f"internal op {node.domain}.{node.op_type} survived fusion ({label(node)})"
                    )
                if node.domain == MS_DOMAIN and REPLACED_KEY in node.metadata_props:
                    raise ir.passes.PostconditionError(
                        f"fused node {label(node)} still carries the {REPLACED_KEY} marker"
                    )
                if node.domain != MS_DOMAIN or node.op_type not in ALL_FUSED_OPS:
                    continue
                if not rule_name(node):
                    continue  # a node the model already had
                if node.op_type not in self.target.ops:
                    raise ir.passes.PostconditionError(
                        f"fused {node.op_type} {label(node)} was emitted for {self.target}, "
                        "which has no kernel for it"
                    )
                expected = self.target.attribute_names(node.op_type)
                if set(node.attributes) != expected:
                    raise ir.passes.PostconditionError(
                        f"fused {node.op_type} {label(node)} carries attributes "
                        f"{sorted(node.attributes)}, but {self.target} takes {sorted(expected)}"
                    )
