"""``fusion_pipeline(..., target=)``: the ops each target gets, their attributes, the near misses."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from onnx_moe_fuse.contract.targets import target_named
from onnx_moe_fuse.pipeline import FusedNodesCheckPass, FusionReport, fusion_pipeline
from onnx_moe_fuse.samples import get_sample

MS = "com.microsoft"


def _fuse(name: str, target: str, only=None) -> tuple[ir.Model, FusionReport, bytes]:
    model = ir.serde.deserialize_model(get_sample(name).model)
    before = ir.serde.serialize_model(model).SerializeToString()
    report = FusionReport()
    fusion_pipeline(report, only, target)(model)
    return model, report, before


def _fused(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.domain == MS]


@pytest.mark.parametrize("target", ["ort-cpu", "ort-webgpu"])
def test_qmoe_carries_the_targets_attribute_set(target):
    model, report, _ = _fuse("mixtral_dec_int4b32", target)
    (node,) = _fused(model)
    assert node.op_type == "QMoE"
    assert set(node.attributes) == target_named(target).attribute_names("QMoE")
    assert set(report.fusions[0]["attributes"]) == set(node.attributes)
    assert report.to_dict()["target"] == target
    if target == "ort-cpu":
        assert node.attributes["weights_prepacked"].value == 0
        assert node.attributes["accuracy_level"].value == 0
    else:
        assert "weights_prepacked" not in node.attributes
        assert "accuracy_level" not in node.attributes


def test_float_moe_is_not_emitted_for_webgpu_and_the_near_miss_points_to_qmoe():
    model, report, before = _fuse("mixtral_dec_f32", "ort-webgpu")
    assert not report.fusions and not _fused(model)
    assert ir.serde.serialize_model(model).SerializeToString() == before
    (miss,) = [m for m in report.near_misses if m["part"] == "target"]
    assert "ort-webgpu has no float MoE kernel" in miss["reason"]
    assert "quantize the experts" in miss["reason"]
    assert miss["rule"] and miss["root"] and miss["topk"]  # as named in the working copy


def test_float_moe_fuses_for_cpu_and_cuda():
    for target in ("ort-cpu", "ort-cuda"):
        model, report, _ = _fuse("mixtral_dec_f32", target)
        assert [f["op"] for f in report.fusions] == ["MoE"], target
        (node,) = _fused(model)
        assert set(node.attributes) == target_named(target).attribute_names("MoE")


def test_float32_qmoe_is_not_emitted_for_cuda():
    model, report, before = _fuse("mixtral_dec_int4b32_rank3", "ort-cuda")
    assert not report.fusions
    assert ir.serde.serialize_model(model).SerializeToString() == before
    (miss,) = [m for m in report.near_misses if m["part"] == "target"]
    assert "ort-cuda has no float32 QMoE kernel" in miss["reason"]


@pytest.mark.parametrize("target", ["ort-cpu", "ort-cuda"])
def test_qkv_keeps_its_composition_where_the_target_has_no_kernel(target):
    model, report, before = _fuse("qkv_skip_sln_nbits_residual_rank3", target)
    assert not report.fusions
    assert ir.serde.serialize_model(model).SerializeToString() == before
    (miss,) = [m for m in report.near_misses if m["part"] == "target"]
    assert f"{target} has no MatMulNBitsQkv kernel" in miss["reason"]
    assert "target ort-webgpu" in miss["reason"]
    assert miss["rule"].startswith("MatMulNBitsQkv[") and miss["values"]


def test_qkv_fuses_for_webgpu_with_its_attribute_set():
    model, report, _ = _fuse("qkv_skip_sln_nbits_residual_rank3", "ort-webgpu")
    assert [f["op"] for f in report.fusions] == ["MatMulNBitsQkv"]
    (node,) = _fused(model)
    assert set(node.attributes) == target_named("ort-webgpu").attribute_names("MatMulNBitsQkv")
    assert node.attributes["accuracy_level"].value == 0


def test_only_meets_the_target():
    _, report, _ = _fuse("qkv_decomposed_nbits", "ort-webgpu", only={"MoE", "QMoE"})
    assert not report.fusions and not [m for m in report.near_misses if m["part"] == "target"]
    with pytest.raises(ValueError, match="unknown target"):
        fusion_pipeline(FusionReport(), None, "cuda")


def test_postcondition_refuses_a_node_the_target_cannot_run():
    model, _, _ = _fuse("mixtral_dec_f32", "ort-cpu")
    FusedNodesCheckPass(target_named("ort-cpu"))(model)
    with pytest.raises(ir.passes.PostconditionError, match="ort-webgpu, which has no kernel"):
        FusedNodesCheckPass(target_named("ort-webgpu"))(model)
    model, _, _ = _fuse("mixtral_dec_int4b32", "ort-cpu")
    with pytest.raises(ir.passes.PostconditionError, match="but ort-cuda takes"):
        FusedNodesCheckPass(target_named("ort-cuda"))(model)


def test_the_api_parses_a_target_once_and_the_passes_share_it():
    from onnx_moe_fuse import fuse
    from onnx_moe_fuse.api import check_target
    from onnx_moe_fuse.errors import OptionError

    with pytest.raises(
        OptionError, match="target: unknown target 'tpu'; choose one of ort-cpu"
    ) as e:
        fuse(get_sample("mixtral_dec_int4b32").model, target="tpu")
    assert e.value.option == "target"
    webgpu = target_named("ort-webgpu")
    assert check_target("ort-webgpu") is webgpu and check_target(webgpu) is webgpu
    by_name = fuse(get_sample("mixtral_dec_int4b32").model, target="ort-webgpu").model
    by_object = fuse(get_sample("mixtral_dec_int4b32").model, target=webgpu).model
    assert by_name.SerializeToString() == by_object.SerializeToString()
    passes = fusion_pipeline(FusionReport(), None, "ort-webgpu").passes
    targets = [p.target for p in passes if hasattr(p, "target")]
    assert len(targets) == 3 and all(t is webgpu for t in targets)
