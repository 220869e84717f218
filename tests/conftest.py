"""Shared fixtures: the WebGPU device, and fresh random generators with visible seeds.

On CI (``CI=true``) a missing WebGPU adapter, or only an OpenGL one, fails the run;
elsewhere the tests that need a device are skipped with the reason.
"""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

ON_CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="session")
def device():
    """The shared WebGPU device (Vulkan lavapipe on a machine without a GPU)."""
    from onnx_moe_fuse.kernels.device import NoAdapterError, default_device

    try:
        dev = default_device()
    except NoAdapterError as exc:
        if ON_CI:
            pytest.fail(f"CI needs a WebGPU adapter: {exc}")
        pytest.skip(f"no WebGPU adapter: {exc}")
    if ON_CI and dev.kind not in ("gpu", "vulkan-cpu"):
        pytest.fail(f"CI needs a Vulkan adapter (lavapipe or a GPU), found {dev.description}")
    return dev


@pytest.fixture
def rng(request):
    """A generator seeded afresh for every test; the seed is printed when the test fails."""
    seed = int(os.environ.get("TEST_SEED", secrets.randbits(32)))
    request.node.user_properties.append(("seed", seed))
    print(f"random seed: {seed} (rerun with TEST_SEED={seed})")
    return np.random.default_rng(seed)
