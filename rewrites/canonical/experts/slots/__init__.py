"""Per-slot layouts: the spellings of the per-slot token operand, into the one the layer rules take.

:mod:`.canonical_slots` (``CanonicalSlotsPass``) runs :mod:`.rows` (repeated token rows ->
per-slot projections) and :mod:`.unsqueeze` (slot-axis Unsqueeze/Expand spellings);
:mod:`.grouped_rows` rewrites the GroupedMatMul function body (as onnx inlines it), run by
``FoldShapesPass`` once the body's shapes are folded.
"""
