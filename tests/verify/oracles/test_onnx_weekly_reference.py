"""GroupedMatMul kernel against onnx-weekly's own reference implementation (opset 29).

onnx-weekly lives in its own venv (``ONNX_WEEKLY_PYTHON``; the README's test command
makes ``.venv-weekly``) because onnxscript pins the released onnx, which has no opset 29.
On CI the venv must exist; elsewhere the test is skipped without it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from onnx_moe_fuse.kernels.cases import load_cases
from onnx_moe_fuse.kernels.runtime import get_kernel, package_folders

ON_CI = os.environ.get("CI", "").lower() == "true"
SCRIPT = Path(__file__).with_name("weekly_grouped_matmul.py")


def _weekly_python() -> str:
    python = os.environ.get("ONNX_WEEKLY_PYTHON") or str(
        Path(__file__).resolve().parents[3] / ".venv-weekly" / "bin" / "python"
    )
    if not Path(python).is_file():
        if ON_CI:
            pytest.fail(f"onnx-weekly venv missing on CI: {python}")
        pytest.skip(
            "no onnx-weekly venv (run scripts/bootstrap.sh test, or set ONNX_WEEKLY_PYTHON)"
        )
    return python


def test_kernel_matches_onnx_weekly_reference(device, rng, tmp_path):
    python = _weekly_python()
    folder = next(f for f in package_folders() if f.name == "grouped_matmul")
    calls = []
    for case in load_cases(folder / "test.json"):
        if case.error is None:
            calls.append((case.name, case.materialize(rng), case.rtol, case.atol))
    for i in range(10):  # plus random shapes, f32 and f16, int32 and int64, with and without bias
        dtype = np.float16 if i % 3 == 2 else np.float32
        m, k, n, g, s = (int(v) for v in rng.integers(1, 24, 5))
        call = {
            "inputT": rng.standard_normal((m, k)).astype(dtype),
            "weightsT": rng.standard_normal((g, k, n)).astype(dtype),
            "groupIndicesT": rng.integers(0, g, (m, s)).astype([np.int32, np.int64][i % 2]),
        }
        if i % 2:
            call["biasT"] = rng.standard_normal((g, n)).astype(dtype)
        tol = 2e-2 if dtype == np.float16 else 1e-4
        calls.append((f"random{i}", call, tol, tol))
    arrays = {}
    for i, (_, call, _, _) in enumerate(calls):
        names = {
            "inputT": "input",
            "weightsT": "weights",
            "groupIndicesT": "group_indices",
            "biasT": "bias",
        }
        for key, value in call.items():
            if value is not None:
                arrays[f"case{i}.{names[key]}"] = value
    np.savez(tmp_path / "in.npz", **arrays)
    done = subprocess.run(
        [python, str(SCRIPT), str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    reference = np.load(tmp_path / "out.npz")
    kernel = get_kernel("GroupedMatMul")
    for i, (name, call, rtol, atol) in enumerate(calls):
        expected = reference[f"case{i}.output"]
        for variant in kernel.variants:
            out = kernel(**call, variant=variant, poison_outputs=True)["outputT"]
            assert out.dtype == expected.dtype, name
            np.testing.assert_allclose(
                out.astype(np.float64),
                expected.astype(np.float64),
                rtol=rtol,
                atol=atol,
                err_msg=f"{name} {variant}",
            )
