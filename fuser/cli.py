"""The ``onnx-moe-fuse`` command line.

Exit codes: 0 success; 1 a check or verification failed; 2 bad usage or bad input;
3 no WebGPU adapter.
"""

from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_ADAPTER = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnx-moe-fuse",
        description="Fuse mixture-of-experts layers of ONNX models into ONNX Runtime's "
        "QMoE / MoE / MatMulNBitsQkv nodes, and prove each rewrite on WebGPU.",
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    args = _parser().parse_args(argv)
    from onnx_moe_fuse.kernels.device import NoAdapterError, default_device, list_adapters

    if args.list_adapters:
        for kind, description in list_adapters():
            print(f"{kind:<11} {description}")
        return EXIT_OK
    if args.self_check:
        from .selfcheck import print_self_check, run_self_check

        try:
            device = default_device()
        except NoAdapterError as exc:
            print(f"onnx-moe-fuse: {exc}", file=sys.stderr)
            return EXIT_NO_ADAPTER
        ok = print_self_check(run_self_check(args.seed), device.description)
        return EXIT_OK if ok else EXIT_FAILED
    _parser().print_help()
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
