"""Run models in onnxruntime-webgpu 1.27 (its own venv) from a test: ``webgpu_load.py`` jobs.

onnxruntime-webgpu installs as ``onnxruntime``, like the CPU package of the main venv, so a
test writes the models and their feeds to a folder and runs ``webgpu_load.py`` in
``.venv-webgpu`` (or ``ORT_WEBGPU_PYTHON``). On CI that venv must exist; elsewhere the test is
skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

ON_CI = os.environ.get("CI", "").lower() == "true"
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("webgpu_load.py")


def webgpu_python() -> str:
    """The onnxruntime-webgpu venv's python; fails on CI and skips elsewhere when missing."""
    python = os.environ.get("ORT_WEBGPU_PYTHON") or str(ROOT / ".venv-webgpu" / "bin" / "python")
    if not Path(python).is_file():
        if ON_CI:
            pytest.fail(f"onnxruntime-webgpu venv missing on CI: {python}")
        pytest.skip(
            "no onnxruntime-webgpu venv (run scripts/bootstrap.sh test, or set ORT_WEBGPU_PYTHON)"
        )
    return python


def run_webgpu_job(
    folder: Path, models: dict[str, onnx.ModelProto], feeds: dict[str, dict[str, np.ndarray]]
) -> dict:
    """Load and run ``models`` on ``feeds`` in onnxruntime-webgpu; its JSON result by name.

    Each model's outputs are in ``folder / f"{name}.out.npz"`` when its status is ``"ran"``.
    """
    job = []
    for name, model in models.items():
        path = folder / f"{name}.onnx"
        onnx.save(model, path)
        np.savez(folder / f"{name}.in.npz", **feeds[name])
        job.append(
            {
                "name": name,
                "model": str(path),
                "feeds": str(folder / f"{name}.in.npz"),
                "outputs": str(folder / f"{name}.out.npz"),
            }
        )
    (folder / "job.json").write_text(json.dumps(job))
    done = subprocess.run(
        [webgpu_python(), str(SCRIPT), str(folder / "job.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
