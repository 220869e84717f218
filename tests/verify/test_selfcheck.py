"""The oracles by bind key (``oracles.kernel_calls``) and the kernel self-check built on them."""

from __future__ import annotations

import io

import pytest

from onnx_moe_fuse.kernels.manifest import load_manifest
from onnx_moe_fuse.kernels.runtime import package_folders
from onnx_moe_fuse.verify.oracles.kernel_calls import ATTRIBUTE_DEFAULTS, BIND_KEYS, KERNEL_ORACLES
from onnx_moe_fuse.verify.selfcheck import print_self_check, run_self_check

MANIFESTS = [load_manifest(f / "manifest.json") for f in package_folders()]


def test_every_kernel_package_has_an_oracle():
    assert sorted(KERNEL_ORACLES) == sorted(m.name for m in MANIFESTS)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=[m.name for m in MANIFESTS])
def test_oracle_defaults_are_the_manifests(manifest):
    for name, value in ATTRIBUTE_DEFAULTS[manifest.name].items():
        spec = manifest.attributes[name]
        assert spec.has_default and spec.default == value, (name, spec.default, value)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=[m.name for m in MANIFESTS])
def test_bind_keys_are_the_manifests(manifest):
    """Every tensor a manifest binds has the bind key BIND_KEYS gives its ONNX name."""
    for tensor in manifest.tensors.values():
        assert BIND_KEYS[manifest.name].get(tensor.semantic) == tensor.bind_key, tensor.semantic


def test_self_check_runs_every_package_and_passes(device):
    results = run_self_check(seed=0)
    assert {r.kernel for r in results} == set(KERNEL_ORACLES)
    assert all(any(r.detail == "ok" for r in results if r.kernel == k) for k in KERNEL_ORACLES)
    text = io.StringIO()
    assert print_self_check(results, device.description, text), text.getvalue()
