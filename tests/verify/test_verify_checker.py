"""Tests of the equivalence checker (``onnx_moe_fuse.verify.checker``).

Fused models are built by hand from a sample's weights (router MatMul + one MoE/QMoE node, the
sample's interface kept), the way ``tests/samples/test_samples.py`` builds one-node models. A
correct fusion must verify (the ORT path runs; the wgpu path runs where the kernel package is
installed and is otherwise skipped with a reason naming it); a deliberately wrong one must fail
loudly, naming the path, output, seed and error.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir
import pytest
from helpers import expert_operands, initializer
from onnx import helper, numpy_helper

from onnx_moe_fuse.kernels.runtime import get_kernel
from onnx_moe_fuse.samples import Sample, get_sample
from onnx_moe_fuse.verify.checker import (
    ORT_INT8_ACTIVATION_RTOL,
    VerificationError,
    ort_unsupported_reason,
    verify,
)
from onnx_moe_fuse.verify.oracles.quant import quantize_symmetric
from onnx_moe_fuse.verify.ort_nodes import make_model

_MS = "com.microsoft"


def _seeds(rng: np.random.Generator, n: int = 2) -> tuple[int, ...]:
    return tuple(int(s) for s in rng.integers(0, 2**31, n))


def fused_model(sample: Sample, op: str, **overrides: object) -> onnx.ModelProto:
    """``y = op(x, x @ router_weight (+ router_bias))`` with ``sample``'s experts and biases."""
    m = sample.model
    names = {t.name for t in m.graph.initializer}
    attrs = {**sample.expected_attributes, **overrides}
    bits = None if op == "MoE" else int(attrs["expert_weight_bits"])  # type: ignore[call-overload]
    inits = {"router_weight": initializer(m, "router_weight")}
    inputs = ["x", "logits"]
    for key, value in expert_operands(m, op, bits).items():
        inputs.append("" if value is None else key)
        if value is not None:
            inits[key] = value
    while inputs[-1] == "":
        inputs.pop()
    nodes = [helper.make_node("MatMul", ["x", "router_weight"], ["logits"], name="router")]
    if "router_bias" in names:
        inits["router_bias"] = initializer(m, "router_bias")
        nodes[0].output[0] = "logits_unbiased"
        nodes.append(helper.make_node("Add", ["logits_unbiased", "router_bias"], ["logits"]))
    nodes.append(helper.make_node(op, inputs, ["y"], name="moe_fused", domain=_MS, **attrs))
    initializers = [numpy_helper.from_array(v, k) for k, v in inits.items()]
    return make_model(nodes, m.graph.input, m.graph.output, initializers, name="fused")


def _perturbed(model: onnx.ModelProto, name: str, factor: float) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for i, t in enumerate(out.graph.initializer):
        if t.name == name:
            arr = numpy_helper.to_array(t)
            out.graph.initializer[i].CopyFrom(numpy_helper.from_array(arr * factor, name))
            return out
    raise KeyError(name)


def _kernel_missing(op: str) -> str | None:
    try:
        get_kernel(op)
    except KeyError as exc:
        return str(exc)
    return None


def _check_wgpu(report_dict: dict, op: str, package: str, expect: str) -> None:
    """The wgpu path ran with the expected status, or was skipped naming the missing package."""
    wgpu = report_dict["paths"]["wgpu"]
    if _kernel_missing(op) is None:
        assert wgpu["status"] == expect, wgpu
    else:
        assert wgpu["status"] == "skipped"
        assert package in wgpu["reason"] and "not installed" in wgpu["reason"]


@pytest.mark.parametrize(
    ("name", "op", "package"),
    [
        ("mixtral_dec_int4b32", "QMoE", "kernels/qmoe"),
        ("gptoss_dec_u8pc", "QMoE", "kernels/qmoe"),
        ("mixtral_dec_f32", "MoE", "kernels/moe"),
        ("gptoss_dec_f32", "MoE", "kernels/moe"),
    ],
)
def test_correct_fusion_verifies(name: str, op: str, package: str, device, rng) -> None:
    sample = get_sample(name)
    seeds = _seeds(rng)
    report = verify(sample.model, fused_model(sample, op), seeds=seeds, dim_values={"T": 6})
    d = report.to_dict()
    assert report.passed, report.summary()
    assert d["passed"] is True and d["seeds"] == list(seeds) and d["dim_values"] == {"T": 6}
    assert d["paths"]["ort"]["status"] == "passed", d["paths"]["ort"]
    y = d["paths"]["ort"]["outputs"]["y"]
    assert y["max_rel"] <= 1e-4 and y["rtol"] == 1e-4 and len(y["per_seed"]) == len(seeds)
    _check_wgpu(d, f"{_MS}.{op}", package, "passed")
    json.dumps(d, allow_nan=False)


