"""The MoE family: mixture-of-experts layers in standard ONNX -> ``com.microsoft.MoE`` / ``QMoE``.

* rules: :mod:`.layer_rules` (the catalogue, anchored at the per-slot combines) and
  :mod:`.batched_rules` (anchored at the flattened-rows combine of torch.onnx ``batched_mm``
  exports), both on :mod:`.rule_base` (small combine pattern, part recognisers, proofs, emission);
* recognition part by part: :mod:`.parts` (combine, routing, projections, activation);
* proofs from the recognised parts to a :class:`~.plan.LayerPlan`: :mod:`.analysis` with
  :mod:`.routing_proof`, :mod:`.weights_proof`, :mod:`.activation_proof`, and
  :mod:`.rows_analysis` for the flattened-rows layout;
* :mod:`.emit`: the proved expert weights repacked into the fused node's inputs;
* :mod:`.routers` (with :mod:`.router_walks`): which router a TopK belongs to, in plain words.
"""
