"""The verifier's WebGPU path on float16 layers: the float16 kernels where the adapter has them.

A float16 twin of a hand-written layer (every float32 tensor and value made float16, QMoE
scales too) is fused and checked by ``verify`` (its float16 tolerance row, docs/verification.md)
on the wgpu path. A spy on the kernel call records the dtype each fused node reached its kernel
with: float16 on an adapter with shader-f16 (the float16 kernels run), float32 when the adapter
is made to lack it (the inputs widened, as before float16 kernels existed).
"""

from __future__ import annotations

import pytest
from onnx import TensorProto
from pipeline.test_half_precision_layers import _twin

from onnx_moe_fuse import fuse
from onnx_moe_fuse.kernels.device import Device
from onnx_moe_fuse.kernels.kernel import Kernel
from onnx_moe_fuse.verify.checker import verify

#: a float MoE (SwiGLU) layer and an int4 QMoE one
LAYERS = {"swish_swiglu": "com.microsoft.MoE", "qwen3_int4": "com.microsoft.QMoE"}


@pytest.fixture
def kernel_dtypes(monkeypatch) -> list[tuple[str, str, str]]:
    """(kernel, input dtype, output dtype) of every kernel call while the test runs."""
    seen: list[tuple[str, str, str]] = []
    original = Kernel.__call__

    def spy(self, *args, **tensors):
        result = original(self, *args, **tensors)
        if "inputT" in tensors and "outputT" in result:
            name = self.manifest.qualified_name
            seen.append((name, tensors["inputT"].dtype.name, result["outputT"].dtype.name))
        return result

    monkeypatch.setattr(Kernel, "__call__", spy)
    return seen


@pytest.mark.parametrize(("name", "op"), LAYERS.items())
@pytest.mark.parametrize("has_f16", [True, False])
def test_float16_layer_verifies_on_the_float16_kernels(
    device, kernel_dtypes, monkeypatch, name, op, has_f16
):
    if has_f16 and not device.has_f16:
        pytest.skip("adapter has no shader-f16")
    if not has_f16:
        monkeypatch.setattr(Device, "has_f16", property(lambda self: False))
    model, _ = _twin(name, TensorProto.FLOAT16)
    fused = fuse(model).model
    report = verify(model, fused, seeds=(5,), paths=("wgpu",))
    assert report.passed, report.summary()
    assert report.paths["wgpu"].status == "passed", report.summary()
    calls = [(i, o) for k, i, o in kernel_dtypes if k == op]
    assert calls, f"{name}: the fused {op} never reached its kernel ({kernel_dtypes})"
    want = "float16" if has_f16 else "float32"
    assert set(calls) == {(want, want)}, calls
