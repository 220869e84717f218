"""Canonicalisation of shapes: shape arithmetic folded, so that the layer proofs read constants.

:mod:`.fold_shapes` (``FoldShapesPass``) evaluates shape computations on static and symbolic
dims (``rewrites/graph/symbolic_dims.py``) and makes provable ones constant.
"""
