"""onnxscript rewriter rules and the canonicalisation that feeds them, one folder per concern.

* :mod:`.graph`: what every rule and pass shares (graph facts, symbolic dims, one matcher, the
  one refusal type and near-miss record, tensor reads, the weight-sink type);
* :mod:`.moe`: mixture-of-experts layers -> ``com.microsoft.MoE`` / ``QMoE`` (rules, per-part
  recognisers in :mod:`.moe.parts`, proofs, emission, routers);
* :mod:`.qkv`: RMS norm + three 4-bit projections -> ``com.microsoft.MatMulNBitsQkv``;
* :mod:`.canonical`: the canonicalisation passes (shapes, weights, op spellings, expert forms),
  run on a working copy so that the rules see one spelling of every part.

The rules import the op contract (:mod:`onnx_moe_fuse.contract`) and :mod:`.graph` only, never
the fuser or the kernels (``tests/test_import_layers.py``). Memory (``docs/architecture.md``):
rules hand repacked weights to a :mod:`.graph.weight_sink` and read constants through
:mod:`.graph.tensor_reads`, so no layer's weights stay in memory.
"""
