"""Canonicalisation of expert forms: every way of computing the experts, into per-slot projections.

One subpackage per form: :mod:`.slots` (per-slot token operands, repeated rows, the
GroupedMatMul body), :mod:`.loops` (a loop over all experts), :mod:`.dense` (every expert on
every token, masked), :mod:`.sorted` (grouped_mm: rows sorted by expert). The value-level proofs
the loop and sorted forms share are :mod:`.value_proofs`; the row-wise activation proof
:mod:`.rowwise`.
"""
