"""A QMoE node with ``router_weights`` (input 14) on the reference path and the wgpu evaluator.

The model is the shape the routing construction emits for ort-cpu: the router's logits select
(``router_probs``) and a computed tensor weighs (here ``Sigmoid(logits)`` into ``router_weights``,
a sigmoid router's scores), with the experts' weights as initializers. The reference path
(``onnx.reference`` + the numpy oracle) must match ONNX Runtime CPU, and the wgpu evaluator (the
QMoE kernel package) must match the reference path.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from helpers import rel_err
from onnx import helper, numpy_helper

from onnx_moe_fuse.contract.ops import MS_DOMAIN, QMOE
from onnx_moe_fuse.verify.evaluator import run_wgpu
from onnx_moe_fuse.verify.oracles.quant import quantize_symmetric
from onnx_moe_fuse.verify.ort_nodes import kernel_node_attributes, make_model, session
from onnx_moe_fuse.verify.reference import run_reference

ort = pytest.importorskip("onnxruntime")

TOL = 1e-4
E, H, INTER, K = 4, 64, 32, 2
_F32 = onnx.TensorProto.FLOAT


def _model(rng: np.random.Generator, normalize: int) -> onnx.ModelProto:
    """x [T, H], logits [T, E] -> QMoE(x, logits, ..., router_weights=Sigmoid(logits))."""
    fc1, s1 = quantize_symmetric(rng.standard_normal((E, 2 * INTER, H)) / math.sqrt(H), 4, 32, rng)
    fc2, s2 = quantize_symmetric(rng.standard_normal((E, H, INTER)) / math.sqrt(INTER), 4, 32, rng)
    arrays = {"w1": fc1, "s1": s1, "w2": fc2, "s2": s2}
    arrays["b2"] = rng.standard_normal((E, H)).astype(np.float32)
    names = {
        "input": "x",
        "router_probs": "logits",
        "fc1_experts_weights": "w1",
        "fc1_scales": "s1",
        "fc2_experts_weights": "w2",
        "fc2_scales": "s2",
        "fc2_experts_bias": "b2",
        "router_weights": "scores",
    }
    attrs = kernel_node_attributes(
        "QMoE",
        {
            "k": K,
            "activation_type": "swiglu",
            "expert_weight_bits": 4,
            "swiglu_fusion": 1,
            "block_size": 32,
            "normalize_routing_weights": normalize,
        },
    )
    nodes = [
        helper.make_node("Sigmoid", ["logits"], ["scores"]),
        helper.make_node(
            "QMoE",
            [n or "" for n in QMOE.input_list(names)],
            ["y"],
            name="moe0",
            domain=MS_DOMAIN,
            **attrs,
        ),
    ]
    inputs = [
        helper.make_tensor_value_info("x", _F32, ["T", H]),
        helper.make_tensor_value_info("logits", _F32, ["T", E]),
    ]
    output = helper.make_tensor_value_info("y", _F32, ["T", H])
    inits = [numpy_helper.from_array(v, n) for n, v in arrays.items()]
    return make_model(nodes, inputs, [output], inits)


@pytest.mark.parametrize("tokens", [1, 40])
@pytest.mark.parametrize("normalize", [0, 1])
def test_qmoe_with_router_weights_runs_on_reference_and_wgpu(device, rng, normalize, tokens):
    model = _model(rng, normalize)
    onnx.checker.check_model(model)
    feeds = {
        "x": rng.standard_normal((tokens, H)).astype(np.float32),
        "logits": rng.standard_normal((tokens, E)).astype(np.float32),
    }
    reference = run_reference(model, feeds)["y"]
    assert reference.shape == (tokens, H) and reference.dtype == np.float32
    expected = session(model).run(["y"], feeds)[0]
    assert rel_err(reference, expected) <= TOL, "reference path vs ORT CPU"
    # router_weights are read: the same node without them (softmax of the k logits) differs
    plain = onnx.ModelProto()
    plain.CopyFrom(model)
    del plain.graph.node[1].input[QMOE.index("router_weights") :]
    assert rel_err(run_reference(plain, feeds)["y"], reference) > 1e-3
    got = run_wgpu(model, feeds, check_shapes=True)["y"]
    assert rel_err(got, reference) <= TOL, "wgpu evaluator vs reference path"
