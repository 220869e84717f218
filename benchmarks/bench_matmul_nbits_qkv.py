"""Benchmark the MatMulNBitsQkv kernel beside ONNX Runtime CPU's composition.

Runs every case of ``kernels/matmul_nbits_qkv/bench.json`` (decode: 1 row, prefill: 128 rows;
K=2048, Nq=2048, Nkv=512, 4-bit blocks of 32; float32 and float16; with and without skip) and
prints, per case, medians of:

* ``device``: the kernel's passes alone (``Kernel.time``: inputs uploaded, then one run timed
  from the start of its first pass to the end of its last by timestamp queries where the
  adapter has them, by wall clock around submit and wait otherwise);
* ``call``: one whole ``kernel(...)`` call (buffer creation, upload, passes, readback);
* ``ort``: ONNX Runtime CPU running the composition MatMulNBitsQkv replaces,
  (Skip)SimplifiedLayerNormalization + 3 x com.microsoft.MatMulNBits (accuracy_level 0), weights
  as initializers, default graph optimisations, ``--threads`` intra-op threads;

and the ratios ``device / ort`` and ``call / ort`` (above 1: the kernel is slower). Each of the
``--repeats`` rounds times ORT once and then each variant once, so load from other processes
falls on all of them alike.

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_matmul_nbits_qkv.py [--cases decode] [--repeats 5]

The adapter is the project's default (``ONNX_MOE_FUSE_ADAPTER`` picks another). On a machine
without a GPU that is Mesa's lavapipe: the kernel then runs on the same CPU cores as ORT, so
the numbers compare two CPU implementations, not a GPU with a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import rel_err  # noqa: E402


def device_once(kernel, plan) -> tuple[float, str]:
    """Seconds of one run of the plan's passes (``Kernel.time``), and how it was timed."""
    times, method = kernel.time(plan, runs=1, warmup=1, warmup_seconds=0.0)
    return times[0], method


def call_once(kernel, call: dict, attrs: dict, variant: str) -> float:
    start = time.perf_counter()
    kernel(**call, attrs=attrs, variant=variant)
    return time.perf_counter() - start


def ort_session(call: dict, attrs: dict, threads: int):
    """The CPU composition as a session (weights as initializers, default optimisations)."""
    from onnx_moe_fuse.verify.ort_nodes import qkv_composition_model, session

    model, feeds, names = qkv_composition_model(call, attrs)
    sess = session(model, threads=threads, optimize=True)
    outputs = dict(zip(names, sess.run(list(names.values()), feeds), strict=True))
    return sess, feeds, outputs


def ort_once(session, feeds: dict) -> float:
    start = time.perf_counter()
    session.run(None, feeds)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="", help="run only cases whose name contains this")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    from onnx_moe_fuse.kernels.cases import load_cases
    from onnx_moe_fuse.kernels.runtime import get_kernel, package_folders

    folder = next(f for f in package_folders() if f.name == "matmul_nbits_qkv")
    kernel = get_kernel("com.microsoft.MatMulNBitsQkv")
    rng = np.random.default_rng(args.seed)
    print(f"adapter: {kernel.device.description} ({kernel.device.adapter_info.get('description')})")
    print(f"ORT CPU threads: {args.threads}; medians of {args.repeats}")
    header = (
        f"{'case':<26} {'variant':<11} {'device ms':>10} {'call ms':>9} {'ORT ms':>8} "
        f"{'device/ORT':>10} {'call/ORT':>9} {'max err vs ORT':>15}"
    )
    print(header)
    print("-" * len(header))
    results = []
    for case in load_cases(folder / "bench.json"):
        if args.cases not in case.name:
            continue
        call = {k: v for k, v in case.materialize(rng).items() if v is not None}
        attrs = dict(case.attrs)
        session, feeds, ort_out = ort_session(call, attrs, args.threads)
        variants = list(case.variants)
        plans = {v: kernel.plan(**call, attrs=attrs, variant=v) for v in variants}
        errors = {}
        for variant in variants:  # also compiles the pipelines
            out = kernel(**call, attrs=attrs, variant=variant)
            errors[variant] = max(rel_err(out[k], ort_out[k]) for k in ("qT", "kT", "vT"))
        # Rounds interleave ORT and every variant, so background load hits all alike.
        ort_t, dev_t, call_t, method = [], {v: [] for v in variants}, {v: [] for v in variants}, ""
        for _ in range(args.repeats):
            ort_t.append(ort_once(session, feeds))
            for variant in variants:
                seconds, method = device_once(kernel, plans[variant])
                dev_t[variant].append(seconds)
                call_t[variant].append(call_once(kernel, call, attrs, variant))
        ort_s = statistics.median(ort_t)
        for variant in variants:
            dev_s, call_s = statistics.median(dev_t[variant]), statistics.median(call_t[variant])
            err = errors[variant]
            row = {
                "case": case.name,
                "variant": variant,
                "device_ms": dev_s * 1e3,
                "call_ms": call_s * 1e3,
                "ort_ms": ort_s * 1e3,
                "device_over_ort": dev_s / ort_s,
                "call_over_ort": call_s / ort_s,
                "max_rel_err_vs_ort": err,
                "device_timing": method,
            }
            results.append(row)
            print(
                f"{case.name:<26} {variant:<11} {row['device_ms']:>10.2f} {row['call_ms']:>9.2f} "
                f"{row['ort_ms']:>8.2f} {row['device_over_ort']:>10.2f} "
                f"{row['call_over_ort']:>9.2f} {err:>15.2e}",
                flush=True,
            )
    if results:
        print(f"\ndevice times by {results[0]['device_timing']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
