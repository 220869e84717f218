"""Does the fuser's memory grow with the model? Peak RSS of ``onnx-moe-fuse`` on 1..N-layer models.

Builds models of N stacked int4 MoE layers (:func:`onnx_moe_fuse.samples.stacked.
stacked_moe_model`: the sample generator's Gather/Expand/MatMul decomposition behind
DequantizeLinear, blocked 32; each layer's output feeds the next through a residual Add), saves
each with external data (kept in ``--folder`` and reused by later runs with the same sizes), then
runs the command line on it in a child process and reads the child's peak resident memory
(``getrusage(RUSAGE_CHILDREN)``). Side by side for reference: a child that only loads and saves
the same model through onnx-ir (``ir.load`` + ``ir.save`` with external data: lazy, streamed),
and the data file's size. The last columns say how much the peak grew over the smallest model's,
in MiB and in layers' data: a fuser that streams stays near 0; one that holds the model grows by
a few layers' bytes per layer.

``--fuser-path DIR`` puts ``DIR`` first on the fuse child's PYTHONPATH, to measure another
checkout (a folder holding an ``onnx_moe_fuse`` package) on the same models.

    .venv/bin/python benchmarks/bench_memory.py [--layers 1 2 4 8 16] [--experts 32]
        [--hidden 2048] [--inter 768] [--folder /tmp/bench_memory] [--fuser-path DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

_LOAD_SAVE = """
import sys, onnx_ir as ir
model = ir.load(sys.argv[1])
ir.save(model, sys.argv[2], external_data=sys.argv[3])
"""


_PEAK_OF = """
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-2000:] if proc.returncode else "")
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, proc.returncode)
"""


def _child_peak_mib(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """Run ``argv``; its peak RSS in MiB, its wall seconds, its exit code.

    A fresh wrapper process runs it and reports ``RUSAGE_CHILDREN`` (whose max is over that
    wrapper's one child), so each measurement is of one command alone.
    """
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_OF, *argv], capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - start
    if proc.stderr:
        print(proc.stderr, file=sys.stderr)
    peak_kib, code = proc.stdout.split()
    return int(peak_kib) / 1024.0, wall, int(code)


def _model(folder: Path, n: int, args: argparse.Namespace) -> Path:
    """The ``n``-layer model file (built unless a previous run left it)."""
    from onnx_moe_fuse.samples.stacked import stacked_moe_model

    path = folder / f"moe_{n}x{args.hidden}x{args.inter}x{args.experts}.onnx"
    data = folder / (path.name + ".data")
    if not (path.is_file() and data.is_file()):
        model = stacked_moe_model(n, args.hidden, args.inter, args.experts)
        onnx.save(model, path, save_as_external_data=True, location=data.name)
    return path


def main() -> None:
    """Build, fuse and measure each model size; print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--folder", default="/tmp/bench_memory")
    parser.add_argument("--fuser-path", help="a folder to put first on the fuse child's path")
    args = parser.parse_args()

    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "onnx_moe_fuse.cli"]
    env = dict(os.environ)
    if args.fuser_path:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(args.fuser_path).resolve()), env.get("PYTHONPATH")) if p
        )
    rows, base, layer_mib = [], None, None
    for n in sorted(args.layers):
        path = _model(folder, n, args)
        data_mib = (folder / (path.name + ".data")).stat().st_size / 2**20
        ref_mib, ref_s, _ = _child_peak_mib(
            [sys.executable, "-c", _LOAD_SAVE, str(path), str(folder / f"copy_{n}.onnx"),
             f"copy_{n}.onnx.data"]
        )  # fmt: skip
        out = folder / f"fused_{n}.onnx"
        fuse_mib, fuse_s, rc = _child_peak_mib([*cli, str(path), "-o", str(out)], env)
        for leftover in (out, folder / (out.name + ".data"), folder / f"copy_{n}.onnx",
                         folder / f"copy_{n}.onnx.data"):  # fmt: skip
            leftover.unlink(missing_ok=True)
        if base is None:
            base, layer_mib = (n, fuse_mib), data_mib / n
        growth = fuse_mib - base[1]
        extra_layers = growth / layer_mib if n != base[0] else 0.0
        rows.append(
            [
                n,
                f"{data_mib:.0f}",
                f"{ref_mib:.0f}",
                f"{fuse_mib:.0f}",
                f"{growth:+.0f}",
                f"{extra_layers:+.2f}",
                f"{ref_s:.1f}",
                f"{fuse_s:.1f}",
                rc,
            ]
        )
    print_table(
        [
            "layers",
            "data MiB",
            "load+save peak MiB",
            "fuse peak MiB",
            "growth MiB",
            "growth in layers",
            "load+save s",
            "fuse s",
            "exit",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
