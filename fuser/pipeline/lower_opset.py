"""Lower the default-domain opset once fused: 29 -> 28 when no GroupedMatMul is left, and on down to the target's.

A version is skipped only when none of the ops it adds or changes is used by the model.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from onnx_moe_fuse.contract.targets import DEFAULT, Target
from onnx_moe_fuse.pipeline.remove_dead_code import (
    AfterFusionPass,
)
from onnx_moe_fuse.pipeline.report import (
    FusionReport,
)

#: Ops each default-domain opset adds or changes: the installed onnx's schemas by
#: ``since_version``, and opset 29, past onnx 1.23, which adds GroupedMatMul and changes nothing
#: else (read from onnx-weekly 1.24.0.dev20261026's schema list: the only schema with
#: since_version 29 is GroupedMatMul).
OPSET_CHANGES: dict[int, frozenset[str]] = {
    29: frozenset({"GroupedMatMul"}),
    **{
        version: frozenset(
            s.name
            for s in onnx.defs.get_all_schemas_with_history()
            if s.domain == "" and s.since_version == version
        )
        for version in range(2, onnx.defs.onnx_opset_version() + 1)
    },
}


def _uses_op(graph_like: ir.Graph | ir.Function, ops: frozenset[str]) -> bool:
    return any(
        n.domain in ("", "ai.onnx") and n.op_type in ops
        for n in ir.traversal.RecursiveGraphIterator(graph_like)
    )


class LowerOpsetPass(AfterFusionPass):
    """Lower the default-domain opset to the target's, past versions whose changes are unused.

    Opset 29 only adds ``GroupedMatMul`` (:data:`OPSET_CHANGES`); once fusion removed the last
    one, ``"" : 29`` means the same as ``"" : 28``, which ONNX Runtime 1.32 loads. The same holds
    for any version whose added or changed ops the model does not use, so the pass goes on down
    to the newest opset the target loads (:attr:`onnx_moe_fuse.contract.targets.Target.max_opset`:
    onnxruntime-webgpu 1.27 stops at 26) and stops at the first version whose changes the model
    uses. With a ``report``, only when it records a fusion.
    """

    def __init__(self, report: FusionReport | None = None, target: Target = DEFAULT):
        """``report``: act only if it holds a fusion (None: always); ``target``: its opset."""
        super().__init__(report)
        self.floor = target.max_opset

    def clean(self, model: ir.Model) -> ir.passes.PassResult:
        """Lower while above the target's opset and the newest version's changes are unused."""
        modified = False
        while True:
            version = model.opset_imports.get("")
            changes = OPSET_CHANGES.get(version) if version is not None else None
            if changes is None or version <= self.floor:
                break
            if _uses_op(model.graph, changes) or any(
                _uses_op(f, changes) for f in model.functions.values()
            ):
                break
            model.opset_imports[""] = version - 1
            model.graph.opset_imports[""] = version - 1
            for f in model.functions.values():
                if f.opset_imports.get("") == version:
                    f.opset_imports[""] = version - 1
            modified = True
        return ir.passes.PassResult(model, modified=modified)
