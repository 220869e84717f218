"""A proved dense layer: the parts :mod:`.dense_experts` proved and :mod:`.emit` rewrites."""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.dense.combine import Combine
from onnx_moe_fuse.rewrites.canonical.experts.dense.ffn import ExpertMLP
from onnx_moe_fuse.rewrites.canonical.experts.dense.mask import DenseWeights
from onnx_moe_fuse.rewrites.canonical.experts.dense.prescaled import Prescale
from onnx_moe_fuse.rewrites.canonical.experts.dense.routing import Routing

__all__ = ["DenseLayer"]


class DenseLayer:
    """A proved dense layer: its routing, mask, combine and expert MLPs."""

    def __init__(
        self,
        routing: Routing,
        mask: DenseWeights,
        combine: Combine,
        mlps: list[ExpertMLP],
        prescale: Prescale | None = None,
    ) -> None:
        """Hold the proved parts; ``mlps`` is one per expert, or one stacked MLP.

        ``prescale``: the router scores scale the experts' input (Llama4, :mod:`.prescaled`).
        """
        self.routing, self.mask, self.combine, self.mlps = routing, mask, combine, mlps
        self.prescale = prescale

    @property
    def stacked(self) -> bool:
        """True when the experts are one MLP over stacked ``[E, K, N]`` weights."""
        return self.combine.stacked is not None

    def nodes(self) -> list[ir.Node]:
        """Every node the rewrite replaces (mask, combine, expert MLPs)."""
        out = [*self.mask.nodes, *self.combine.nodes]
        for mlp in self.mlps:
            out += mlp.nodes
        return list(dict.fromkeys(out))
