"""onnx-moe-fuse: fuse mixture-of-experts layers of ONNX models into ONNX Runtime contrib nodes.

The package root is lazy (as onnx-ir's is): ``from onnx_moe_fuse import fuse`` loads the API on
first use, so that importing one layer of the package (the kernel runtime, a rule, the contract)
loads that layer and what it imports, not the whole pipeline. ``docs/architecture.md`` draws the
layers and the directions they may import in (``tests/test_import_layers.py`` checks them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module that defines it (imported on first access).
_LAZY = {
    "FuseResult": "onnx_moe_fuse.api",
    "FusionReport": "onnx_moe_fuse.api",
    "fuse": "onnx_moe_fuse.api",
    "MoEFuseError": "onnx_moe_fuse.errors",
}

__all__ = ["FuseResult", "FusionReport", "MoEFuseError", "fuse", "__version__"]

if TYPE_CHECKING:
    from onnx_moe_fuse.api import FuseResult, FusionReport, fuse
    from onnx_moe_fuse.errors import MoEFuseError


def __getattr__(name: str) -> Any:
    """Load a public name of the package root from its module on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
