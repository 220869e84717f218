"""The canonicalisation passes in the order the pipeline runs them."""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.capacity.capacity_dispatch import (
    CanonicalCapacityDispatchPass,
)
from onnx_moe_fuse.rewrites.canonical.experts.dense.dense_experts import (
    CanonicalDenseExpertsPass,
)
from onnx_moe_fuse.rewrites.canonical.experts.loops.expert_loop import CanonicalExpertLoopPass
from onnx_moe_fuse.rewrites.canonical.experts.slots.canonical_slots import CanonicalSlotsPass
from onnx_moe_fuse.rewrites.canonical.experts.sorted.sorted_experts import (
    CanonicalSortedExpertsPass,
)
from onnx_moe_fuse.rewrites.canonical.shapes.fold_shapes import FoldShapesPass
from onnx_moe_fuse.rewrites.canonical.shapes.infer_missing_shapes import InferMissingShapesPass
from onnx_moe_fuse.rewrites.canonical.spellings.normalize_spellings import (
    NormalizeSpellingsPass,
)
from onnx_moe_fuse.rewrites.canonical.weights.fold_weight_layout import FoldWeightLayoutPass
from onnx_moe_fuse.rewrites.canonical.weights.nbits_weights import NBitsWeightsPass
from onnx_moe_fuse.rewrites.graph.refusals import Refusal

__all__ = ["canonicalisation_passes"]


def canonicalisation_passes(refusals: list[Refusal] | None = None) -> list[ir.passes.InPlacePass]:
    """Fresh instances of every canonicalisation pass, in pipeline order.

    Layer forms come last: they read the parts in the spellings the earlier passes produce.
    The layer-form passes record, into ``refusals`` when given, why they left a layer as it
    was (:mod:`onnx_moe_fuse.rewrites.graph.refusals`), while they run.
    """
    if refusals is None:
        refusals = []
    return [
        InferMissingShapesPass(),
        NBitsWeightsPass(),
        FoldShapesPass(),
        FoldWeightLayoutPass(),
        NormalizeSpellingsPass(),
        CanonicalSlotsPass(),
        CanonicalExpertLoopPass(refusals),
        CanonicalCapacityDispatchPass(refusals),
        CanonicalDenseExpertsPass(refusals),
        CanonicalSortedExpertsPass(refusals),
    ]
