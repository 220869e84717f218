"""onnx-moe-fuse: fuse mixture-of-experts layers of ONNX models into ONNX Runtime contrib nodes.

The package root is lazy (as onnx-ir's is): ``from onnx_moe_fuse import fuse`` loads the API on
first use, so that importing one layer of the package (the kernel runtime, a rule, the contract)
loads that layer and what it imports, not the whole pipeline. ``docs/architecture.md`` draws the
layers and the directions they may import in; ``tests/test_import_layers.py`` checks them.
"""

import lazy_loader

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={"api": ["FuseResult", "FusionReport", "fuse"], "errors": ["MoEFuseError"]},
)
__all__ += ["__version__"]
