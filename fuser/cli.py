"""The ``onnx-moe-fuse`` command line.

    onnx-moe-fuse IN.onnx -o OUT.onnx [--verify] [--report REPORT.json] [--only QMoE,MoE]
                  [--explain] [--seeds 0,1,2]
    onnx-moe-fuse --demo [-o OUT.onnx] [--report REPORT.json] [--explain]
    onnx-moe-fuse --self-check | --list-adapters

Exit codes: 0 success (also when nothing fused: the report says so); 1 verification or
self-check failed (no output model is written); 2 bad usage or bad input (unreadable model,
output that would overwrite the input, unknown op); 3 no WebGPU adapter for a command
that needs one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_ADAPTER = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnx-moe-fuse",
        description="Fuse mixture-of-experts layers of ONNX models into ONNX Runtime's "
        "QMoE / MoE / MatMulNBitsQkv nodes, and prove each rewrite on WebGPU.",
        epilog="Exit codes: 0 success, 1 verification or self-check failed (no output "
        "written), 2 bad usage or input, 3 no WebGPU adapter.",
    )
    parser.add_argument("input", nargs="?", help="the model to fuse (.onnx)")
    parser.add_argument("-o", "--output", help="where to write the fused model (atomically)")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="run original and fused model on random inputs and compare "
        "(reference path vs WebGPU kernels and ONNX Runtime); a failure "
        "exits 1 and writes no model",
    )
    parser.add_argument("--report", help="write a JSON report: fusions, near misses, verification")
    parser.add_argument("--only", help="comma-separated ops that may be emitted (MoE, QMoE, MatMulNBitsQkv; default all)")
    parser.add_argument(
        "--explain",
        action="store_true",
        help="list near misses: layers that looked like MoE and why they did not fuse",
    )
    parser.add_argument("--seeds", default="0,1,2", help="verification seeds (default 0,1,2)")
    parser.add_argument(
        "--demo",
        action="store_true",
        help="fuse and verify the embedded default sample (a Mixtral-like int4 layer)",
    )
    parser.add_argument(
        "--self-check",
        action="store_true",
        help="run every kernel package's test cases on this machine's WebGPU "
        "adapter against the numpy oracles",
    )
    parser.add_argument(
        "--list-adapters",
        action="store_true",
        help="list the WebGPU adapters wgpu finds, best first",
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed for --self-check")
    return parser


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
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename."""
    target = Path(path)
    folder = target.resolve().parent
    text = json.dumps(_json_safe(data), indent=2, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _print_fusions(report: dict[str, Any]) -> None:
    fusions = report["fusions"]
    if not fusions:
        print("nothing fused")
    for f in fusions:
        print(f"fused {f['op']} {f.get('name') or ''}: replaced {len(f['replaced'])} nodes")


def _print_near_misses(report: dict[str, Any]) -> None:
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


def _error(message: str, code: int) -> int:
    print(f"onnx-moe-fuse: {message}", file=sys.stderr)
    return code


def _fuse_command(args: argparse.Namespace) -> int:
    from .api import fuse
    from .model_io import InputOverwriteError, ModelLoadError, load_model, save_model_atomic

    if args.demo:
        from .samples import default_sample

        sample = default_sample()
        print(f"demo: sample {sample.name}: {sample.description}")
        original, input_path = sample.model, None
    else:
        if not args.input:
            return _error(
                "give a model to fuse (or --demo, --self-check, --list-adapters)", EXIT_USAGE
            )
        if not args.output:
            return _error("give the output path with -o OUT.onnx", EXIT_USAGE)
        input_path = Path(args.input)
        try:
            original = load_model(input_path)
        except (ModelLoadError, OSError) as exc:
            return _error(str(exc), EXIT_USAGE)
    if args.output and input_path is not None:
        out = Path(args.output)
        if out.exists() and input_path.exists() and os.path.samefile(out, input_path):
            return _error(f"refusing to overwrite the input {input_path}", EXIT_USAGE)
    only = None
    if args.only:
        only = {op.strip() for op in args.only.split(",") if op.strip()}
    try:
        result = fuse(original, only=only)
    except (ValueError, TypeError) as exc:
        return _error(str(exc), EXIT_USAGE)
    report: dict[str, Any] = {
        "input": str(input_path) if input_path else "demo sample",
        "output": args.output,
        **result.report.to_dict(),
    }
    _print_fusions(report)
    if args.explain:
        _print_near_misses(report)

    ok = True
    if args.verify or args.demo:
        from .verify import verify

        try:
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            return _error(
                f"--seeds must be integers separated by commas: {args.seeds!r}", EXIT_USAGE
            )
        if result.fused:
            verification = verify(original, result.model, seeds=seeds)
            report["verification"] = verification.to_dict()
            print(verification.summary())
            ok = verification.passed
        else:
            report["verification"] = {
                "passed": True,
                "note": "nothing fused: the output equals the input",
            }
            print("verification: nothing fused, nothing to verify")
    if args.report:
        write_json_atomic(args.report, report)
    if not ok:
        return _error("verification FAILED: no model written", EXIT_FAILED)
    if args.output:
        try:
            written = save_model_atomic(result.model, args.output, input_path=input_path)
        except InputOverwriteError as exc:
            return _error(str(exc), EXIT_USAGE)
        except (FileNotFoundError, ValueError) as exc:
            return _error(str(exc), EXIT_USAGE)
        print("wrote " + ", ".join(str(p) for p in written))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    args = _parser().parse_args(argv)
    if args.list_adapters:
        from onnx_moe_fuse.kernels.device import list_adapters

        for kind, description in list_adapters():
            print(f"{kind:<11} {description}")
        return EXIT_OK
    if args.self_check:
        from onnx_moe_fuse.kernels.device import NoAdapterError, default_device

        from .selfcheck import print_self_check, run_self_check

        try:
            device = default_device()
        except NoAdapterError as exc:
            return _error(str(exc), EXIT_NO_ADAPTER)
        ok = print_self_check(run_self_check(args.seed), device.description)
        return EXIT_OK if ok else EXIT_FAILED
    if args.demo or args.input or args.output:
        if args.verify or args.demo:
            from onnx_moe_fuse.kernels.device import NoAdapterError, default_device

            try:
                default_device()
            except NoAdapterError as exc:
                return _error(f"--verify needs a WebGPU adapter: {exc}", EXIT_NO_ADAPTER)
        return _fuse_command(args)
    _parser().print_help()
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
