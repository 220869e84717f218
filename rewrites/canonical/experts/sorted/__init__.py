"""The grouped_mm form (token rows sorted by expert) -> per-slot ``GroupedMatMul``.

:mod:`.sorted_experts` (``CanonicalSortedExpertsPass``) rewrites a block :mod:`.proof` proved
from its :mod:`.segments` (histogram, offsets, per-expert MatMuls) and :mod:`.combine` (the
un-sort and the combine).
"""
