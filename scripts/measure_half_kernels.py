"""Which (op, activation dtype) pairs an installed ONNX Runtime runs: one MoE / QMoE node each.

Run it with the interpreter of the package to measure (ORT 1.32 CPU in ``.venv``,
onnxruntime-webgpu 1.27 in ``.venv-webgpu``: both install as ``onnxruntime``)::

    .venv/bin/python scripts/measure_half_kernels.py            # a JSON list on stdout
    .venv-webgpu/bin/python scripts/measure_half_kernels.py

For each op (``MoE``; ``QMoE`` with 4-bit and 8-bit weights) and each activation dtype
(float32, float16, bfloat16) it builds one node (SwiGLU interleaved, k=2 of E=4, H=32, I=16,
column-wise scales, the ort-cpu attribute set; for onnxruntime-webgpu the QMoE attributes its
1.27 schema knows), runs it on the CPU provider and compares with a float64 numpy reference
computed from the same (rounded) inputs: ``max |ort - ref| / max |ref|``. A pair without a
kernel reports the error's first line (ORT's "Could not find an implementation", a type
error, ...). The docs (``docs/targets.md``) and ``fuser/contract/targets.py`` record the
result; ``tests/contract/test_half_kernels.py`` runs the same measurement on ORT 1.32 CPU.

Imports only onnx, numpy, ml_dtypes and onnxruntime (nothing of the project), so it runs in
either venv unchanged.
"""

from __future__ import annotations

import json
import sys

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

E, K, H, INTER = 4, 2, 32, 16
DTYPES = {
    "float32": (np.float32, TensorProto.FLOAT),
    "float16": (np.float16, TensorProto.FLOAT16),
    "bfloat16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16),
}


def _swiglu(fc1_out: np.ndarray) -> np.ndarray:
    gate, lin = fc1_out[..., 0::2], fc1_out[..., 1::2]
    return gate / (1.0 + np.exp(-gate)) * lin


def _reference(x, logits, w1, w2) -> np.ndarray:
    """Float64 MoE: softmax over E, top-k, renormalised; SwiGLU interleaved."""
    x, logits, w1, w2 = (np.asarray(a, np.float64) for a in (x, logits, w1, w2))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-logits[t], kind="stable")[:K]
        p = np.exp(logits[t, top] - logits[t, top].max())
        p /= p.sum()
        for j, e in enumerate(top):
            out[t] += p[j] * (w2[e] @ _swiglu(w1[e] @ x[t]))
    return out


def _quantise(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric per-row codes (zp 8 / 128), packed low nibble first; dequantised weights."""
    qmax = (1 << (bits - 1)) - 1
    scale = np.abs(w).max(axis=-1) / qmax
    scale = np.where(scale == 0, 1.0, scale)
    zp = 1 << (bits - 1)
    q = np.clip(np.round(w / scale[..., None]), -qmax - 1, qmax).astype(np.int64) + zp
    deq = (q - zp) * scale[..., None]
    if bits == 4:
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    else:
        packed = q.astype(np.uint8)
    return packed, scale, deq


def _webgpu_schema() -> bool:
    return ort.__version__.startswith("1.27")


def _case(op: str, bits: int, dtype: str, rng: np.random.Generator) -> dict:
    np_t, onnx_t = DTYPES[dtype]
    t = 5
    x = rng.standard_normal((t, H)).astype(np_t)
    logits = rng.standard_normal((t, E)).astype(np_t)
    w1 = (rng.standard_normal((E, 2 * INTER, H)) * 0.2).astype(np.float32)
    w2 = (rng.standard_normal((E, H, INTER)) * 0.2).astype(np.float32)
    attrs = dict(k=K, activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1)
    inits = []
    if op == "MoE":
        w1t, w2t = w1.astype(np_t), w2.astype(np_t)
        ref = _reference(x, logits, w1t, w2t)
        inits = [
            helper.make_tensor("fc1", onnx_t, w1t.shape, w1t.tobytes(), raw=True),
            helper.make_tensor("fc2", onnx_t, w2t.shape, w2t.tobytes(), raw=True),
        ]
        inputs = ["x", "router", "fc1", "", "fc2"]
    else:
        q1, s1, d1 = _quantise(w1, bits)
        q2, s2, d2 = _quantise(w2, bits)
        s1t, s2t = s1.astype(np_t), s2.astype(np_t)
        ref = _reference(x, logits, d1 / s1[..., None] * s1t[..., None].astype(np.float64),
                         d2 / s2[..., None] * s2t[..., None].astype(np.float64))  # fmt: skip
        inits = [
            helper.make_tensor("fc1", TensorProto.UINT8, q1.shape, q1.tobytes(), raw=True),
            helper.make_tensor("s1", onnx_t, s1t.shape, s1t.tobytes(), raw=True),
            helper.make_tensor("fc2", TensorProto.UINT8, q2.shape, q2.tobytes(), raw=True),
            helper.make_tensor("s2", onnx_t, s2t.shape, s2t.tobytes(), raw=True),
        ]
        inputs = ["x", "router", "fc1", "s1", "", "fc2", "s2"]
        attrs.update(expert_weight_bits=bits, quant_type="int")
        if not _webgpu_schema():
            attrs.update(weights_prepacked=0, accuracy_level=0)
    node = helper.make_node(op, inputs, ["y"], domain="com.microsoft", **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("x", onnx_t, [t, H]),
            helper.make_tensor_value_info("router", onnx_t, [t, E]),
        ],
        [helper.make_tensor_value_info("y", onnx_t, [t, H])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8
    name = op if op == "MoE" else f"QMoE{bits}"
    try:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.log_severity_level = 4  # the refusal is the measurement, not a log line
        sess = ort.InferenceSession(
            model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
        y = sess.run(None, {"x": x, "router": logits})[0]
    except Exception as error:  # noqa: BLE001 - the error is the measurement
        return {"op": name, "dtype": dtype, "runs": False, "error": str(error).splitlines()[0]}
    err = float(np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max())
    return {"op": name, "dtype": dtype, "runs": True, "max_rel_err": err}


def measure() -> list[dict]:
    """Every (op, dtype) case on this ORT's CPU provider."""
    rng = np.random.default_rng(0)
    return [
        _case(op, bits, dtype, rng)
        for op, bits in (("MoE", 0), ("QMoE", 4), ("QMoE", 8))
        for dtype in DTYPES
    ]


if __name__ == "__main__":
    result = {"onnxruntime": ort.__version__, "onnx": onnx.__version__, "cases": measure()}
    json.dump(result, sys.stdout, indent=1)
    print()
