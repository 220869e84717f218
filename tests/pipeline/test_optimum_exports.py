"""The optimum-onnx style exports (sample_models/export_optimum_style.py) fuse and match PyTorch.

optimum-onnx exports its own MoE forwards: Qwen3-MoE as a loop over all experts (NonZero per
expert, gather, scatter-add; the TorchScript export, with and without renormalisation, and the
same module through torch.onnx's dynamo exporter), gpt-oss as the dense all-experts form (every
expert on tokens ``Tile``d E times, a ``ScatterElements`` mask, the combine over ``[E, B, S, H]``
with targets computed from ``Shape``). The expert-loop pass proves each loop on its own and keeps
the numbers (the canonicalised working copy, GroupedMatMul decomposed, against the stored PyTorch
output); ``fuse`` then writes one MoE per layer that ONNX Runtime runs within 1e-4 of PyTorch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import decompose_grouped_matmul

import onnx_moe_fuse
from onnx_moe_fuse.rewrites.canonical.experts.loops.expert_loop import expert_loop_refusals
from onnx_moe_fuse.rewrites.canonical.passes import canonicalisation_passes

OPTIMUM = Path(__file__).resolve().parents[2] / "sample_models" / "exported" / "optimum"
LOOPS = ["qwen3_moe_optimum", "qwen3_moe_optimum_no_norm", "qwen3_moe_optimum_dynamo"]


def _run(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"hidden_states": x})[0]


def _reference(name: str) -> tuple[np.ndarray, np.ndarray]:
    data = np.load(OPTIMUM / f"{name}.npz")
    return data["hidden_states"], data["output"]


@pytest.mark.parametrize("name", LOOPS)
def test_loop_is_proved_and_the_canonical_copy_keeps_the_numbers(name: str):
    model = ir.load(OPTIMUM / f"{name}.onnx")
    passes = canonicalisation_passes()
    loop_at = next(i for i, p in enumerate(passes) if type(p).__name__ == "CanonicalExpertLoopPass")
    for p in passes[:loop_at]:
        p(model)
    assert expert_loop_refusals(model) == []
    assert passes[loop_at](model).modified
    assert not any(n.op_type == "NonZero" for n in model.graph)
    x, want = _reference(name)
    got = _run(decompose_grouped_matmul(model).SerializeToString(), x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("name", [*LOOPS, "gpt_oss_optimum"])
def test_export_fuses_into_one_moe_that_matches_pytorch(name: str):
    result = onnx_moe_fuse.fuse(OPTIMUM / f"{name}.onnx")
    assert [f["op"] for f in result.report.fusions] == ["MoE"], result.report.near_misses
    x, want = _reference(name)
    got = _run(result.model.SerializeToString(), x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def _loop_pass_on_canonical_copy(path: Path) -> tuple[ir.Model, bytes, object]:
    model = ir.load(path)
    passes = canonicalisation_passes()
    loop_at = next(i for i, p in enumerate(passes) if type(p).__name__ == "CanonicalExpertLoopPass")
    for p in passes[:loop_at]:
        p(model)
    before = ir.serde.serialize_model(model).SerializeToString()
    return model, before, passes[loop_at](model)


def test_loop_pass_leaves_the_dense_export_alone():
    model, before, result = _loop_pass_on_canonical_copy(OPTIMUM / "gpt_oss_optimum.onnx")
    assert not result.modified
    assert ir.serde.serialize_model(model).SerializeToString() == before
    assert expert_loop_refusals(model) == []


def test_loop_pass_refuses_the_trace_of_transformers_eager_loop():
    # transformers' own eager loop, traced: a one-hot of E + 1 classes, the hit experts only
    path = OPTIMUM.parent / "mixtral_eager_torchscript.onnx"
    model, before, result = _loop_pass_on_canonical_copy(path)
    assert not result.modified
    assert ir.serde.serialize_model(model).SerializeToString() == before
    [(_, reason)] = expert_loop_refusals(model)
    assert "the one-hot has 5 experts" in reason and "4 router scores" in reason


def test_dense_export_whose_expert_count_escapes_is_refused_and_left_as_it_was(tmp_path):
    # Shape(dense)[1], the expert count, also a graph output: the dense weights then have a
    # second reader that outlives the layer, and the layer is refused as a whole
    model = ir.load(OPTIMUM / "gpt_oss_optimum.onnx")
    count = next(v for n in model.graph for v in n.outputs if v.name == "/Gather_2_output_0")
    count.dtype, count.shape = ir.DataType.INT64, ir.Shape([])
    model.graph.outputs.append(count)
    path = tmp_path / "escaping_count.onnx"
    ir.save(model, path)
    before = path.read_bytes()
    result = onnx_moe_fuse.fuse(path)
    assert result.report.fusions == []
    [miss] = result.report.near_misses
    assert miss["part"] == "combine" and "/ScatterElements_output_0" in miss["reason"]
    assert (
        result.model.SerializeToString() == onnx.load_model_from_string(before).SerializeToString()
    )
