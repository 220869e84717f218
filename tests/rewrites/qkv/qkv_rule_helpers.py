"""What the MatMulNBitsQkv rule tests share: the samples by kind, fusing, reading, running in ORT."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import onnx_ir as ir
import onnxruntime as ort
import onnxscript.rewriter

from onnx_moe_fuse.rewrites.qkv.rule import (
    FUSED_OP,
    MS_DOMAIN,
    near_misses,
    rules,
)
from onnx_moe_fuse.samples import Sample, all_samples, get_sample

SAMPLES: dict[str, Sample] = {s.name: s for s in all_samples("qkv")}
POSITIVE = [n for n, s in SAMPLES.items() if not s.is_near_miss]
NEAR_MISSES = [n for n, s in SAMPLES.items() if s.is_near_miss]
SLOTS = (
    "A",
    "skip",
    "norm_scale",
    "q_B",
    "q_scales",
    "q_bias",
    "k_B",
    "k_scales",
    "k_bias",
    "v_B",
    "v_scales",
    "v_bias",
)
ATTRIBUTES = {"K", "Nq", "Nkv", "bits", "block_size", "epsilon", "accuracy_level"}
# Relative to max|reference|. float16: ORT rounds the normalised value to float16 and a float16
# decomposed norm squares in float16; 60 seeds measured at most 1.3e-3.
TOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 4e-3}


def fuse(model: onnx.ModelProto) -> onnx.ModelProto:
    """The rule set through onnxscript's rewriter (it sweeps dead code afterwards)."""
    return onnxscript.rewriter.rewrite(model, pattern_rewrite_rules=rules())


_FUSED: dict[str, onnx.ModelProto] = {}


def fused_sample(name: str) -> onnx.ModelProto:
    if name not in _FUSED:
        _FUSED[name] = fuse(get_sample(name).model)
    return _FUSED[name]


def fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if (n.domain, n.op_type) == (MS_DOMAIN, FUSED_OP)]


def op_counts(model: onnx.ModelProto) -> collections.Counter[str]:
    return collections.Counter(n.op_type for n in model.graph.node)


def attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: oh.get_attribute_value(a) for a in node.attribute}


def slots(node: onnx.NodeProto) -> dict[str, str]:
    names = list(node.input) + [""] * (len(SLOTS) - len(node.input))
    return dict(zip(SLOTS, names, strict=True))


def inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def graph_text(model: onnx.ModelProto) -> tuple[object, ...]:
    """The graph as comparable data: nodes in order, inputs, outputs, initializers by name."""
    g = model.graph
    nodes = [
        (n.domain, n.op_type, tuple(n.input), tuple(n.output), onnx.printer.to_text(n))
        for n in g.node
    ]
    values = [(v.name, v.type.SerializeToString()) for v in (*g.input, *g.output)]
    weights = sorted((t.name, t.SerializeToString()) for t in g.initializer)
    return tuple(nodes), tuple(values), tuple(weights)


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, sess.run(None, feeds), strict=True))


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.abs(want.astype(np.float64)).max())
    assert scale > 0, "reference output is all zeros: the comparison would prove nothing"
    return float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max() / scale)


def assert_unchanged(model: onnx.ModelProto) -> None:
    """The rules fire nowhere and leave the graph exactly as it was (no dead-code sweep)."""
    ir_model = ir.serde.deserialize_model(model)
    assert rules().apply_to_model(ir_model) == 0
    assert graph_text(ir.serde.serialize_model(ir_model)) == graph_text(model)


def reasons(model: onnx.ModelProto) -> list[str]:
    return [m.reason for m in near_misses(model)]


def seed_of(rng: np.random.Generator) -> int:
    return int(rng.integers(0, 2**31))
