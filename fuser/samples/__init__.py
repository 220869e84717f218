"""Small mixture-of-experts layers as ONNX models, each with the fusion it must give.

Every sample is one MoE layer written in standard ONNX (ONNX text form, parsed with
``onnx.parser``; weights attached as initializers from a seeded numpy Generator):

* families: Mixtral-like, Qwen3-MoE-like, Qwen2-MoE-like (with a shared expert), gpt-oss-like and
  a GELU MLP, plus near misses that must not fuse;
* expert spellings: ``GroupedMatMul`` (ONNX opset 29) and its Gather/Expand/MatMul decomposition
  (opset 21, runs in ONNX Runtime today);
* weights: float (-> ``com.microsoft.MoE``) or quantized behind ``DequantizeLinear`` (int4 blocked
  32 / 128 along K, uint8 per output channel with zero point 128; -> ``com.microsoft.QMoE``).

Use :func:`all_samples`, :func:`get_sample` or :func:`default_sample`; ``docs/samples.md`` lists
them all. A GroupedMatMul sample and its decomposed twin (``Sample.twin``) hold the same weights.

A second catalogue, :mod:`onnx_moe_fuse.samples.qkv`, holds attention preludes (an RMS norm
feeding Q/K/V projections -> ``com.microsoft.MatMulNBitsQkv``): ``Sample.kind`` is ``"moe"`` or
``"qkv"``. :func:`all_samples` and :func:`sample_names` take ``kind`` (``"moe"``, ``"qkv"`` or
``"all"``); the default, :data:`DEFAULT_KIND`, is ``"moe"`` for now, because the MoE tests
assert MoE-only facts of every sample they list. :func:`get_sample` finds a sample of either kind.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "registry": [
            "Sample",
            "all_samples",
            "get_sample",
            "default_sample",
            "sample_names",
            "DEFAULT_KIND",
            "DEFAULT_SAMPLE",
            "SampleKind",
        ]
    },
)
