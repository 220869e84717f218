"""The activation fast path (the spelling patterns) and the behaviour check agree.

Every activation spelling the patterns match is fused twice: as usual, and with the patterns
switched off so the behaviour check (:mod:`onnx_moe_fuse.rewrites.moe.behaviour.activation`)
decides. Both must emit the same node: op, attributes and FC1's weights column for column.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest
from activation_layers import BASE
from onnx import helper, numpy_helper
from spellings.build import build_case

import onnx_moe_fuse.rewrites.moe.activation_proof as activation_proof
import onnx_moe_fuse.rewrites.moe.parts.activation as activation_part
from onnx_moe_fuse import fuse


def _fused(model: onnx.ModelProto) -> tuple[dict, dict[str, np.ndarray]]:
    result = fuse(model)
    (node,) = [n for n in result.model.graph.node if n.domain == "com.microsoft"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inits = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    return attrs, {f"input{i}": inits[n] for i, n in enumerate(node.input) if n in inits}


@pytest.mark.parametrize(
    "activation",
    ["relu", "gelu_tanh", "silu_x_sigmoid", "silu_sigmoid_x", "swish", "swiglu_separate",
     "swiglu_split", "swiglu_slice", "swiglu_strided", "swiglu_oss"],
)  # fmt: skip
def test_patterns_and_behaviour_emit_the_same_node(activation: str, monkeypatch) -> None:
    model = build_case(replace(BASE, activation=activation)).model
    fast_attrs, fast_arrays = _fused(model)
    monkeypatch.setattr(activation_part, "first_match", lambda patterns, node: None)
    calls = []
    proof = activation_proof.prove_activation
    monkeypatch.setattr(
        activation_proof, "prove_activation", lambda *a: calls.append(a) or proof(*a)
    )
    slow_attrs, slow_arrays = _fused(model)
    assert calls, "the behaviour check did not decide"
    assert slow_attrs.keys() == fast_attrs.keys()
    for key, value in fast_attrs.items():
        assert slow_attrs[key] == pytest.approx(value), key
    assert slow_arrays.keys() == fast_arrays.keys()
    for key, array in fast_arrays.items():
        np.testing.assert_array_equal(slow_arrays[key], array, err_msg=key)
