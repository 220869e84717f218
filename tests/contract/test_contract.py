"""The per-target op contract (``ort_contract``) against the schema facts it was written from.

``ort_schema_facts.json`` (beside this file) holds what was read: the CUDA provider's documented
QMoE/MoE attributes and kernel registrations (microsoft/onnxruntime, commits named there), and
the attribute lists of ORT 1.32's and onnxruntime-webgpu 1.27's schema registries. The ORT 1.32
list is also checked live against the installed onnxruntime.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from onnx_moe_fuse.contract import targets as oc

FACTS = json.loads((Path(__file__).parent / "ort_schema_facts.json").read_text())
CUDA = FACTS["ort-cuda"]
SCHEMA = {
    "ort-cpu": FACTS["ort-1.32-schema"]["attributes"],
    "ort-cuda": FACTS["ort-1.32-schema"]["attributes"],  # one schema for every provider
    "ort-webgpu": FACTS["ort-webgpu-1.27-schema"]["attributes"],
}

QMOE_ATTRS = {
    "k": 2,
    "activation_type": "swiglu",
    "normalize_routing_weights": 1,
    "use_sparse_mixer": 0,
    "swiglu_fusion": 1,
    "activation_alpha": 1.702,
    "activation_beta": 1.0,
    "swiglu_limit": 7.0,
    "expert_weight_bits": 4,
    "block_size": 32,
}


def test_targets_and_default():
    assert oc.TARGETS == ("ort-cpu", "ort-cuda", "ort-webgpu")
    assert oc.DEFAULT_TARGET == "ort-cpu"
    assert set(oc.CONTRACTS) == set(oc.TARGETS)
    with pytest.raises(ValueError, match="unknown target 'ort-tpu': choose one of ort-cpu"):
        oc.check_target("ort-tpu")


def test_ops_per_target():
    assert oc.ops_for("ort-cpu") == {"MoE", "QMoE"}
    assert oc.ops_for("ort-cuda") == set(CUDA["kernels"])
    assert oc.ops_for("ort-webgpu") == {"QMoE", "MatMulNBitsQkv"}


@pytest.mark.parametrize("target", oc.TARGETS)
def test_every_emitted_attribute_is_in_the_targets_schema(target):
    for op in oc.ops_for(target):
        assert oc.attribute_names(op, target) <= set(SCHEMA[target][op]), (target, op)


def test_qmoe_attribute_sets_per_target():
    common = set(QMOE_ATTRS) | {"quant_type"}
    assert oc.attribute_names("QMoE", "ort-cpu") == common | {"weights_prepacked", "accuracy_level"}
    assert oc.attribute_names("QMoE", "ort-cuda") == common | {"weights_prepacked"}
    assert oc.attribute_names("QMoE", "ort-webgpu") == common
    cpu = oc.node_attributes("QMoE", QMOE_ATTRS, "ort-cpu")
    assert (cpu["weights_prepacked"], cpu["accuracy_level"], cpu["quant_type"]) == (0, 0, "int")
    webgpu = oc.node_attributes("QMoE", {**QMOE_ATTRS, "accuracy_level": 0}, "ort-webgpu")
    assert "weights_prepacked" not in webgpu and "accuracy_level" not in webgpu
    assert webgpu["swiglu_limit"] == 7.0 and webgpu["quant_type"] == "int"


def test_cuda_contract_matches_the_documented_schema():
    """The raw layout needs weights_prepacked=0 on CUDA: its default (-1) means prepacked."""
    assert CUDA["weights_prepacked"]["default"] == -1
    attrs = oc.node_attributes("QMoE", QMOE_ATTRS, "ort-cuda")
    assert attrs["weights_prepacked"] == CUDA["weights_prepacked"]["raw_layout_value"] == 0
    assert attrs["quant_type"] == CUDA["quant_type_for_integer_weights"]
    for op in oc.ops_for("ort-cuda"):
        assert oc.attribute_names(op, "ort-cuda") <= set(CUDA["attributes"][op]), op
        contract = oc.CONTRACTS["ort-cuda"][op]
        assert contract.activations == set(CUDA["activation_types"])
        assert contract.dtypes == set(CUDA["kernels"][op])
    for op in CUDA["ops_without_kernel"]:
        assert "registers none" in oc.refusal(op, None, "ort-cuda")


def test_installed_onnxruntime_has_the_recorded_schema():
    ort = pytest.importorskip("onnxruntime")
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    if ort.__version__ != "1.32.0":
        pytest.skip(f"the facts were read from onnxruntime 1.32.0, this is {ort.__version__}")
    live = {
        s.name: sorted(s.attributes)
        for s in C.get_all_operator_schema()
        if s.domain == "com.microsoft" and s.name in ("MoE", "QMoE", "MatMulNBitsQkv")
    }
    assert live == FACTS["ort-1.32-schema"]["attributes"]


def test_swiglu_limit_is_written_as_infinity_when_the_layer_does_not_clamp():
    attrs = {k: v for k, v in QMOE_ATTRS.items() if k != "swiglu_limit"}
    for target in ("ort-cpu", "ort-webgpu"):
        assert math.isinf(oc.node_attributes("QMoE", attrs, target)["swiglu_limit"])


def test_a_missing_semantic_attribute_is_refused():
    attrs = {k: v for k, v in QMOE_ATTRS.items() if k != "block_size"}
    with pytest.raises(ValueError, match="block_size"):
        oc.node_attributes("QMoE", attrs, "ort-cpu")
    with pytest.raises(KeyError):
        oc.node_attributes("MoE", QMOE_ATTRS, "ort-webgpu")


def test_refusals_name_the_target_and_the_alternative():
    assert oc.refusal("QMoE", "swiglu", "ort-webgpu", "float32") is None
    assert oc.refusal("MoE", "gelu", "ort-cpu", "float32") is None
    moe = oc.refusal("MoE", "swiglu", "ort-webgpu")
    assert moe.startswith("ort-webgpu has no float MoE kernel (onnxruntime-webgpu 1.27)")
    assert "QMoE" in moe and "target ort-cpu" in moe
    gelu = oc.refusal("QMoE", "gelu", "ort-webgpu")
    assert "swiglu only" in gelu and "gelu" in gelu and "target ort-cpu or ort-cuda" in gelu
    f32 = oc.refusal("QMoE", "swiglu", "ort-cuda", "float32")
    assert "no float32 QMoE kernel" in f32 and f32.endswith("target ort-cpu or ort-webgpu")
    qkv = oc.refusal("MatMulNBitsQkv", None, "ort-cpu")
    assert "ort-cpu has no MatMulNBitsQkv kernel" in qkv and "target ort-webgpu" in qkv
