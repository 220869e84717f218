"""float16 and bfloat16 whole-model exports: every MoE layer fuses in the model's dtype.

The opset-18 float16 and bfloat16 2-layer ``*ForCausalLM`` exports of Mixtral, Qwen3-MoE,
gpt-oss and DeepSeek-V3 (``sample_models/exported/causal_lm/*_op18_fp16|_bf16``; torch.onnx
dynamo, as the float32 ones; gpt-oss's and DeepSeek-V3's bfloat16 at opset 24, see below) are what real checkpoints export to: a float32 router (a Cast up
of the half-precision hidden states, or of the logits, or of the softmax) inside a half-precision
model, experts in half precision, the combine summed in float32 or in half precision. Here,
for the default target ort-cpu and for ort-cuda:

* float16: every MoE layer fuses into a float16 ``MoE`` (both targets); the fused model matches
  ORT CPU on the original on fresh token ids of two lengths within :data:`HALF_RTOL` (measured
  about 1e-3), and ``--verify``'s check passes;
* bfloat16: ort-cpu has no bfloat16 MoE kernel, so each layer is refused naming the target and
  the dtype and the model comes back byte-identical; ort-cuda fuses every layer into a
  bfloat16 ``MoE``; ORT CPU cannot run bfloat16 (no ``Mul``/``MatMul``), so the fused model is
  compared with the original both upcast to float32 (``sample_models/upcast.py``), and
  ``--verify``'s WebGPU path (float32 compute, bfloat16 I/O) passes;
* the fused node's every input of type ``T`` has the model's dtype, and its attributes are the
  target's set (``contract.targets``).
"""

from __future__ import annotations

import collections
import importlib.util
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx_moe_fuse import fuse
from onnx_moe_fuse.contract.ops import MOE
from onnx_moe_fuse.contract.targets import target_named
from onnx_moe_fuse.verify.checker import verify
from onnx_moe_fuse.verify.ort_nodes import session

ROOT = Path(__file__).resolve().parents[2]
CAUSAL = ROOT / "sample_models" / "exported" / "causal_lm"
FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3")
FP16 = [f"{f}_batched_mm_dynamic_op18_fp16" for f in FAMILIES]
#: gpt-oss's and DeepSeek-V3's bfloat16 exports are at opset 24: their routers' TopK reads
#: bfloat16, which ONNX types from opset 24 on (the export script's ``BF16_OPSET``)
BF16_OPSET = {"gpt_oss": 24, "deepseek_v3": 24}
BF16 = [f"{f}_batched_mm_dynamic_op{BF16_OPSET.get(f, 18)}_bf16" for f in FAMILIES]
#: fused vs original, max |diff| / max |original| over the logits (2 layers, measured <= 1.1e-3
#: for float16; bfloat16 upcast twins agree to float32 rounding)
HALF_RTOL = 1e-2
UPCAST_RTOL = 1e-4
TOKEN_SHAPES = ((2, 8), (1, 13))
ELEM = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}


