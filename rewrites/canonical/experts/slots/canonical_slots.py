"""Canonical slot layout: the spellings of the per-slot token operand the layer rules take.

:class:`CanonicalSlotsPass` runs after ``NormalizeSpellingsPass`` (whose Einsum lowering writes
``Unsqueeze(Expand(Unsqueeze(x, [1]), [1, k, 1]), [2])`` for ``"tkh,tkhi->tki"``) and before the
dense and sorted layer forms. It rewrites chains of ``Unsqueeze`` over ``Expand``/``Unsqueeze``
into the one ``Expand?(Unsqueeze(tokens, slot and row axes), shape)`` the per-slot rules match
(:mod:`.unsqueeze`, exact), after rewriting hand-decomposed repeated token rows
(``Reshape(Expand(Unsqueeze(x)), [-1, 1, H])`` rows, ``Gather(W, Reshape(ids, [-1]))``) into
per-slot projections (:mod:`.rows`, exact). The main graph only: the layer rules do not
look into subgraphs.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.slots.rows import rewrite_repeated_rows
from onnx_moe_fuse.rewrites.canonical.experts.slots.unsqueeze import rewrite_unsqueeze_chains

__all__ = ["CanonicalSlotsPass"]


class CanonicalSlotsPass(ir.passes.InPlacePass):
    """Bring repeated rows and the per-slot token operand into the per-slot rules' form."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Rewrite repeated-rows layers, then Unsqueeze-of-Expand/Unsqueeze chains (main graph)."""
        modified = rewrite_repeated_rows(model.graph)
        modified |= rewrite_unsqueeze_chains(model.graph)
        return ir.passes.PassResult(model, modified)