@pytest.mark.parametrize(
    ("name", "op", "wrong"),
    [
        ("mixtral_dec_f32", "MoE", {"normalize_routing_weights": 0}),
        ("mixtral_dec_f32", "MoE", {"perturb": ("w2", 1.001)}),
        ("mixtral_dec_int4b32", "QMoE", {"perturb": ("s2", 1.001)}),
        ("gptoss_dec_int4b32", "QMoE", {"swiglu_limit": 9.0}),
        ("qwen2_dec_f32", "MoE", {}),  # the fused model drops the sample's shared expert
    ],
)
def test_wrong_fusion_fails_loudly(name: str, op: str, wrong: dict, device, rng) -> None:
    sample = get_sample(name)
    overrides = {k: v for k, v in wrong.items() if k != "perturb"}
    fused = fused_model(sample, op, **overrides)
    if "perturb" in wrong:
        fused = _perturbed(fused, *wrong["perturb"])
    seeds = _seeds(rng)
    report = verify(sample.model, fused, seeds=seeds)
    assert not report.passed
    ort = report.paths["ort"]
    assert ort.status == "failed" and not ort.outputs["y"].passed
    assert ort.outputs["y"].max_rel > 1e-4
    ort_messages = [m for m in report.messages if m.startswith("FAILED ort: output 'y', seed")]
    assert ort_messages, report.messages
    assert any(f"seed {seeds[0]}" in m or f"seed {seeds[1]}" in m for m in ort_messages)
    assert all("max abs error" in m and "max rel error" in m for m in ort_messages)
    _check_wgpu(report.to_dict(), f"{_MS}.{op}", f"kernels/{op.lower()}", "failed")
    with pytest.raises(VerificationError, match=r"FAILED ort: output 'y'"):
        report.raise_for_failure()
    assert "verification FAILED" in str(report)


def test_wgpu_path_catches_a_wrong_grouped_matmul_model(device, rng) -> None:
    """The wgpu path runs today (GroupedMatMul kernel); ORT cannot take opset 29 and says so."""
    sample = get_sample("mixtral_gmm_f32")
    fc2 = next(t.name for t in sample.model.graph.initializer if t.name.startswith("fc2"))
    seeds = _seeds(rng)
    good = verify(sample.model, sample.model, seeds=seeds)
    assert good.passed, good.summary()
    assert good.paths["wgpu"].status == "passed"
    assert good.paths["ort"].status == "skipped"
    assert "GroupedMatMul" in (good.paths["ort"].reason or "")
    bad = verify(sample.model, _perturbed(sample.model, fc2, 1.001), seeds=seeds)
    assert not bad.passed and bad.paths["wgpu"].status == "failed"
    assert any(m.startswith("FAILED wgpu: output 'y', seed") for m in bad.messages)


def _qmoe_8bit_blockwise(rng: np.random.Generator) -> onnx.ModelProto:
    e, h, i = 4, 64, 32
    w1, s1 = quantize_symmetric(rng.standard_normal((e, 2 * i, h)) * 0.1, 8, 32)
    w2, s2 = quantize_symmetric(rng.standard_normal((e, h, i)) * 0.1, 8, 32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (s1, "s1"), (w2, "w2"))]
    inits.append(numpy_helper.from_array(s2, "s2"))
    node = helper.make_node(
        "QMoE",
        ["x", "logits", "w1", "s1", "", "w2", "s2"],
        ["y"],
        name="q8",
        domain=_MS,
        k=2,
        activation_type="swiglu",
        swiglu_fusion=1,
        expert_weight_bits=8,
        block_size=32,
        normalize_routing_weights=1,
        activation_alpha=1.0,
        activation_beta=0.0,
    )
    f32 = onnx.TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("x", f32, ["T", h]),
        helper.make_tensor_value_info("logits", f32, ["T", e]),
    ]
    outputs = [helper.make_tensor_value_info("y", f32, ["T", h])]
    return make_model([node], inputs, outputs, inits, name="q8")


