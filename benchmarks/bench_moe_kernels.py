"""Benchmark every valid QMoE / MoE kernel variant beside ONNX Runtime CPU on bench.json's cases.

For each case (decode 1 token, prefill 128 and 512 tokens at Qwen3-30B-A3B and gpt-oss-20b
layer sizes, plus reduced-expert copies whose weights fit a 128 MiB storage binding) it
prints, per variant whose ``when`` holds on this adapter: the kernel's median time (GPU
timestamps where the adapter has ``timestamp-query``, else wall clock around submit and
wait), ORT CPU's median on the same inputs in the same process, their ratio, the kernel's
relative error against ORT, and the expert-weight bytes it reads per second against a vec4
copy kernel's bandwidth measured in the same run (read + write counted). Variants that do
not hold are listed with the rule that failed. Usage::

    .venv/bin/python benchmarks/bench_moe_kernels.py [--ops qmoe moe] [--cases NAME ...]
        [--runs 10] [--budget 20] [--all] [--ort-threads N]

``--budget`` caps the seconds spent timing one (case, variant): slow adapters (lavapipe)
get fewer runs. Cases where no variant fits this adapter are skipped unless ``--all``
(then ORT is timed alone).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, median, print_table, rel_err, wall_times  # noqa: E402

from onnx_moe_fuse.kernels.cases import load_cases  # noqa: E402
from onnx_moe_fuse.kernels.device import default_device  # noqa: E402
from onnx_moe_fuse.kernels.planner import KernelCallError  # noqa: E402
from onnx_moe_fuse.kernels.runtime import get_kernel, package_folders  # noqa: E402
from onnx_moe_fuse.oracles.moe import route_moe, route_qmoe  # noqa: E402
from onnx_moe_fuse.ort_nodes import kernel_node_model, session  # noqa: E402

OPS = {"qmoe": "com.microsoft.QMoE", "moe": "com.microsoft.MoE"}
WEIGHTS = {
    "qmoe": ("fc1T", "fc1ScalesT", "fc2T", "fc2ScalesT"),
    "moe": ("fc1T", "fc2T", "fc3T"),
}


def ort_session(op: str, call: dict, attrs: dict, threads: int | None):
    """An ORT CPU session of one node, returned as a zero-argument callable.

    Weights are initializers (as in a fused model) while the model stays under protobuf's
    2 GB, graph inputs otherwise.
    """
    weight_bytes = sum(call[k].nbytes for k in WEIGHTS[op] if call.get(k) is not None)
    const_keys = WEIGHTS[op] if weight_bytes < 1.5e9 else ()
    model, feeds = kernel_node_model(OPS[op].split(".")[-1], call, attrs, const_keys=const_keys)
    sess = session(model, threads=threads, log_severity_level=3)
    return lambda: sess.run(["out"], feeds)[0]


def weights_read(op: str, call: dict, attrs: dict) -> int:
    """Bytes of expert weights (and scales) of the experts the tokens select."""
    if op == "qmoe":
        idx, _ = route_qmoe(call["routerT"], attrs["k"])
    else:
        idx, _ = route_moe(call["routerT"], attrs["k"], attrs.get("normalize_routing_weights", 0))
    used = np.unique(idx).size
    experts = call["routerT"].shape[1]
    total = sum(call[k].nbytes for k in WEIGHTS[op] if call.get(k) is not None)
    return total * used // experts


def time_variant(kernel, plan, runs: int, budget: float) -> tuple[list[float], str, np.ndarray]:
    """Check one run, then time as many runs as fit ``budget`` seconds.

    Timed runs follow at least 0.5 s of warm-up (an idle GPU runs at a low clock). On a
    CPU adapter where one run alone takes longer than ``budget`` (lavapipe at prefill
    sizes) that checked run's wall time is reported instead, upload and readback included
    (on a GPU the check run's time is mostly the weight upload, so it is always timed).
    """
    start = time.perf_counter()
    out = kernel.run(plan)["outputT"]
    once = time.perf_counter() - start
    if once > budget and kernel.device.kind != "gpu":
        return [once], "wall (one run, with upload and readback)", out
    n = max(1, min(runs, int(budget / max(once, 1e-6))))
    times, method = kernel.time(plan, runs=n, warmup=1, warmup_seconds=0.5)
    return times, method, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="*", default=["qmoe", "moe"], choices=sorted(OPS))
    parser.add_argument("--cases", nargs="*", default=None)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--budget", type=float, default=20.0)
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--ort-threads", type=int, default=None)
    args = parser.parse_args()

    device = default_device()
    print(
        f"adapter: {device.description} ({device.kind}); subgroup size "
        f"{device.adapter_info.get('subgroupMinSize', '?')}; "
        f"timestamps: {'timestamp-query' in device.features}"
    )
    print(f"ORT CPU threads: {args.ort_threads or 'default'} of {os.cpu_count()} cores")
    bandwidth = copy_bandwidth(device)
    print(f"copy kernel bandwidth (read+write): {bandwidth / 1e9:.1f} GB/s")
    rng = np.random.default_rng(0)
    rows, winners = _Rows(), []
    for op in args.ops:
        kernel = get_kernel(OPS[op])
        folder = next(f for f in package_folders() if f.name == op)
        for case in load_cases(folder / "bench.json"):
            if args.cases and case.name not in args.cases:
                continue
            # Every tensor must fit one storage binding (the packages' bindingsFit rule):
            # checked on shapes, before gigabytes of random weights are drawn.
            limit = min(
                device.limits["maxStorageBufferBindingSize"], device.limits["maxBufferSize"]
            )
            too_big = {
                k: math.prod(v["shape"]) * _dtype(v).itemsize
                for k, v in case.inputs.items()
                if v is not None and math.prod(v["shape"]) * _dtype(v).itemsize > limit
            }
            if too_big and not args.all:
                print(
                    f"skip {op}/{case.name}: {too_big} bytes exceed this adapter's "
                    f"{limit}-byte storage binding"
                )
                continue
            t0 = time.perf_counter()
            call = case.materialize(rng)
            run_ort = ort_session(op, call, case.attrs, args.ort_threads)
            reference = run_ort()
            ort_s = median(wall_times(run_ort, max(3, min(args.runs, 10))))
            used = weights_read(op, call, case.attrs)
            best = None
            probe = None
            try:
                probe = kernel.plan(attrs=case.attrs, **call)
            except KernelCallError as exc:
                reason = str(exc).split(": ", 1)[-1]
            for vid in kernel.variants:
                if probe is None or vid in probe.rejected:
                    if vid.endswith("zero_inter"):
                        continue
                    why = reason if probe is None else probe.rejected[vid]
                    rows.append(
                        [
                            op,
                            case.name,
                            vid,
                            "-",
                            f"{ort_s * 1e3:.2f}",
                            "-",
                            "-",
                            f"n/a: {why[:100]}",
                        ]
                    )
                    continue
                plan = kernel.plan(attrs=case.attrs, variant=vid, **call)
                times, method, out = time_variant(kernel, plan, args.runs, args.budget)
                t = median(times)
                if best is None or t < best[1]:
                    best = (vid, t)
                rows.append(
                    [
                        op,
                        case.name,
                        vid,
                        f"{t * 1e3:.2f}",
                        f"{ort_s * 1e3:.2f}",
                        f"{ort_s / t:.3g}x",
                        f"{used / t / bandwidth:.1%}",
                        f"{method} x{len(times)}, rel err vs ORT {rel_err(out, reference):.1e}",
                    ]
                )
            if best:
                winners.append(
                    [op, case.name, best[0], f"{best[1] * 1e3:.2f}", f"{ort_s * 1e3:.2f}"]
                )
            print(f"done {op}/{case.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    print()
    print_table(
        [
            "op",
            "case",
            "variant",
            "kernel ms (median)",
            "ORT CPU ms",
            "ORT/kernel",
            "weight bytes/s vs copy",
            "notes",
        ],
        rows,
    )
    print()
    print_table(["op", "case", "fastest variant", "kernel ms", "ORT CPU ms"], winners)


class _Rows(list):
    """Table rows, each also printed as it comes (a run cut short keeps its results)."""

    def append(self, row: list) -> None:
        print("row: " + " | ".join(str(c) for c in row), flush=True)
        super().append(row)


def _dtype(spec: dict) -> np.dtype:
    from onnx_moe_fuse.kernels.planner import MANIFEST_DTYPES

    return MANIFEST_DTYPES[spec["dtype"]]


if __name__ == "__main__":
    main()
