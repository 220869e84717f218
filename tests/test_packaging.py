"""Packaging: every kernel folder is listed in pyproject, so its files reach a wheel."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from onnx_moe_fuse.kernels.runtime import PACKAGE_ROOT

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_every_kernel_folder_is_a_listed_package():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    folders = {p.name for p in PACKAGE_ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"}
    missing = {f"onnx_moe_fuse.kernels.{name}" for name in folders} - listed
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"
