"""onnxscript rewriter rules, one rule family per module.

* :mod:`.moe_layer`: mixture-of-experts layers -> ``com.microsoft.MoE`` / ``QMoE``
  (``moe_layer_rules``, ``moe_layer_rule_set``, ``moe_layer_ruleset``), anchored at the slot
  combines; its catalogue also holds :mod:`.moe_layer_batched`, the same family anchored at the
  flattened-rows combine of torch.onnx ``batched_mm`` exports.

:mod:`.parts` recognises a layer part by part (small patterns, typed facts, one failure type).
Private helpers: ``_moe_rule`` (the base rule: combine anchor, recognition, proof, emission),
``_moe_analysis`` (the proofs behind the checks, and the steps both layouts share),
``_moe_rows_analysis`` (the flattened-rows proofs), ``_moe_emit`` (weight repacking) and
``_graph_facts`` (constants, static ranks, symbolic shapes).

Memory (docs/architecture.md, "Memory"): :mod:`.weight_sink` is the type of the sink the rules
hand their repacked weights to (default: in memory), :mod:`.tensor_reads` reads a constant's
numbers without leaving external data mapped.
"""
