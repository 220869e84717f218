"""The command line's per-layer verification: when ``--verify`` goes layer by layer, and the check.

:func:`per_layer` decides (``--per-layer``, or a model with more than :data:`PER_LAYER_BYTES`
of external data); :func:`layer_check` is the check :func:`onnx_moe_fuse.streaming_io.fuse_file`
runs on the written output before moving it into place
(:func:`onnx_moe_fuse.verify.layers.verify_layers`); :class:`LayersFailed` stops the run when a
layer fails, carrying the report so far.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["PER_LAYER_BYTES", "LayersFailed", "adapter_name", "layer_check", "per_layer"]


#: Weights (external data bytes) above which ``--verify`` goes layer by layer by default.
PER_LAYER_BYTES = 256 << 20


def per_layer(args: argparse.Namespace, input_path: Path) -> bool:
    """``--verify`` layer by layer: asked for, or a model with over 256 MiB of external data."""
    if args.per_layer:
        return True
    from onnx_moe_fuse.io.model_check import all_tensors, is_external

    try:
        import onnx

        proto = onnx.load(str(input_path), load_external_data=False)
    except Exception:  # the streaming path's own checks name what is wrong with it
        return False
    total = 0
    for t in all_tensors(proto):
        if is_external(t):
            info = {e.key: e.value for e in t.external_data}
            total += int(info.get("length") or 0)
    return total > PER_LAYER_BYTES


class LayersFailed(Exception):
    """Per-layer verification failed: the output is not moved into place."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__("verification failed")
        self.report = report


def adapter_name() -> str | None:
    try:
        from onnx_moe_fuse.kernels import default_device

        return default_device().description
    except Exception:
        return None


def layer_check(args, input_path, seeds, progress, verification):
    """The streaming path's check: per-layer verification of the written output (or None)."""
    if not args.verify:
        return None
    from onnx_moe_fuse.io.processes import want_preloaded
    from onnx_moe_fuse.verify.layers import verify_layers

    # the repack's workers start the run's one forkserver: have it import the verifier too,
    # or each layer's two verification processes import it afresh (2.5x the time a layer)
    want_preloaded(verify_layers.__module__)
    from onnx_moe_fuse.verify.quant_error import verify_tolerance

    def check(fused_path: Path, report: Any) -> None:
        def shown(i: int, n: int, record: dict[str, Any]) -> None:
            progress.detail = f"layer {i}/{n}"

        verification.update(
            verify_layers(
                input_path,
                fused_path,
                report.fusions,
                seeds=seeds,
                quantization=verify_tolerance(report.fusions),
                progress=shown,
                # one layer at a time unless --jobs asks: each job holds a layer (2 jobs of a
                # Qwen3-size layer peaked at 2.4 GiB against 1.4 GiB for one)
                jobs=args.jobs or 1,
            )
        )
        progress.detail = "passed" if verification["passed"] else "FAILED"
        if not verification["passed"]:
            raise LayersFailed({"input": str(input_path), "output": args.output,
                                 **report.to_dict()})  # fmt: skip

    return check
