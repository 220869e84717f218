"""Asymmetric DequantizeLinear weights through the pipeline: per target, and under ``--verify``.

ort-cpu takes QMoE zero points (measured, ``tests/verify/oracles/test_oracle_qmoe_zero_points``);
onnxruntime-webgpu's QMoE refuses them (read: NOT_IMPLEMENTED), ORT CUDA honours them block-wise
only (read): ``contract.targets``. A refused layer stays byte-identical with a near miss of part
``target`` naming the target. The wgpu evaluator runs such a node on the oracle and says so.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import rel_err

from onnx_moe_fuse import fuse
from onnx_moe_fuse.contract.targets import target_named
from onnx_moe_fuse.samples.handwritten import HANDWRITTEN
from onnx_moe_fuse.verify import verify
from onnx_moe_fuse.verify.ort_nodes import session

ASYMMETRIC = ["dq_uint4_asym_block32", "dq_int4_asym_channel", "dq_uint4_no_zp_block32"]


def _qmoe(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.op_type == "QMoE"]
    return node


@pytest.mark.parametrize("name", ASYMMETRIC)
def test_ort_cpu_fuses_with_zero_point_inputs(name: str, rng: np.random.Generator) -> None:
    model = HANDWRITTEN[name]().model
    result = fuse(model)
    node = _qmoe(result.model)
    assert len(node.input) == 13 and node.input[11] and node.input[12], list(node.input)
    x = rng.standard_normal((5, model.graph.input[0].type.tensor_type.shape.dim[1].dim_value))
    feeds = {"x": x.astype(np.float32)}
    want = session(model).run(None, feeds)[0]
    assert rel_err(session(result.model).run(None, feeds)[0], want) < 1e-5


def test_symmetric_zero_points_give_no_zero_point_inputs() -> None:
    node = _qmoe(fuse(HANDWRITTEN["dq_uint4_zp8_block32"]().model).model)
    assert len(node.input) <= 8, list(node.input)


@pytest.mark.parametrize("name", ASYMMETRIC)
def test_ort_webgpu_refuses_naming_the_target(name: str) -> None:
    model = HANDWRITTEN[name]().model
    result = fuse(model, target="ort-webgpu")
    assert not result.report.fusions
    assert result.model.SerializeToString() == model.SerializeToString()
    (miss,) = result.report.near_misses
    assert miss["part"] == "target"
    assert "ort-webgpu" in miss["reason"] and "zero points" in miss["reason"]
    assert "target ort-cpu" in miss["reason"]


def test_contract_zero_points_per_target() -> None:
    cpu, cuda, webgpu = (target_named(t) for t in ("ort-cpu", "ort-cuda", "ort-webgpu"))
    for granularity in ("per-channel", "block-wise"):
        assert cpu.refusal("QMoE", "swiglu", "float32", granularity) is None
        assert "zero points" in webgpu.refusal("QMoE", "swiglu", "float32", granularity)
    assert cuda.refusal("QMoE", "swiglu", "float16", "block-wise") is None
    reason = cuda.refusal("QMoE", "swiglu", "float16", "per-channel")
    assert "per-channel" in reason and "target ort-cpu" in reason
    assert webgpu.refusal("QMoE", "swiglu", "float32", None) is None


def test_verify_names_the_nodes_checked_on_the_oracle_only() -> None:
    model = HANDWRITTEN["dq_int4_asym_block16"]().model
    fused = fuse(model).model
    report = verify(model, fused, seeds=(3,))
    assert report.passed, report.summary()
    notes = report.paths["wgpu"].notes
    assert len(notes) == 1 and "reference path's numpy oracle" in notes[0], notes
    assert "fc1_zero_points" in notes[0] and "QMoE" in notes[0]
    assert report.paths["ort"].status == "passed"
    assert "oracle" in report.summary()
    # a symmetric layer runs on the kernel: no note
    sym = HANDWRITTEN["dq_uint4_zp8_block32"]().model
    assert verify(sym, fuse(sym).model, seeds=(3,)).paths["wgpu"].notes == []
