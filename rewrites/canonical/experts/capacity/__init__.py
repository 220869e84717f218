"""DeepSpeed's top-2 capacity dispatch (no drop) -> the dense all-experts form.

:mod:`.capacity_dispatch` (``CanonicalCapacityDispatchPass``) proves the gate (:mod:`.gate`)
and the dispatch, experts and combine (:mod:`.dispatch`), with the readers of :mod:`.reads`.
"""
