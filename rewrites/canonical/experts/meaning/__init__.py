"""MoE layers recognised by what they compute: the analysis of meaning and its pass.

:mod:`.terms` (what a value holds), :mod:`.layout` / :mod:`.arith` / :mod:`.indexing` (what each
op does to that), :mod:`.interpret` (the walk around one TopK), :mod:`.contract` (the fused op's
expression), :mod:`.emit` (the per-slot form), :mod:`.meaning_pass` (the pass).
"""
