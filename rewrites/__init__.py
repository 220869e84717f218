"""onnxscript rewriter rules, one rule family per module."""
