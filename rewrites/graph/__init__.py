"""Graph helpers every rule family and canonicalisation pass shares; they import nothing else of ours.

* :mod:`.facts`: small facts about onnx-ir values and nodes (constants, ranks, attributes, labels);
* :mod:`.dims` and :mod:`.symbolic_dims`: symbolic dimensions, the dims of values and what shape
  tensors hold, as the graph fixes them;
* :mod:`.match`: one small onnxscript pattern matched at a given node (the one home of a use of
  onnxscript's private matcher API);
* :mod:`.refusals`: the one refusal type (:class:`~.refusals.Refusal`, a ``MatchFailureError``
  naming part, node, value and reason), its ``part()`` tag, and the one near-miss record
  (:class:`~.refusals.NearMiss`) the report serialises;
* :mod:`.tensor_reads`: a constant's numbers read without keeping external data mapped;
* :mod:`.weight_sink`: the type of the sink rules hand repacked weights to;
* :mod:`.fresh_names` and :mod:`.edits`: fresh names and small edits for passes that rewrite.
"""
