"""What the command line prints and writes: the summary lines and the strict-JSON report.

Split from :mod:`onnx_moe_fuse.cli` (the commands); :func:`print_fusions` is the summary of
what fused (with each quantised layer's measured error and the accuracy level asked for),
:func:`print_near_misses` the ``--explain`` list, :func:`write_json_atomic` the report file.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from onnx_moe_fuse.contract.targets import DEFAULT_TARGET, Target
from onnx_moe_fuse.io.output_paths import write_text_atomic

__all__ = ["print_fusions", "print_near_misses", "write_json_atomic"]


def _json_safe(value: Any) -> Any:
    """Non-finite floats become strings ("inf"), so the report is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json_atomic(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write ``data`` as strict JSON to ``path`` atomically (mode 0666 less the umask)."""
    write_text_atomic(path, json.dumps(_json_safe(data), indent=2, allow_nan=False) + "\n")


def print_fusions(report: dict[str, Any], target: Target, explain: bool = False) -> None:
    fusions = report["fusions"]
    if not fusions:
        print("nothing fused")
    for f in fusions:
        dtype = f" ({f['dtype']})" if f.get("dtype") not in (None, "float32") else ""
        print(f"fused {f['op']}{dtype} {f.get('name') or ''}: replaced {len(f['replaced'])} nodes")
        quant = f.get("quantization")
        if quant:
            block = quant["block_size"]
            grain = f"blocks of {block}" if block else "per channel"
            error = quant.get("max_rel_error")
            measured = "not measured" if error is None else f"measured max rel error {error:.3g}"
            print(
                f"  quantised to int{quant['bits']} ({grain}) from {quant['from']}: not exact, "
                f"{measured} against the float layer"
            )
        routing = f.get("routing")
        if explain and routing:
            rescale = ", the output rescaled per token" if routing["rescaled"] else ""
            print(
                f"  routing: {routing['construction']} construction{rescale}; the router "
                f"({routing['router']}: {routing['router_description']}) stays in the graph"
            )
            if routing.get("why"):
                print(f"  ({routing['why']})")
    level = (report.get("quantization") or {}).get("accuracy_level")
    if level is not None:
        inexact = (
            ": ORT CPU computes block-wise 4-bit QMoE with int8 activations (not exact)"
            if level == 4
            else ""
        )
        print(f"accuracy_level {level} on every QMoE node{inexact}")
    default = " (the default; --target picks another runtime)"
    print(f"target {target.name}{default if target.name == DEFAULT_TARGET else ''}")


def print_near_misses(report: dict[str, Any]) -> None:
    misses = report["near_misses"]
    if not misses:
        print("no near misses")
    for m in misses:
        where = m.get("topk") or m.get("root") or "?"
        part = m.get("part")
        about = m.get("node")
        head = f"{part.upper() if part in ('fc1', 'fc2') else part}" if part else None
        detail = f"{head} ({about}): " if head and about else (f"{head}: " if head else "")
        print(f"near miss at {where}: {detail}{m['reason']}")
    for line in report.get("canonicalisation", []):
        print(f"note: {line}")


def print_layers(verification: dict[str, Any]) -> None:
    """Per-layer verification's lines: each layer's result, error and time, then the verdict."""
    layers = verification.get("layers")
    if not layers:
        return
    for record in layers:
        paths = ", ".join(
            f"{name} {p.get('status')}" for name, p in (record.get("paths") or {}).items()
        )
        selected = "; ".join(
            f"{e['selected']}/{e['experts']} experts selected" for e in record.get("experts") or []
        )
        cpu = f", {record['cpu_seconds']:.1f} s cpu" if "cpu_seconds" in record else ""
        print(
            f"  layer {record['layer']}: {'passed' if record['passed'] else 'FAILED'} "
            f"(max rel {record['max_rel']:.2e}; {paths}; {selected + '; ' if selected else ''}"
            f"{record['seconds']:.1f} s{cpu})"
        )
        for message in record.get("messages") or []:
            print(f"    {message}")
    verdict = "passed" if verification.get("passed") else "FAILED"
    print(f"verification {verdict}: {len(layers)} layers, one at a time "
          f"(estimate {verification.get('estimate_mib')} MiB a layer)")  # fmt: skip
