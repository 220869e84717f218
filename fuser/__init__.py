"""onnx-moe-fuse: fuse mixture-of-experts layers of ONNX models into ONNX Runtime contrib nodes."""

from .api import FuseResult, FusionReport, fuse
from .errors import MoEFuseError

__version__ = "0.1.0"

__all__ = ["FuseResult", "FusionReport", "MoEFuseError", "fuse", "__version__"]
