"""A loop over all experts (optimum-onnx's MoE exports) -> per-slot GroupedMatMul.

:mod:`.expert_loop` (``CanonicalExpertLoopPass``) rewrites a proved loop; :mod:`.proof` proves it
computes the MoE layer of its routing TopK, from :mod:`.gathers` (each expert's rows and
weights), :mod:`.mlp` (each expert's MLP), :mod:`.steps` (the scatter-add accumulation) and
:mod:`.values` (the mask, NonZero coordinates, shapes).
"""
