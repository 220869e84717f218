"""The (op, activation dtype) pairs ``contract.targets`` records for ort-cpu, measured live.

``scripts/measure_half_kernels.py`` builds one MoE and one QMoE node (4-bit and 8-bit) per
dtype (float32, float16, bfloat16), runs each on the installed ORT's CPU provider and compares
with a float64 numpy reference of the same rounded inputs. Here it runs on ORT 1.32 CPU (this
venv): a pair runs exactly when the ort-cpu contract lists the dtype for the op, and what runs
is right (float32 to 1e-6, float16 to 2e-3 of the output's scale). The same script run in
``.venv-webgpu`` gave onnxruntime-webgpu 1.27's CPU provider the same answers (docs/targets.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import onnxruntime
import pytest

from onnx_moe_fuse.contract.targets import CONTRACTS, target_named

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "measure_half_kernels.py"
TOLERANCE = {"float32": 1e-6, "float16": 2e-3}


def _measure() -> list[dict]:
    spec = importlib.util.spec_from_file_location("measure_half_kernels", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measure()


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    if not onnxruntime.__version__.startswith("1.32"):
        pytest.skip(f"measured on ORT 1.32 CPU; this is {onnxruntime.__version__}")
    return _measure()


def test_every_op_and_dtype_is_measured(cases: list[dict]) -> None:
    pairs = {(c["op"], c["dtype"]) for c in cases}
    assert pairs == {
        (op, dt) for op in ("MoE", "QMoE4", "QMoE8") for dt in ("float32", "float16", "bfloat16")
    }


def test_ort_cpu_runs_exactly_the_contracts_dtypes(cases: list[dict]) -> None:
    for case in cases:
        op = "MoE" if case["op"] == "MoE" else "QMoE"
        listed = case["dtype"] in CONTRACTS["ort-cpu"][op].dtypes
        assert case["runs"] == listed, case
        if case["runs"]:
            assert case["max_rel_err"] <= TOLERANCE[case["dtype"]], case


def test_bfloat16_is_refused_on_ort_cpu_naming_target_and_dtype(cases: list[dict]) -> None:
    errors = {c["op"]: c.get("error", "") for c in cases if c["dtype"] == "bfloat16"}
    assert "NOT_IMPLEMENTED" in errors["MoE"]
    assert "bfloat16 QMoE requires a shared layout" in errors["QMoE4"]
    for op in ("MoE", "QMoE"):
        reason = target_named("ort-cpu").refusal(op, "swiglu", "bfloat16")
        assert reason is not None and "ort-cpu" in reason and "bfloat16" in reason
        assert "ort-cuda" in reason  # the alternative: CUDA registers both in bfloat16
