"""Generated MoE layer spellings: hypothesis strategies, ONNX builders, a numpy reference.

Each case composes one spelling per part of a mixture-of-experts layer (router, routing,
experts, activation, combine, weights, token shape), the way different exporters write them,
and carries the outcome the fuser must reach: the fused op and its attributes, or a refusal
that names the part at fault. ``test_properties.py`` checks the fuser against both;
``scripts/spelling_long_run.py`` runs every spelling and counts what fuses today.
"""
