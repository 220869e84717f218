"""WebGPU kernels described by JSON manifests, and the runtime that runs them.

This package face is the one module other layers import (``tests/test_import_layers.py``
holds them to it): ``from onnx_moe_fuse.kernels import get_kernel, KernelCallError``. It is
lazy (``lazy_loader``), so importing it loads nothing until a name is used, and a module of
the package imports without loading the rest.

Modules: :mod:`.runtime` (the package catalogue: ``get_kernel``, ``package_folders``),
:mod:`.kernel` (the ``Kernel`` objects), :mod:`.recording`, :mod:`.commands` and
:mod:`.templates` (a call's device work), :mod:`.planner` (checking a call, choosing a
variant), :mod:`.manifest` with :mod:`.manifest_schema` and :mod:`.manifest_model` (loading
manifests against the declared schema, ``*.schema.json``), :mod:`.expressions`,
:mod:`.device` and :mod:`.cases` (``test.json``/``bench.json``).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "cases": ["load_cases"],
        "device": ["NoAdapterError", "default_device", "list_adapters"],
        "kernel": ["Kernel"],
        "manifest": ["ManifestError", "load_manifest"],
        "planner": ["KernelCallError"],
        "runtime": ["PACKAGE_ROOT", "get_kernel", "package_folders"],
    },
)