def test_ort_blockwise_8bit_qmoe_gets_a_looser_tolerance_and_says_why(rng) -> None:
    """ORT CPU quantises activations for block-wise 8-bit QMoE: 1-2% off the exact oracle."""
    model = _qmoe_8bit_blockwise(rng)
    seeds = _seeds(rng, 3)
    report = verify(model, model, seeds=seeds, paths=("ort",), dim_values={"T": 16})
    ort = report.paths["ort"]
    assert report.passed, report.summary()
    assert ort.outputs["y"].rtol == ORT_INT8_ACTIVATION_RTOL
    assert 1e-3 < ort.outputs["y"].max_rel < ORT_INT8_ACTIVATION_RTOL  # really inexact
    assert any("block-wise 8-bit" in n and "'q8'" in n for n in ort.tolerance_notes)
    strict = verify(model, model, seeds=seeds, paths=("ort",), dim_values={"T": 16}, rtol=1e-4)
    assert not strict.passed
    assert any("given by the caller" in n for n in strict.paths["ort"].tolerance_notes)


def test_structural_mismatches_fail(rng) -> None:
    sample = get_sample("mixtral_dec_f32")
    fused = fused_model(sample, "MoE")
    seeds = _seeds(rng, 1)
    renamed = onnx.ModelProto()
    renamed.CopyFrom(fused)
    renamed.graph.output[0].name = "z"
    renamed.graph.node[-1].output[0] = "z"
    r = verify(sample.model, renamed, seeds=seeds, paths=("ort",))
    assert not r.passed and "lacks graph outputs ['y']" in r.paths["ort"].reason
    extra = onnx.ModelProto()
    extra.CopyFrom(fused)
    extra.graph.input.append(helper.make_tensor_value_info("mask", onnx.TensorProto.FLOAT, [1]))
    r = verify(sample.model, extra, seeds=seeds, paths=("ort",))
    assert not r.passed and "needs inputs ['mask']" in r.paths["ort"].reason
    double = onnx.ModelProto()
    double.CopyFrom(fused)
    double.graph.node[-1].output[0] = "y32"
    double.graph.node.append(helper.make_node("Cast", ["y32"], ["y"], to=onnx.TensorProto.DOUBLE))
    double.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    r = verify(sample.model, double, seeds=seeds, paths=("ort",))
    assert not r.passed and "float64" in (r.paths["ort"].outputs["y"].problem or "")


def test_no_path_ran_is_not_a_pass(rng) -> None:
    sample = get_sample("mixtral_gmm_f32")
    r = verify(sample.model, sample.model, seeds=_seeds(rng, 1), paths=("ort",))
    assert r.paths["ort"].status == "skipped"
    assert not r.passed and "no evaluation path could run" in r.messages[-1]


def test_inputs_as_paths_and_ir_models(tmp_path: Path, rng) -> None:
    sample = get_sample("mixtral_dec_int4b32")
    path = tmp_path / "fused.onnx"
    onnx.save_model(fused_model(sample, "QMoE"), path)
    r = verify(onnx_ir.from_proto(sample.model), path, seeds=_seeds(rng, 1), paths=("ort",))
    assert r.passed, r.summary()


def test_bad_arguments() -> None:
    m = get_sample("mixtral_dec_f32").model
    with pytest.raises(ValueError, match="unknown evaluation paths"):
        verify(m, m, paths=("cuda",))
    with pytest.raises(ValueError, match="at least one seed"):
        verify(m, m, seeds=())


def test_missing_kernel_package_skips_wgpu_with_reason(monkeypatch, rng) -> None:
    """While kernels/qmoe is not installed, the wgpu path is skipped and says so; ORT runs."""
    from onnx_moe_fuse.verify import evaluator

    real = evaluator.get_kernel

    def without_qmoe(name: str, *args, **kwargs):
        if name == f"{_MS}.QMoE":
            raise KeyError(f"no kernel package {name!r} version 1 (have: GroupedMatMul v1)")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(evaluator, "get_kernel", without_qmoe)
    sample = get_sample("mixtral_dec_int4b32")
    report = verify(sample.model, fused_model(sample, "QMoE"), seeds=_seeds(rng, 1))
    wgpu = report.paths["wgpu"]
    assert wgpu.status == "skipped" and "kernels/qmoe" in (wgpu.reason or "")
    assert "com.microsoft.QMoE is not installed" in (wgpu.reason or "")
    assert report.paths["ort"].status == "passed" and report.passed, report.summary()
    assert "wgpu: skipped: " in report.summary()


