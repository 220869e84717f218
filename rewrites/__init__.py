"""onnxscript rewriter rules, one rule family per module.

* :mod:`.moe_layer`: whole mixture-of-experts layers -> ``com.microsoft.MoE`` / ``QMoE``
  (``moe_layer_rules``, ``moe_layer_rule_set``, ``moe_layer_ruleset``).

Private helpers: ``_moe_analysis`` (the proofs behind the checks), ``_moe_emit`` (weight
repacking) and ``_graph_facts`` (constants, static ranks, symbolic shapes).
"""
