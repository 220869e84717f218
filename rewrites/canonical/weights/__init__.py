"""Canonicalisation of weights: layout ops folded into constant expert weights.

:mod:`.fold_weight_layout` (``FoldWeightLayoutPass``) folds Transpose/Reshape/... chains between
constant weights and their users; :mod:`.dq_push` moves a layout op from a ``DequantizeLinear``'s
output onto its constant inputs; :mod:`.layout_ops` says what each layout op does to one tensor.
"""
