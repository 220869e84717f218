"""DeepSpeed's top-2 capacity dispatch (``onnx_moe_fuse.samples.handwritten_capacity``).

* ``test_layer_matches_numpy``: each honest layer, run in ORT CPU, is the top-2 MoE of a numpy
  reference written here (softmax, the two largest, renormalised, one ReLU MLP per expert on its
  token), on fresh random inputs (two token counts for the dynamic one);
* ``test_traps_are_not_the_layer``: each trap computes something else (far from that reference
  on some draw), so refusing it matters;
* ``test_fuser_outcome``: an honest layer fuses into one MoE (k = 2, renormalised) matching ORT
  on the original within 1e-5 scale-aware; a trap is refused, the model byte-identical, and its
  near miss names the part and node without reading "not recognised".
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnx_moe_fuse import fuse
from onnx_moe_fuse.samples.handwritten_capacity import CAPACITY, TOKENS, deepspeed_top2
from onnx_moe_fuse.samples.handwritten_graph import Fused

RTOL = 1e-5
HONEST = [v for v, outcome in CAPACITY.items() if isinstance(outcome, Fused)]
TRAPS = [v for v in CAPACITY if v not in HONEST]


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The top-2 MoE with renormalised softmax weights, from the model's own weights."""
    w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    logits = x.astype(np.float64) @ w["wg"]
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t], kind="stable")[:2]
        for e in top:
            h = np.maximum(x[t] @ w[f"w1_{e}"] + w[f"b1_{e}"], 0.0)
            out[t] += probs[t, e] / probs[t, top].sum() * (h @ w[f"w2_{e}"] + w[f"b2_{e}"])
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def _inputs(variant: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    counts = (5, 3 * TOKENS) if variant == "nodrop_dynamic" else (TOKENS,)
    return [rng.standard_normal((t, 8)).astype(np.float32) for t in counts]


@pytest.mark.parametrize("variant", HONEST)
def test_layer_matches_numpy(variant: str) -> None:
    seed = int(np.random.SeedSequence().entropy % 2**31)
    model = deepspeed_top2(variant).model
    for x in _inputs(variant, seed):
        assert _rel(_run(model, x), _reference(model, x)) <= RTOL, f"seed {seed}"


@pytest.mark.parametrize("variant", TRAPS)
def test_traps_are_not_the_layer(variant: str) -> None:
    model = deepspeed_top2(variant).model
    rng = np.random.default_rng(7)
    rows = 8 * TOKENS if "dynamic" in variant else TOKENS  # past the fixed capacity
    draws = [rng.standard_normal((rows, 8)).astype(np.float32) * 3 for _ in range(8)]
    assert max(_rel(_run(model, x), _reference(model, x)) for x in draws) > 1e-2


@pytest.mark.parametrize("variant", list(CAPACITY))
def test_fuser_outcome(variant: str) -> None:
    layer = deepspeed_top2(variant)
    result = fuse(layer.model)
    fused = [n for n in result.model.graph.node if n.domain == "com.microsoft"]
    misses = result.report.near_misses
    assert not [m for m in misses if "not recognised" in m["reason"]]
    if isinstance(layer.expected, Fused):
        assert [n.op_type for n in fused] == [layer.expected.op]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in fused[0].attribute}
        for key, value in layer.expected.attributes.items():
            assert attrs[key] == value, key
        seed = int(np.random.SeedSequence().entropy % 2**31)
        for x in _inputs(variant, seed):
            err = _rel(_run(result.model, x), _run(layer.model, x))
            assert err <= RTOL, f"fused differs by {err:.3g} (seed {seed})"
        return
    assert not fused
    assert result.model.SerializeToString() == layer.model.SerializeToString()
    named = [m for m in misses if m["part"] == layer.expected.part and m["node"]]
    assert named, misses
    assert layer.expected.reason in named[0]["reason"], named[0]["reason"]
