"""The per-target op contract (``contract.targets``) against the schema facts it was written from.

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
from onnx_moe_fuse.contract.targets import target_named as t

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
        oc.target_named("ort-tpu")
    assert oc.DEFAULT is t(oc.DEFAULT_TARGET) and oc.as_target(oc.DEFAULT) is oc.DEFAULT
    for name in oc.TARGETS:
        target = t(name)
        assert (target.name, str(target), target.max_opset) == (name, name, oc.MAX_OPSET[name])
        assert oc.as_target(name) is target and target.contracts is oc.CONTRACTS[name]


def test_ops_per_target():
    assert t("ort-cpu").ops == {"MoE", "QMoE"}
    assert t("ort-cuda").ops == set(CUDA["kernels"])
    assert t("ort-webgpu").ops == {"QMoE", "MatMulNBitsQkv"}


@pytest.mark.parametrize("target", oc.TARGETS)
def test_every_emitted_attribute_is_in_the_targets_schema(target):
    for op in t(target).ops:
        assert t(target).attribute_names(op) <= set(SCHEMA[target][op]), (target, op)


def test_qmoe_attribute_sets_per_target():
    common = set(QMOE_ATTRS) | {"quant_type"}
    assert t("ort-cpu").attribute_names("QMoE") == common | {"weights_prepacked", "accuracy_level"}
    assert t("ort-cuda").attribute_names("QMoE") == common | {"weights_prepacked"}
    assert t("ort-webgpu").attribute_names("QMoE") == common
    cpu = t("ort-cpu").node_attributes("QMoE", QMOE_ATTRS)
    assert (cpu["weights_prepacked"], cpu["accuracy_level"], cpu["quant_type"]) == (0, 0, "int")
    webgpu = t("ort-webgpu").node_attributes("QMoE", {**QMOE_ATTRS, "accuracy_level": 0})
    assert "weights_prepacked" not in webgpu and "accuracy_level" not in webgpu
    assert webgpu["swiglu_limit"] == 7.0 and webgpu["quant_type"] == "int"


def test_cuda_contract_matches_the_documented_schema():
    """The raw layout needs weights_prepacked=0 on CUDA: its default (-1) means prepacked."""
    assert CUDA["weights_prepacked"]["default"] == -1
    attrs = t("ort-cuda").node_attributes("QMoE", QMOE_ATTRS)
    assert attrs["weights_prepacked"] == CUDA["weights_prepacked"]["raw_layout_value"] == 0
    assert attrs["quant_type"] == CUDA["quant_type_for_integer_weights"]
    for op in t("ort-cuda").ops:
        assert t("ort-cuda").attribute_names(op) <= set(CUDA["attributes"][op]), op
        contract = oc.CONTRACTS["ort-cuda"][op]
        assert contract.activations == set(CUDA["activation_types"])
        assert contract.dtypes == set(CUDA["kernels"][op])
    for op in CUDA["ops_without_kernel"]:
        assert "registers none" in t("ort-cuda").refusal(op, None)


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
        assert math.isinf(t(target).node_attributes("QMoE", attrs)["swiglu_limit"])


def test_a_missing_semantic_attribute_is_refused():
    attrs = {k: v for k, v in QMOE_ATTRS.items() if k != "block_size"}
    with pytest.raises(ValueError, match="block_size"):
        t("ort-cpu").node_attributes("QMoE", attrs)
    with pytest.raises(KeyError):
        t("ort-webgpu").node_attributes("MoE", QMOE_ATTRS)


def test_refusals_name_the_target_and_the_alternative():
    assert t("ort-webgpu").refusal("QMoE", "swiglu", "float32") is None
    assert t("ort-cpu").refusal("MoE", "gelu", "float32") is None
    moe = t("ort-webgpu").refusal("MoE", "swiglu")
    assert moe.startswith("ort-webgpu has no float MoE kernel (onnxruntime-webgpu 1.27)")
    assert "QMoE" in moe and "target ort-cpu" in moe
    gelu = t("ort-webgpu").refusal("QMoE", "gelu")
    assert "swiglu only" in gelu and "gelu" in gelu and "target ort-cpu or ort-cuda" in gelu
    f32 = t("ort-cuda").refusal("QMoE", "swiglu", "float32")
    assert "no float32 QMoE kernel" in f32 and f32.endswith("target ort-cpu or ort-webgpu")
    qkv = t("ort-cpu").refusal("MatMulNBitsQkv", None)
    assert "ort-cpu has no MatMulNBitsQkv kernel" in qkv and "target ort-webgpu" in qkv
