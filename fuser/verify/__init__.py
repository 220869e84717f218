"""Verification: prove a fused model equal to its original, on the WebGPU kernels and in ORT.

* :mod:`.checker`: :func:`verify` runs both models on the same random inputs and compares
  (its report in :mod:`.report`, errors and tolerances in :mod:`.compare`, the ORT path in
  :mod:`.ort_path`);
* :mod:`.reference`: the original's path (``onnx.reference`` plus the numpy oracles; the
  contrib ops in :mod:`.reference_moe` and :mod:`.reference_nbits`, random inputs in
  :mod:`.feeds`);
* :mod:`.evaluator`: the fused model on the project's WebGPU kernels (``onnx_moe_fuse.kernels``;
  how each op maps onto its package in :mod:`.kernel_specs`);
* :mod:`.ort_nodes`: single ONNX Runtime nodes as references;
* :mod:`.quant_error`: the measured error of layers quantised on request (``--quantize``) and
  the tolerance :func:`verify` takes for them (:func:`verify_tolerance`);
* :mod:`.selfcheck`: every kernel package's ``test.json`` cases on this machine's adapter;
* :mod:`.oracles`: plain numpy implementations of the ops, written apart from the kernels.

Input positions, attribute defaults and weight layouts of the ``com.microsoft`` ops come from
:mod:`onnx_moe_fuse.contract`.

The public names of :mod:`.checker` load on first use (``from onnx_moe_fuse.verify import
verify``), so that importing an oracle does not import the kernels it checks.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "checker": [
            "DEFAULT_TOLERANCES",
            "FeedTooLargeError",
            "ORT_INT8_ACTIVATION_RTOL",
            "PATHS",
            "OutputResult",
            "PathResult",
            "SeedError",
            "VerificationError",
            "VerificationReport",
            "ort_inexact_reasons",
            "ort_unsupported_reason",
            "verify",
        ],
        "quant_error": ["QuantizedTolerance", "measure_quantization_error", "verify_tolerance"],
    },
)
