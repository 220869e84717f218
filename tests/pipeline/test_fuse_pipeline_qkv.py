"""The whole pipeline (``fuse``) on the QKV samples: MatMulNBitsQkv next to the MoE rules.

MatMulNBitsQkv has a kernel in onnxruntime-webgpu only, so these fuse for ``ort-webgpu``; for the
default target (ort-cpu) a prelude keeps its composition (``tests/pipeline/test_pipeline_targets.py``).
"""

from __future__ import annotations

import collections

import pytest

from onnx_moe_fuse import fuse
from onnx_moe_fuse.samples import all_samples, get_sample
from onnx_moe_fuse.verify.checker import verify

QKV = all_samples(kind="qkv")


@pytest.mark.parametrize("sample", QKV, ids=[s.name for s in QKV])
def test_fuse_gives_what_the_sample_records(sample):
    result = fuse(sample.model, target="ort-webgpu")
    ops = collections.Counter(f["op"] for f in result.report.fusions)
    assert sorted(ops.items()) == sorted(sample.expected)
    if not sample.expected:
        assert result.model.SerializeToString() == sample.model.SerializeToString()
        reasons = " | ".join(m["reason"] for m in result.report.near_misses).lower()
        assert sample.near_miss_reason.lower() in reasons
    else:
        (fusion,) = result.report.fusions
        assert fusion["rule"].startswith("MatMulNBitsQkv[")
        assert set(fusion["attributes"]) >= {"K", "Nq", "Nkv", "bits", "block_size", "epsilon"}


def test_fused_qkv_verifies_on_the_kernels(device):
    sample = get_sample("qkv_skip_sln_nbits_residual_rank3")
    result = fuse(sample.model, target="ort-webgpu")
    report = verify(sample.model, result.model, seeds=(5,))
    assert report.passed, report.summary()
    assert report.paths["ort"].status == "skipped"  # no CPU MatMulNBitsQkv in ORT


def test_only_moe_leaves_qkv_alone_and_only_qkv_leaves_moe_alone():
    qkv_sample = get_sample("qkv_decomposed_nbits")
    assert not fuse(qkv_sample.model, only={"MoE", "QMoE"}).report.fusions
    assert fuse(qkv_sample.model, only={"MatMulNBitsQkv"}, target="ort-webgpu").report.fusions
    moe_sample = get_sample("mixtral_dec_int4b32")
    assert not fuse(moe_sample.model, only={"MatMulNBitsQkv"}, target="ort-webgpu").report.fusions
