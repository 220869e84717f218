"""Benchmark the GroupedMatMul kernel variants beside numpy on bench.json's cases.

Prints, per case and variant, the kernel's median time (GPU timestamps where the adapter
has them), numpy's median for the same product (gather the selected weights, batched
matmul) in the same process, their ratio, and the weight bytes read per second against
the copy kernel's bandwidth measured in the same run. Usage:

    .venv/bin/python benchmarks/bench_grouped_matmul.py [--runs 10] [--cases NAME ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, median, print_table, wall_times  # noqa: E402

from onnx_moe_fuse.kernels.cases import load_cases  # noqa: E402
from onnx_moe_fuse.kernels.device import default_device  # noqa: E402
from onnx_moe_fuse.kernels.runtime import get_kernel, package_folders  # noqa: E402


def numpy_grouped_matmul(x: np.ndarray, w: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """out[m, s] = x[m] @ w[idx[m, s]], by one batched matmul per group (as a CPU would)."""
    m, s = idx.shape
    out = np.empty((m, s, w.shape[2]), dtype=x.dtype)
    flat = idx.reshape(-1)
    rows = np.repeat(np.arange(m), s)
    for g in np.unique(flat):
        slots = np.nonzero(flat == g)[0]
        out.reshape(m * s, -1)[slots] = x[rows[slots]] @ w[g]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--cases", nargs="*", default=None)
    args = parser.parse_args()
    device = default_device()
    kernel = get_kernel("GroupedMatMul")
    folder = next(f for f in package_folders() if f.name == "grouped_matmul")
    rng = np.random.default_rng(0)
    bandwidth = copy_bandwidth(device)
    print(f"adapter: {device.description}")
    print(f"copy kernel bandwidth (read+write): {bandwidth / 1e9:.1f} GB/s")
    rows = []
    for case in load_cases(folder / "bench.json"):
        if args.cases and case.name not in args.cases:
            continue
        inputs = case.materialize(rng)
        x, w, idx = inputs["inputT"], inputs["weightsT"], inputs["groupIndicesT"]
        reference = numpy_grouped_matmul(x, w, idx)
        numpy_s = median(
            wall_times(lambda x=x, w=w, idx=idx: numpy_grouped_matmul(x, w, idx), args.runs)
        )
        used = np.unique(idx).size * w.shape[1] * w.shape[2] * w.itemsize
        for variant in kernel.variants:
            try:
                plan = kernel.plan(**inputs, variant=variant)
            except ValueError as exc:
                rows.append(
                    [
                        case.name,
                        variant,
                        "-",
                        f"{numpy_s * 1e3:.3f}",
                        "-",
                        "-",
                        f"n/a: {str(exc)[:60]}",
                    ]
                )
                continue
            out = kernel.run(plan)["outputT"]
            error = float(np.abs(out - reference).max() / max(np.abs(reference).max(), 1e-30))
            times, method = kernel.time(plan, runs=args.runs)
            t = median(times)
            rows.append(
                [
                    case.name,
                    variant,
                    f"{t * 1e3:.3f}",
                    f"{numpy_s * 1e3:.3f}",
                    f"{numpy_s / t:.2f}x",
                    f"{used / t / bandwidth:.1%}",
                    f"{method}, rel err {error:.1e}",
                ]
            )
    print_table(
        [
            "case",
            "variant",
            "kernel ms (median)",
            "numpy ms",
            "numpy/kernel",
            "weight bytes/s vs copy",
            "notes",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
