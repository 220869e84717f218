"""The WebGPU device: adapter choice, limits, features and subgroup size.

One device is created lazily and shared (:func:`default_device`). The adapter is
chosen by ``ONNX_MOE_FUSE_ADAPTER`` when set (``gpu``, ``vulkan-cpu``/``lavapipe``,
``gl``, or any substring of the adapter's description), otherwise in the order: a real
GPU, then Mesa's lavapipe through Vulkan, then OpenGL. The device is requested with
the adapter's full limits and every feature the manifests ask about.

This module is the one place where wgpu-py's names become the manifests' names:
kebab-case limits become camelCase (``max-buffer-size`` -> ``maxBufferSize``), the
feature ``subgroup`` becomes ``subgroups``, and the subgroup size, which wgpu-py does
not report (its ``stackgroup_*`` keys hold placeholders), is measured once per device
by a probe dispatch and exposed as ``adapterInfo.subgroupMinSize``/``subgroupMaxSize``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ADAPTER_ENV = "ONNX_MOE_FUSE_ADAPTER"

#: wgpu-py feature name -> the name manifests use.
FEATURE_NAMES = {
    "subgroup": "subgroups",
    "subgroup-barrier": "subgroup-barrier",
    "shader-f16": "shader-f16",
    "shader-f64": "shader-f64",
    "shader-int64": "shader-int64",
    "timestamp-query": "timestamp-query",
    "timestamp-query-inside-passes": "timestamp-query-inside-passes",
    "timestamp-query-inside-encoders": "timestamp-query-inside-encoders",
}


class NoAdapterError(RuntimeError):
    """No WebGPU adapter is available (or none matches ``ONNX_MOE_FUSE_ADAPTER``)."""


def _camel(kebab: str) -> str:
    head, *rest = kebab.split("-")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _adapter_kind(adapter: Any) -> str:
    info = adapter.info
    backend = str(info.get("backend_type", ""))
    adapter_type = str(info.get("adapter_type", ""))
    if adapter_type in ("DiscreteGPU", "IntegratedGPU", "VirtualGPU"):
        return "gpu"
    if backend == "Vulkan":
        return "vulkan-cpu"
    if backend == "OpenGL":
        return "gl"
    return "other"


_KIND_ORDER = {"gpu": 0, "vulkan-cpu": 1, "gl": 2, "other": 3}
_KIND_ALIASES = {
    "lavapipe": "vulkan-cpu",
    "vulkan": "vulkan-cpu",
    "opengl": "gl",
    "cpu": "vulkan-cpu",
}


def _enumerate_adapters() -> list[Any]:
    import wgpu

    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # silences a warning from Mesa's loader
    return list(wgpu.gpu.enumerate_adapters_sync())


def list_adapters() -> list[tuple[str, str]]:
    """(kind, description) of every adapter wgpu finds, best first."""
    adapters = sorted(_enumerate_adapters(), key=lambda a: _KIND_ORDER[_adapter_kind(a)])
    return [(_adapter_kind(a), a.summary) for a in adapters]


def _choose_adapter(preference: str | None) -> Any:
    adapters = _enumerate_adapters()
    if not adapters:
        raise NoAdapterError(
            "no WebGPU adapter found: install Mesa's Vulkan driver "
            "(apt-get install mesa-vulkan-drivers libvulkan1) or run on a machine with a GPU"
        )
    adapters.sort(key=lambda a: _KIND_ORDER[_adapter_kind(a)])
    if not preference:
        return adapters[0]
    wanted = _KIND_ALIASES.get(preference.lower(), preference.lower())
    for adapter in adapters:
        if _adapter_kind(adapter) == wanted or wanted in adapter.summary.lower():
            return adapter
    found = "; ".join(f"{_adapter_kind(a)}: {a.summary}" for a in adapters)
    raise NoAdapterError(f"{ADAPTER_ENV}={preference!r} matches no adapter (found: {found})")


@dataclass
class Device:
    """A wgpu device with its limits, features and adapter facts in manifest names."""

    adapter: Any
    device: Any
    kind: str
    description: str
    limits: dict[str, int]
    features: frozenset[str]
    adapter_info: dict[str, Any]
    pipelines: dict[Any, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def has_f16(self) -> bool:
        """Whether shaders may use ``f16``."""
        return "shader-f16" in self.features


def create_device(preference: str | None = None) -> Device:
    """Create a device on the preferred adapter (see the module docstring)."""
    adapter = _choose_adapter(preference if preference is not None else os.environ.get(ADAPTER_ENV))
    wanted = [f for f in FEATURE_NAMES if f in adapter.features]
    limits = dict(adapter.limits)
    device = adapter.request_device_sync(
        label="onnx-moe-fuse", required_features=wanted, required_limits=limits
    )
    features = frozenset(FEATURE_NAMES[f] for f in wanted)
    info = {
        "vendor": adapter.info.get("vendor", ""),
        "architecture": adapter.info.get("architecture", ""),
        "device": adapter.info.get("device", ""),
        "description": adapter.info.get("description", ""),
        "backend": adapter.info.get("backend_type", ""),
        "adapterType": adapter.info.get("adapter_type", ""),
    }
    dev = Device(
        adapter=adapter,
        device=device,
        kind=_adapter_kind(adapter),
        description=adapter.summary,
        limits={_camel(k): v for k, v in limits.items() if isinstance(v, int)},
        features=features,
        adapter_info=info,
    )
    if "subgroups" in features:
        size = measure_subgroup_size(dev)
        info["subgroupMinSize"] = size
        info["subgroupMaxSize"] = size
    return dev


_PROBE_WGSL = """
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) i: u32, @builtin(subgroup_size) size: u32) {
    out[i] = size;
}
"""


def measure_subgroup_size(dev: Device) -> int:
    """Dispatch a probe that writes the ``subgroup_size`` builtin; return the largest seen."""
    import wgpu

    d = dev.device
    module = d.create_shader_module(label="subgroup-size-probe", code=_PROBE_WGSL)
    pipeline = d.create_compute_pipeline(
        label="subgroup-size-probe",
        layout="auto",
        compute={"module": module, "entry_point": "main"},
    )
    out = d.create_buffer(
        label="subgroup-size-probe.out",
        size=64 * 4,
        usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC,
    )
    group = d.create_bind_group(
        label="subgroup-size-probe",
        layout=pipeline.get_bind_group_layout(0),
        entries=[{"binding": 0, "resource": {"buffer": out}}],
    )
    encoder = d.create_command_encoder(label="subgroup-size-probe")
    compute = encoder.begin_compute_pass(label="subgroup-size-probe")
    compute.set_pipeline(pipeline)
    compute.set_bind_group(0, group)
    compute.dispatch_workgroups(1, 1, 1)
    compute.end()
    d.queue.submit([encoder.finish()])
    sizes = np.frombuffer(d.queue.read_buffer(out), dtype=np.uint32)
    return int(sizes.max())


_default: Device | None = None
_default_lock = threading.Lock()


def default_device() -> Device:
    """The shared device, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = create_device()
        return _default


def reset_default_device() -> None:
    """Forget the shared device (a new one is created on next use)."""
    global _default
    with _default_lock:
        _default = None