def test_ort_is_skipped_where_it_has_no_cpu_kernel() -> None:
    node = helper.make_node("MatMulNBitsQkv", ["a"], ["q"], name="qkv", domain=_MS)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("q", onnx.TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(_MS, 1)])
    reason = ort_unsupported_reason(model)
    assert reason == "ORT has no CPU kernel for com.microsoft.MatMulNBitsQkv"
    assert ort_unsupported_reason(get_sample("mixtral_dec_f32").model) is None


# -- models the fuser leaves com.microsoft ops in; inputs too large to make -------------------


def _with_matmul_nbits(sample: Sample, rng: np.random.Generator) -> onnx.ModelProto:
    """``sample``'s layer, then ``z = MatMulNBits(y)`` (what ORT's MatMulNBitsQuantizer writes)."""
    from onnx_moe_fuse.verify.oracles.quant import quantize_matmul_nbits

    model = onnx.ModelProto()
    model.CopyFrom(sample.model)
    hidden = model.graph.output[0].type.tensor_type.shape.dim[-1].dim_value
    b, scales = quantize_matmul_nbits(rng.standard_normal((48, hidden)) * 0.2, 4, 32)
    model.graph.initializer.extend(
        [numpy_helper.from_array(b, "proj_B"), numpy_helper.from_array(scales, "proj_scales")]
    )
    model.graph.node.append(
        helper.make_node(
            "MatMulNBits",
            ["y", "proj_B", "proj_scales"],
            ["z"],
            name="/proj/MatMul_Q4",
            domain=_MS,
            K=hidden,
            N=48,
            bits=4,
            block_size=32,
            accuracy_level=0,
        )
    )
    out = onnx.ValueInfoProto()
    out.CopyFrom(model.graph.output[0])
    out.name = "z"
    out.type.tensor_type.shape.dim[-1].dim_value = 48
    model.graph.output.append(out)
    model.opset_import.append(helper.make_opsetid(_MS, 1))
    return model


def test_a_model_with_unfused_matmul_nbits_verifies_on_every_path(device, rng, tmp_path):
    from onnx_moe_fuse.cli import main
    from onnx_moe_fuse.pipeline import FusionReport, fusion_pipeline

    original = _with_matmul_nbits(get_sample("mixtral_dec_int4b32"), rng)
    model = onnx_ir.serde.deserialize_model(original)
    report = FusionReport()
    fusion_pipeline(report)(model)
    fused = onnx_ir.serde.serialize_model(model)
    assert [f["op"] for f in report.fusions] == ["QMoE"]
    assert [n.op_type for n in fused.graph.node if n.domain == _MS] == ["QMoE", "MatMulNBits"]
    result = verify(original, fused, seeds=_seeds(rng, 1))
    assert result.passed, result.summary()
    assert {p.status for p in result.paths.values()} == {"passed"}, result.summary()
    path = tmp_path / "quantized.onnx"
    onnx.save(original, path)
    assert main([str(path), "-o", str(tmp_path / "fused.onnx"), "--verify"]) == 0


def test_random_inputs_over_the_limit_are_refused_before_they_are_made():
    from onnx_moe_fuse.errors import MoEFuseError
    from onnx_moe_fuse.verify.reference import MAX_FEED_BYTES, FeedTooLargeError, random_feeds

    x = helper.make_tensor_value_info("tokens", onnx.TensorProto.FLOAT, [100_000_000, 64])
    y = helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [100_000_000, 64])
    model = make_model([helper.make_node("Relu", ["tokens"], ["out"])], [x], [y])
    with pytest.raises(FeedTooLargeError, match=r"input 'tokens' of shape \[100000000, 64\]") as e:
        verify(model, model, seeds=(0,))
    assert "25.6 GB" in str(e.value) and e.value.input_name == "tokens"
    assert isinstance(e.value, ValueError) and isinstance(e.value, MoEFuseError)
    assert e.value.nbytes == 100_000_000 * 64 * 4
    small = helper.make_tensor_value_info("tokens", onnx.TensorProto.FLOAT, [1024, 64])
    model = make_model([helper.make_node("Relu", ["tokens"], ["out"])], [small], [y])
    assert random_feeds(model, 0)["tokens"].shape == (1024, 64)
    with pytest.raises(FeedTooLargeError):
        random_feeds(model, 0, max_bytes=1024 * 64 * 4 - 1)
    assert MAX_FEED_BYTES == 256 * 2**20