def _upcast():
    spec = importlib.util.spec_from_file_location("upcast", ROOT / "sample_models" / "upcast.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.upcast_to_float32


def _record(name: str) -> dict:
    return json.loads((CAUSAL / f"{name}.json").read_text())


def _load(name: str) -> onnx.ModelProto:
    return onnx.load(CAUSAL / f"{name}.onnx")


def _moe_layers(record: dict) -> int:
    return sum(1 for e in record["expected_layers"] if e["outcome"] != "no MoE")


def _fresh_ids(shape: tuple[int, int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 128, size=shape).astype(np.int64)


def _rel_err(original: onnx.ModelProto, fused: onnx.ModelProto) -> float:
    a, b = session(original), session(fused)
    worst = 0.0
    for seed, shape in enumerate(TOKEN_SHAPES):
        ids = {"input_ids": _fresh_ids(shape, 100 + seed)}
        (want,) = a.run(["logits"], ids)
        (got,) = b.run(["logits"], ids)
        want, got = want.astype(np.float64), got.astype(np.float64)
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    return worst


def _fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "com.microsoft"]


def _check_nodes(model: onnx.ModelProto, dtype: str, target: str, count: int) -> None:
    """``count`` MoE nodes, every input of type T in ``dtype``, the target's attribute set."""
    nodes = _fused_nodes(model)
    assert [n.op_type for n in nodes] == ["MoE"] * count
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    types.update((v.name, v.type.tensor_type.elem_type) for v in model.graph.input)
    types.update((t.name, t.data_type) for t in model.graph.initializer)
    inferred = onnx.shape_inference.infer_shapes(model)
    types.update((v.name, v.type.tensor_type.elem_type) for v in inferred.graph.value_info)
    typed_t = ("input", "router_probs", "fc1_experts_weights", "fc2_experts_weights")
    for node in nodes:
        named = MOE.named_inputs(list(node.input))
        for name in typed_t:
            assert types.get(named[name]) == ELEM[dtype], (node.name, name)
        attrs = {a.name for a in node.attribute}
        assert attrs == target_named(target).attribute_names("MoE"), attrs


def _check_recorded_attributes(fusions: list[dict], record: dict) -> None:
    """Each fused layer has the attributes its record pins (k, activation, constants)."""
    pinned = [e["attributes"] for e in record["expected_layers"] if e["outcome"] == "MoE"]
    pinned = pinned or [e["attributes"] for e in _float16_twin(record)["expected_layers"]
                        if e["outcome"] == "MoE"]  # fmt: skip
    assert len(fusions) == len(pinned)
    for fusion, want in zip(fusions, pinned, strict=True):
        for name, value in want.items():
            if isinstance(value, str):
                assert fusion["attributes"][name] == value, (name, fusion)
            else:
                assert fusion["attributes"][name] == pytest.approx(value, rel=1e-6), (name, fusion)


def _float16_twin(record: dict) -> dict:
    """The float16 opset-18 record of a bfloat16 export's family (ort-cpu refuses bfloat16)."""
    return _record(f"{record['family']}_batched_mm_dynamic_op18_fp16")


@pytest.mark.parametrize("target", ["ort-cpu", "ort-cuda"])
@pytest.mark.parametrize("name", FP16)
def test_float16_export_fuses_every_layer_and_matches_ort(name: str, target: str) -> None:
    record = _record(name)
    original = _load(name)
    result = fuse(original, target=target)
    emitted = collections.Counter(f["op"] for f in result.report.fusions)
    want = record["expected"] if target == "ort-cpu" else record["expected_ort_cuda"]
    assert sorted(emitted.items()) == sorted((op, n) for op, n in want)
    assert want == [["MoE", _moe_layers(record)]]
    _check_nodes(result.model, "float16", target, _moe_layers(record))
    _check_recorded_attributes(result.report.fusions, record)
    assert {f["dtype"] for f in result.report.fusions} == {"float16"}
    err = _rel_err(original, result.model)  # ORT CPU runs the float16 MoE of either target
    assert err <= HALF_RTOL, f"{name} ({target}): fused vs original rel err {err:.2e}"


@pytest.mark.parametrize("name", FP16)
def test_float16_export_passes_verify(name: str) -> None:
    original = _load(name)
    report = verify(original, fuse(original).model, seeds=(5, 6))
    assert report.passed, report.summary()
    for path in ("wgpu", "ort"):
        assert report.paths[path].status == "passed", report.summary()


@pytest.mark.parametrize("name", BF16)
def test_bfloat16_export_refused_on_ort_cpu_naming_target_and_dtype(name: str) -> None:
    original = _load(name)
    result = fuse(original)
    assert result.report.fusions == []
    misses = [m for m in result.report.near_misses if m["part"] == "target"]
    assert len(misses) == _moe_layers(_record(name)), result.report.near_misses
    for miss in misses:
        assert "ort-cpu" in miss["reason"] and "bfloat16" in miss["reason"], miss
        assert "ort-cuda" in miss["reason"], miss  # the alternative
    assert result.model.SerializeToString() == original.SerializeToString()


@pytest.mark.parametrize("name", BF16)
def test_bfloat16_export_fuses_for_cuda_and_matches_its_float32_twin(name: str) -> None:
    record = _record(name)
    original = _load(name)
    result = fuse(original, target="ort-cuda")
    emitted = collections.Counter(f["op"] for f in result.report.fusions)
    assert sorted(emitted.items()) == sorted((op, n) for op, n in record["expected_ort_cuda"])
    _check_nodes(result.model, "bfloat16", "ort-cuda", _moe_layers(record))
    assert {f["dtype"] for f in result.report.fusions} == {"bfloat16"}
    for fusion in result.report.fusions:  # the export's constants, rounded to bfloat16
        if record["family"] == "gpt_oss":
            assert fusion["attributes"]["activation_alpha"] == 1.703125
    # ORT CPU runs no bfloat16 Mul/MatMul/MoE: both models compute in float32 instead, so
    # what is left is the fused node's formula against the layer's (to float32 rounding)
    upcast = _upcast()
    err = _rel_err(upcast(original), upcast(result.model))
    assert err <= UPCAST_RTOL, f"{name}: upcast fused vs upcast original rel err {err:.2e}"


@pytest.mark.parametrize("name", BF16[:2])
def test_bfloat16_cuda_fusion_passes_verify_on_webgpu(name: str) -> None:
    original = _load(name)
    report = verify(original, fuse(original, target="ort-cuda").model, seeds=(5,))
    assert report.passed, report.summary()
    assert report.paths["wgpu"].status == "passed", report.summary()
    assert report.paths["ort"].status == "skipped", report.summary()  # no bfloat16 CPU kernels


def test_mixtral_float16_for_cuda_writes_float16_moe_nodes() -> None:
    """``--target ort-cuda`` on the float16 Mixtral export: float16 MoE, CUDA's attributes."""
    name = "mixtral_batched_mm_dynamic_op18_fp16"
    result = fuse(_load(name), target="ort-cuda")
    assert result.report.to_dict()["target"] == "ort-cuda"
    nodes = _fused_nodes(result.model)
    assert len(nodes) == 2
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["activation_type"] == b"swiglu" and attrs["k"] == 2
        assert attrs["swiglu_fusion"] == 1
        assert "weights_prepacked" not in attrs  # a QMoE attribute; MoE has none
    _check_nodes(result.model, "float16", "ort-cuda", 2)
