"""Canonicalisation passes: rewrite the spellings of a layer's parts into the forms the rules match.

They run on a *working copy* of the model (``onnx_ir.Model.clone()``, which shares the weight
tensors), never on the model the user gave: the layer rules recognise and fuse there, and the
fused nodes are spliced into the original graph afterwards (``onnx_moe_fuse.pipeline.splice``), so a layer
that does not fuse comes out exactly as it went in, whatever canonicalisation did to its copy.

Each pass is one ``onnx_ir.passes.InPlacePass`` in its own module, semantics-preserving, and keeps
the names of the values it does not remove (a replacement value takes the name of the value it
replaces): the splice finds the fused layer's inputs and output in the original by name. A pass
never raises on a valid model; it leaves what it cannot handle as it is.

:func:`.passes.canonicalisation_passes` lists them in the order the pipeline runs them.
"""
