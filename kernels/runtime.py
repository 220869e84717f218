"""The kernel packages shipped with the project, found by operator name and version.

``get_kernel("GroupedMatMul", version=1)`` finds the package folder under
:data:`PACKAGE_ROOT` whose manifest has that name (or ``domain.name``) and version and
returns its :class:`~onnx_moe_fuse.kernels.kernel.Kernel` (one per package and version,
unless a device is given). The runtime itself lives in the modules this one re-exports
from, so that the old import paths (``onnx_moe_fuse.kernels.runtime.Kernel``,
``.pack_uniform``, ``.encode_commands``, ``.timestamp_period_ns``, ``.COMMON_TEMPLATES``)
keep working: :mod:`.kernel` (the kernel objects), :mod:`.recording` (buffers, pipelines
and dispatches of a call), :mod:`.commands` (GPU buffers, uniform packing, encoding) and
:mod:`.templates` (Jinja2 WGSL templates). Other layers import all of this from
:mod:`onnx_moe_fuse.kernels`.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from onnx_moe_fuse.kernels.commands import encode_commands, pack_uniform, timestamp_period_ns
from onnx_moe_fuse.kernels.device import Device
from onnx_moe_fuse.kernels.kernel import Kernel
from onnx_moe_fuse.kernels.manifest import load_manifest
from onnx_moe_fuse.kernels.templates import COMMON_TEMPLATES

__all__ = [
    "COMMON_TEMPLATES",
    "PACKAGE_ROOT",
    "Kernel",
    "encode_commands",
    "get_kernel",
    "pack_uniform",
    "package_folders",
    "timestamp_period_ns",
]

PACKAGE_ROOT = Path(__file__).resolve().parent


def package_folders() -> list[Path]:
    """Every kernel package folder shipped with the project."""
    return sorted(p.parent for p in PACKAGE_ROOT.glob("*/manifest.json"))


@cache
def _catalogue() -> dict[tuple[str, int], Path]:
    found: dict[tuple[str, int], Path] = {}
    for folder in package_folders():
        m = load_manifest(folder / "manifest.json")
        for name in {m.name, m.qualified_name}:
            found[(name, m.version)] = folder
    return found


_kernels: dict[tuple[str, int], Kernel] = {}


def get_kernel(name: str, version: int = 1, device: Device | None = None) -> Kernel:
    """The kernel package for operator ``name`` (``GroupedMatMul``, ``com.microsoft.QMoE``)."""
    folder = _catalogue().get((name, version))
    if folder is None:
        known = sorted({f"{n} v{v}" for n, v in _catalogue()})
        raise KeyError(f"no kernel package {name!r} version {version} (have: {', '.join(known)})")
    if device is not None:
        return Kernel(load_manifest(folder / "manifest.json"), folder, device)
    key = (name, version)
    if key not in _kernels:
        _kernels[key] = Kernel(load_manifest(folder / "manifest.json"), folder)
    return _kernels[key]
