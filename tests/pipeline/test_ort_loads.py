"""Every fused sample loads (and runs) in the ORT package of its target.

* ``ort-cpu``: onnxruntime 1.32 CPU (this venv) runs every sample fused for ort-cpu, and its
  outputs match the original's on the reference path (the checker's ``ort`` path).
* ``ort-webgpu``: onnxruntime-webgpu 1.27 (its own venv, ``.venv-webgpu`` or
  ``ORT_WEBGPU_PYTHON``: it installs as ``onnxruntime`` too) loads every sample fused for
  ort-webgpu with its CPU provider, which checks the same com.microsoft schema (Debian's Mesa
  lavapipe gives its WebGPU provider no adapter), and runs those it has CPU kernels for, which
  must match the reference; MatMulNBitsQkv (a WebGPU kernel only) is schema-checked only. As a
  control, a QMoE fused for ort-cpu (``weights_prepacked``, ``accuracy_level``) is refused.

On CI the webgpu venv must exist; elsewhere its tests are skipped with the reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from webgpu_jobs import ROOT, run_webgpu_job, webgpu_python

from onnx_moe_fuse.pipeline import FusionReport, fusion_pipeline
from onnx_moe_fuse.samples import all_samples
from onnx_moe_fuse.verify.checker import ort_inexact_reasons, verify
from onnx_moe_fuse.verify.reference import random_feeds, run_reference

FUSING = [s for s in all_samples(kind="all") if s.expected]


def _fused(sample, target: str) -> tuple[onnx.ModelProto, FusionReport]:
    model = ir.serde.deserialize_model(sample.model)
    report = FusionReport()
    fusion_pipeline(report, None, target)(model)
    return ir.serde.serialize_model(model), report


def _webgpu_python() -> str:
    return webgpu_python()


@pytest.mark.parametrize("sample", FUSING, ids=[s.name for s in FUSING])
def test_fused_for_cpu_runs_in_onnxruntime_cpu(sample):
    pytest.importorskip("onnxruntime")
    fused, report = _fused(sample, "ort-cpu")
    assert not any(n.op_type == "MatMulNBitsQkv" for n in fused.graph.node)
    result = verify(sample.model, fused, seeds=(3,), paths=("ort",))
    assert result.paths["ort"].status == "passed", result.summary()


def _webgpu_job(tmp_path: Path, models: dict[str, onnx.ModelProto]) -> dict:
    return run_webgpu_job(tmp_path, models, {n: random_feeds(m, 7) for n, m in models.items()})


def test_every_sample_fused_for_webgpu_loads_in_onnxruntime_webgpu(tmp_path):
    _webgpu_python()  # skip early, before fusing
    models, originals = {}, {}
    for sample in FUSING:
        fused, report = _fused(sample, "ort-webgpu")
        if report.fusions:  # a float MoE layer is left as it was for ort-webgpu
            models[sample.name] = fused
            originals[sample.name] = sample.model
    assert len(models) >= 20
    results = _webgpu_job(tmp_path, models)
    assert results.pop("onnxruntime") == "1.27.0"
    failed = {k: v["error"] for k, v in results.items() if v["status"] == "failed"}
    assert not failed, failed
    for name, result in results.items():
        has_qkv = any(n.op_type == "MatMulNBitsQkv" for n in models[name].graph.node)
        assert result["status"] == ("schema-only" if has_qkv else "ran"), (name, result)
        if has_qkv:
            continue
        got = dict(np.load(tmp_path / f"{name}.out.npz"))
        feeds = dict(np.load(tmp_path / f"{name}.in.npz"))
        want = run_reference(originals[name], feeds)
        rtol = 5e-2 if ort_inexact_reasons(models[name]) else 1e-4
        for out, ref in want.items():
            err = float(np.max(np.abs(got[out].astype(np.float64) - ref)))
            assert err <= max(rtol * float(np.max(np.abs(ref))), 1e-6), (name, out, err)


def test_onnxruntime_webgpu_refuses_the_cpu_attribute_set(tmp_path):
    """The control: why ort-webgpu needs its own attribute set (the fact is re-measured)."""
    _webgpu_python()
    sample = next(s for s in FUSING if s.name == "mixtral_dec_int4b32")
    fused, _ = _fused(sample, "ort-cpu")
    results = _webgpu_job(tmp_path, {"cpu_qmoe": fused})
    error = results["cpu_qmoe"]["error"]
    assert results["cpu_qmoe"]["status"] == "failed"
    assert "unknown attributes ['accuracy_level', 'weights_prepacked']" in error
    assert "Unrecognized attribute" in error.partition("ORT: ")[2]  # ORT's own schema check


def test_a_float_layer_quantised_for_webgpu_runs_in_onnxruntime_webgpu(tmp_path):
    """--quantize int4 --target ort-webgpu: the QMoE node loads and computes its oracle there."""
    _webgpu_python()
    from onnx_moe_fuse import fuse

    sample = next(s for s in FUSING if s.name == "mixtral_dec_f32")
    fused = fuse(sample.model, quantize="int4", target="ort-webgpu").model
    results = _webgpu_job(tmp_path, {"quantized": fused})
    assert results["quantized"]["status"] == "ran", results
    got = dict(np.load(tmp_path / "quantized.out.npz"))
    want = run_reference(fused, dict(np.load(tmp_path / "quantized.in.npz")))  # the QMoE oracle
    for out, ref in want.items():
        assert np.max(np.abs(got[out] - ref)) <= 1e-4 * np.max(np.abs(ref)), out


def _float16_qmoe_twins() -> dict[str, tuple[onnx.ModelProto, onnx.ModelProto]]:
    """Float16 twins of the hand-written SwiGLU QMoE layers: ``{name: (original, fused)}``.

    Fused for ort-webgpu; the original retyped wholesale (``sample_models/upcast.py``).
    """
    import importlib.util

    from onnx_moe_fuse import fuse
    from onnx_moe_fuse.samples.handwritten import HANDWRITTEN

    spec = importlib.util.spec_from_file_location("upcast", ROOT / "sample_models" / "upcast.py")
    assert spec is not None and spec.loader is not None
    upcast = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upcast)
    out = {}
    for name, build in HANDWRITTEN.items():
        layer = build()
        if getattr(layer.expected, "op", None) != "QMoE":
            continue
        model = upcast.retype_floats(layer.model, onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
        fused = fuse(model, target="ort-webgpu")
        if fused.report.fusions:
            out[f"{name}_fp16"] = (model, fused.model)
    return out


def test_float16_qmoe_fused_for_webgpu_runs_in_onnxruntime_webgpu(tmp_path):
    """float16 QMoE (float16 scales and router inputs) loads and runs in onnxruntime-webgpu 1.27.

    On its CPU provider (the WebGPU provider finds no adapter here), against the float16
    original run in ORT 1.32 CPU (this venv), within float16's tolerance.
    """
    _webgpu_python()
    twins = _float16_qmoe_twins()
    assert len(twins) >= 3
    results = _webgpu_job(tmp_path, {name: fused for name, (_, fused) in twins.items()})
    assert results.pop("onnxruntime") == "1.27.0"
    from onnx_moe_fuse.verify.ort_nodes import session

    for name, result in results.items():
        assert result["status"] == "ran", (name, result)
        got = dict(np.load(tmp_path / f"{name}.out.npz"))
        feeds = dict(np.load(tmp_path / f"{name}.in.npz"))
        want = dict(zip([o.name for o in twins[name][0].graph.output],
                        session(twins[name][0]).run(None, feeds), strict=True))  # fmt: skip
        for out, ref in want.items():
            ref = ref.astype(np.float64)
            err = float(np.max(np.abs(got[out].astype(np.float64) - ref)))
            assert err <= 5e-3 * float(np.max(np.abs(ref))), (name, out, err)
