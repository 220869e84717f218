"""The ``com.microsoft`` contract: what ONNX Runtime's contrib ops take, each fact defined once.

A leaf: it imports nothing of the project (only the standard library and numpy), so the rules,
the pipeline, the verifier, the oracles and the samples all read it without importing each
other (``tests/test_import_layers.py``).

* :mod:`.ops`: the domain string :data:`~.ops.MS_DOMAIN` and one :class:`~.ops.ContribOp` per op
  the fuser writes or reads (``MoE``, ``QMoE``, ``MatMulNBitsQkv``, ``MatMulNBits``): ordered
  inputs with their optional flags, outputs, attribute names and ORT's defaults. Emitters build
  a node's input list by name from it (:meth:`~.ops.ContribOp.input_list`); the evaluator, the
  reference path and the ORT checks read positions and defaults from it.
* :mod:`.targets`: per runtime (``ort-cpu``, ``ort-cuda``, ``ort-webgpu``) which fused ops it has
  kernels for, their activations and dtypes, the attributes it needs or rejects, its newest
  opset, with the sources; a :class:`~.targets.Target` value object parsed once from a name.
* :mod:`.packing`: how QMoE and MatMulNBits store integer weights: symmetric zero points per
  bit width, the bit packing, the two layouts (pack and unpack).

Import from the submodules: this face re-exports nothing, so that the package needs nothing
beyond the standard library and numpy (the other faces re-export lazily through lazy_loader).
"""
