"""Clean-up after a fusion: drop what the fused layers left dead (only when something fused)."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnx_moe_fuse.pipeline.report import (
    FusionReport,
)


def _fused(report: FusionReport | None) -> bool:
    return report is None or bool(report.fusions)


class AfterFusionPass(ir.passes.InPlacePass):
    """A clean-up pass that, given a ``report``, acts only when the report records a fusion."""

    def __init__(self, report: FusionReport | None = None):
        """``report``: act only if it holds a fusion (None: always act)."""
        super().__init__()
        self.report = report

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Leave an unfused model as it was; otherwise :meth:`clean`."""
        if not _fused(self.report):
            return ir.passes.PassResult(model, modified=False)
        return self.clean(model)

    def clean(self, model: ir.Model) -> ir.passes.PassResult:
        """The pass's work on a fused model."""
        raise NotImplementedError


class RemoveDeadCodePass(AfterFusionPass):
    """Remove dead nodes and unused initializers (onnx-ir's ``RemoveUnusedNodesPass``).

    With a ``report``, only when it records a fusion: an unfused model stays as it was, dead code
    it already had included.
    """

    def clean(self, model: ir.Model) -> ir.passes.PassResult:
        """Sweep."""
        return RemoveUnusedNodesPass()(model)
