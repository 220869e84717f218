"""onnx-moe-fuse: fuse mixture-of-experts layers of ONNX models into ONNX Runtime contrib nodes."""

from .api import FuseResult, FusionReport, fuse

__version__ = "0.1.0"

__all__ = ["FuseResult", "FusionReport", "fuse", "__version__"]
