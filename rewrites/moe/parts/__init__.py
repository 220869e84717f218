"""Per-part recognition of mixture-of-experts layers: small patterns, typed facts, one failure.

A layer is recognised from the node its combine ends in, one part at a time, each from the value the
previous part hands over: :mod:`.combine` (the weighted sum over the k slots), :mod:`.routing` (the
weights back to the TopK), :mod:`.projections` (FC2 from what the combine reads, FC1 from the
activation's operands, the token rows of flattened layouts), :mod:`.activation` (what FC2 reads,
back to FC1). Each recogniser matches a few small onnxscript patterns at one node
(:mod:`onnx_moe_fuse.rewrites.graph.match`) and returns a frozen fact (:mod:`.facts`) or raises a
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` naming the part, the node and the reason;
:mod:`.layer` composes them into a :class:`~.facts.LayerParts`. The layer proofs (:mod:`..analysis`)
prove what the facts mean; the rules (:mod:`..rule_base`) anchor at the combine and call both.
"""
