"""The canonicalisation passes in the order the pipeline runs them."""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.dense.dense_experts import (
    CanonicalDenseExpertsPass,
)
from onnx_moe_fuse.rewrites.canonical.experts.loops.expert_loop import CanonicalExpertLoopPass
from onnx_moe_fuse.rewrites.canonical.experts.slots.canonical_slots import CanonicalSlotsPass
from onnx_moe_fuse.rewrites.canonical.experts.sorted.sorted_experts import (
    CanonicalSortedExpertsPass,
)
from onnx_moe_fuse.rewrites.canonical.shapes.fold_shapes import FoldShapesPass
from onnx_moe_fuse.rewrites.canonical.spellings.normalize_spellings import (
    NormalizeSpellingsPass,
)
from onnx_moe_fuse.rewrites.canonical.weights.fold_weight_layout import FoldWeightLayoutPass

__all__ = ["canonicalisation_passes"]


def canonicalisation_passes() -> list[ir.passes.InPlacePass]:
    """Fresh instances of every canonicalisation pass, in pipeline order.

    Layer forms come last: they read the parts in the spellings the earlier passes produce.
    """
    return [
        FoldShapesPass(),
        FoldWeightLayoutPass(),
        NormalizeSpellingsPass(),
        CanonicalSlotsPass(),
        CanonicalExpertLoopPass(),
        CanonicalDenseExpertsPass(),
        CanonicalSortedExpertsPass(),
    ]
