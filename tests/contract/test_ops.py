"""The contract's ``com.microsoft`` ops (``contract.ops``) and weight layout (``contract.packing``).

The ops' inputs, outputs, attribute defaults and required attributes are checked against the
installed ONNX Runtime 1.32's schema registry (the source they were read from); the name-based
input lists against what ORT writes (positions, ``""`` for an absent optional input, trailing
absent inputs dropped).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnx_moe_fuse.contract.ops import (
    ACTIVATION_TYPES,
    CONTRIB_OPS,
    MATMUL_NBITS_QKV,
    MOE,
    MS_DOMAIN,
    QMOE,
)
from onnx_moe_fuse.contract.packing import (
    QMOE_SYMMETRIC_ZERO_POINT_BYTE,
    pack_bits,
    symmetric_zero_point_byte,
    unpack_bits,
    zero_point,
)
from onnx_moe_fuse.contract.targets import CONTRACTS, SEMANTIC_ATTRIBUTES


def _live_schemas() -> dict:
    ort = pytest.importorskip("onnxruntime")
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    if ort.__version__ != "1.32.0":
        pytest.skip(f"the ops were read from onnxruntime 1.32.0, this is {ort.__version__}")
    return {
        s.name: s
        for s in C.get_all_operator_schema()
        if s.domain == MS_DOMAIN and s.name in CONTRIB_OPS
    }


def _default(attr) -> object:
    proto = onnx.AttributeProto.FromString(attr._default_value)
    if not proto.type:
        return None
    value = onnx.helper.get_attribute_value(proto)
    return value.decode() if isinstance(value, bytes) else value


@pytest.mark.parametrize("name", sorted(CONTRIB_OPS))
def test_op_is_the_installed_onnxruntime_schema(name):
    schema = _live_schemas()[name]
    op = CONTRIB_OPS[name]
    optional = "FormalParameterOption.Optional"
    assert [(p.name, str(p.option) == optional) for p in schema.inputs] == [
        (p.name, p.optional) for p in op.inputs
    ]
    assert [(p.name, str(p.option) == optional) for p in schema.outputs] == [
        (p.name, p.optional) for p in op.outputs
    ]
    assert set(schema.attributes) == set(op.attributes)
    for attr_name, attr in schema.attributes.items():
        default = _default(attr)
        if isinstance(default, float):
            assert op.default(attr_name) == pytest.approx(default, rel=1e-7), attr_name
        else:
            assert op.default(attr_name) == default, attr_name
    assert {n for n, a in schema.attributes.items() if a.required} == op.required


def test_every_fused_op_of_every_target_is_in_the_contract():
    for contracts in CONTRACTS.values():
        for op, contract in contracts.items():
            assert set(SEMANTIC_ATTRIBUTES[op]) <= CONTRIB_OPS[op].attribute_names
            assert (set(contract.fixed) | contract.omitted) <= CONTRIB_OPS[op].attribute_names
            if contract.activations is not None:
                assert contract.activations <= set(ACTIVATION_TYPES)


def test_input_list_by_name():
    assert QMOE.input_list(
        {
            "input": "x",
            "router_probs": "r",
            "fc1_experts_weights": "w1",
            "fc1_scales": "s1",
            "fc1_experts_bias": None,
            "fc2_experts_weights": "w2",
            "fc2_scales": "s2",
        }
    ) == ["x", "r", "w1", "s1", None, "w2", "s2"]
    assert MOE.input_list(
        {
            "input": "x",
            "router_probs": "r",
            "fc1_experts_weights": "w1",
            "fc2_experts_weights": "w2",
        }
    ) == ["x", "r", "w1", None, "w2"]
    with pytest.raises(KeyError, match="fc1_scales"):
        MOE.input_list({"input": "x", "fc1_scales": "s"})
    with pytest.raises(ValueError, match="norm_scale"):
        MATMUL_NBITS_QKV.input_list({"A": "a"})
    named = MATMUL_NBITS_QKV.named_inputs(["a", None, "g"])
    assert (named["A"], named["skip"], named["norm_scale"], named["v_bias"]) == (
        "a",
        None,
        "g",
        None,
    )
    with pytest.raises(ValueError, match="has 8 inputs"):
        MOE.named_inputs([None] * 9)
    assert QMOE.index("router_weights") == 14 and MOE.index("fc2_experts_weights") == 4


def test_attributes_over_the_defaults():
    assert QMOE.with_defaults({"k": 2})["expert_weight_bits"] == 4
    assert "block_size" not in QMOE.with_defaults({}) and "swiglu_limit" not in MOE.defaults
    with pytest.raises(ValueError, match="no attributes"):
        MOE.checked_attributes({"num_shared_experts": 1})
    with pytest.raises(ValueError, match="needs the attributes"):
        MATMUL_NBITS_QKV.checked_attributes({"K": 64})


def test_symmetric_zero_points():
    assert [zero_point(b) for b in (2, 4, 8)] == [2, 8, 128]
    assert QMOE_SYMMETRIC_ZERO_POINT_BYTE == {4: 0x88, 8: 0x80}
    for bits in (2, 4, 8):
        byte = np.array([symmetric_zero_point_byte(bits)], np.uint8)
        assert set(unpack_bits(byte, bits).tolist()) == {zero_point(bits)}
    assert pack_bits(np.array([3, 12]), 4).tolist() == [0xC3]  # the earliest code lowest
