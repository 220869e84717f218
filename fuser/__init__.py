"""onnx-moe-fuse: fuse mixture-of-experts layers of ONNX models into ONNX Runtime contrib nodes."""

__version__ = "0.1.0"
