"""Time recognition: fusing an N-layer stacked int4 MoE model, beside another checkout.

Issue 18 asks that fusing a 48-layer model takes no longer than 1.2x what it took before the
analysis of meaning (its fast paths must still hit first). This script times the in-memory
fuse (no file I/O; the model built once per process, ``stacked_moe_model(layers, hidden=64,
inter=32, experts=8)``) in this checkout's interpreter and, with ``--against PYTHON``, in
another checkout's venv interpreter (an older commit's worktree), alternating runs so that the
machine's load falls on both alike, and prints each run, the medians and the ratio::

    .venv/bin/python benchmarks/bench_recognition.py [--layers 48] [--runs 3]
        [--against /path/to/old-worktree/.venv/bin/python]

Each run is a fresh subprocess (no warm caches between runs); the time excludes building the
model and importing the package.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, sys, time
from onnx_moe_fuse import fuse
from onnx_moe_fuse.samples.stacked import stacked_moe_model
model = stacked_moe_model(int(sys.argv[1]), hidden=64, inter=32, experts=8)
start = time.perf_counter()
result = fuse(model)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "fused": len(result.report.fusions)}))
"""


def _run(python: str, layers: int) -> dict:
    out = subprocess.run(
        [python, "-c", _CHILD, str(layers)],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Time the fuse here (and against another interpreter); print medians and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--against", default=None, help="another checkout's venv python")
    args = parser.parse_args(argv)
    pythons = {"this tree": sys.executable}
    if args.against:
        pythons["against"] = args.against
    times: dict[str, list[float]] = {name: [] for name in pythons}
    for i in range(args.runs):
        for name, python in pythons.items():
            got = _run(python, args.layers)
            times[name].append(got["seconds"])
            print(f"run {i + 1} {name:10} {got['seconds']:7.2f} s  ({got['fused']} layers fused)")
    for name, ts in times.items():
        print(f"{name:10} median {statistics.median(ts):.2f} s over {len(ts)} runs")
    if args.against:
        ratio = statistics.median(times["this tree"]) / statistics.median(times["against"])
        print(f"ratio this tree / against: {ratio:.2f}x (load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
