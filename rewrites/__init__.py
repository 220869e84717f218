"""onnxscript rewriter rules, one rule family per module.

* :mod:`.moe_layer`: whole mixture-of-experts layers -> ``com.microsoft.MoE`` / ``QMoE``
  (``moe_layer_rules``, ``moe_layer_rule_set``, ``moe_layer_ruleset``), in the per-slot layout;
  its catalogue also holds :mod:`.moe_layer_batched`, the same family in the flattened-rows
  layout of torch.onnx ``batched_mm`` exports.

Private helpers: ``_moe_rule`` (the base rule and the routing/activation pattern pieces both
layouts share), ``_moe_analysis`` (the proofs behind the checks, and the steps both layouts
share), ``_moe_rows_analysis`` (the flattened-rows proofs), ``_moe_emit`` (weight repacking) and
``_graph_facts`` (constants, static ranks, symbolic shapes).
"""
