"""Every fused sample and torch export verifies; every near miss comes out unchanged.

The original runs on the reference path; the fused model on the WebGPU kernels and in ONNX
Runtime (where ORT has every kernel: not MatMulNBitsQkv).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from onnx_moe_fuse import fuse
from onnx_moe_fuse.samples import all_samples
from onnx_moe_fuse.verify.checker import verify

SAMPLES = all_samples(kind="all")
FUSING = [s for s in SAMPLES if s.expected]
NEAR_MISSES = [s for s in SAMPLES if not s.expected]


@pytest.mark.parametrize("sample", FUSING, ids=[s.name for s in FUSING])
def test_fused_sample_verifies_on_every_path(device, sample):
    # MatMulNBitsQkv has a kernel in onnxruntime-webgpu only: the QKV samples fuse for it
    result = fuse(sample.model, target="ort-webgpu" if sample.kind == "qkv" else "ort-cpu")
    assert sorted((op, n) for op, n in _counts(result).items()) == sorted(sample.expected)
    report = verify(sample.model, result.model, seeds=(11, 12))
    assert report.passed, report.summary()
    assert report.paths["wgpu"].status == "passed", report.summary()
    uses_ort = not any(f["op"] == "MatMulNBitsQkv" for f in result.report.fusions)
    assert report.paths["ort"].status == ("passed" if uses_ort else "skipped"), report.summary()


@pytest.mark.parametrize("sample", NEAR_MISSES, ids=[s.name for s in NEAR_MISSES])
def test_near_miss_is_left_unchanged_and_explained(sample):
    result = fuse(sample.model, target="ort-webgpu" if sample.kind == "qkv" else "ort-cpu")
    assert not result.report.fusions
    assert result.model.SerializeToString() == sample.model.SerializeToString()
    reasons = " | ".join(m["reason"] for m in result.report.near_misses).lower()
    assert sample.near_miss_reason.lower() in reasons, reasons


def _counts(result) -> dict[str, int]:
    counts: dict[str, int] = {}
    for f in result.report.fusions:
        counts[f["op"]] = counts.get(f["op"], 0) + 1
    return counts


EXPORTS = sorted(
    (Path(__file__).resolve().parents[2] / "sample_models" / "exported").glob("*_batched_mm*.onnx")
)


@pytest.mark.parametrize("path", EXPORTS, ids=[p.stem for p in EXPORTS])
def test_torch_export_fuses_and_verifies(device, path):
    original = onnx.load(path)
    result = fuse(original)
    assert [f["op"] for f in result.report.fusions] == ["MoE"]
    report = verify(original, result.model, seeds=(21,), dim_values={"s0": 7, "batch": 7})
    assert report.passed, report.summary()
    assert {p.status for p in report.paths.values()} == {"passed"}, report.summary()


def test_without_onnxruntime_the_ort_path_is_skipped_with_the_reason(device, monkeypatch):
    import sys

    sample = [s for s in FUSING if s.name == "mixtral_dec_int4b32"][0]
    fused = fuse(sample.model).model
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import now raises ImportError
    report = verify(sample.model, fused, seeds=(1,))
    assert report.passed, report.summary()
    assert report.paths["ort"].status == "skipped"
    assert "onnxruntime is not installed" in report.paths["ort"].reason
