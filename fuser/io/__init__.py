"""Model IO: reading, validating and writing model files without ever losing data.

* :mod:`.model_io`: :func:`~.model_io.load_model` (validated, external data read as ONNX Runtime
  reads it) and :func:`~.model_io.save_model_atomic` (temp file + rename, never over the input);
* :mod:`.model_check`: what an input must satisfy before it is fused (opsets, standard attribute
  sets, the ONNX checker);
* :mod:`.external_data`: external tensors resolved the way ORT resolves them, checked before a
  byte is read;
* :mod:`.output_paths`: output paths that cannot destroy data, atomic writes of small files;
* :mod:`.weight_sink`: :class:`~.weight_sink.ScratchFileSink`, where the rules' repacked weights
  go on the streaming path (the sink type itself is the rules': ``rewrites/graph/weight_sink.py``).
"""
