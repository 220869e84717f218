"""Fusing at full size: time and peak memory of ``onnx-moe-fuse`` beside plain load+save copies.

Builds N-layer Qwen3-30B-A3B-size int4 models on the fly (:mod:`scale_models`: 2048 hidden,
768 intermediate, 128 experts, top-8, int4 blocked 32, ~361 MiB a layer, external data), then
times, each in a fresh child process (median of ``--repeat`` runs; the machine may be shared,
so medians, and the spread is printed):

* ``fuse``: ``onnx-moe-fuse IN -o OUT -q`` (``--jobs`` as given, default the CLI's);
* ``fuse+verify``: the same with ``--verify`` (per-layer verification at this size);
* ``onnx load+save``: ``onnx.load`` then ``onnx.save(..., save_as_external_data=True)``
  (skipped when the model's data would not fit twice in the memory available: said so);
* ``onnx-ir load+save``: ``ir.load`` + ``ir.save(external_data=...)`` (lazy, streamed).

Peak memory is the peak of the sum of the resident memory of the child and all its
descendants (worker processes included), sampled from ``/proc`` every 20 ms. Prints a table,
the issue's Done-when checks, and writes ``bench_scale.json`` and ``bench_scale.png``
(matplotlib: ``pip install .[bench]``) into ``--out``. The models and outputs live in
``--folder``; ``--clean`` removes the models at the end (outputs are removed after each run).

    .venv/bin/python benchmarks/bench_scale.py [--layers 8 48] [--repeat 3] [--jobs N]
        [--folder /tmp/bench_scale] [--out benchmarks/results] [--skip verify,onnx] [--clean]
        [--cold]

``--cold`` evicts the model's files from the page cache before every run (:func:`evict`), so
each tool reads its input from disk, as on a first run of a large model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402
from scale_models import layer_model, stacked_model  # noqa: E402

_ONNX = (
    "import sys, onnx\nm = onnx.load(sys.argv[1])\n"
    "onnx.save(m, sys.argv[2], save_as_external_data=True, location=sys.argv[3])\n"
)
_IR = "import sys, onnx_ir as ir\nir.save(ir.load(sys.argv[1]), sys.argv[2], external_data=sys.argv[3])\n"
_PAGE = os.sysconf("SC_PAGE_SIZE")


_TICK = os.sysconf("SC_CLK_TCK")


def _tree(root: int) -> tuple[int, dict[int, float]]:
    """Bytes resident in ``root`` and its descendants now, and each one's CPU seconds so far."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/statm") as f:
                rss[int(entry)] = int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / _TICK
    total, todo, seen = 0, [root], {}
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        seen[pid] = cpu.get(pid, 0.0)
        todo.extend(children.get(pid, []))
    return total, seen


def measure(argv: list[str], log: Path) -> tuple[float, float, int, float]:
    """Run ``argv``: (wall s, peak tree RSS MiB, exit code, CPU s); its output in ``log``.

    The CPU seconds (user + system) are summed over the child and every descendant seen while
    sampling (the worker processes too; the last 20 ms of each may be missed): on a shared
    machine they vary less than the wall time.
    """
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        peak, cpu = 0, {}
        while True:
            pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            rss, seen = _tree(proc.pid)
            peak = max(peak, rss)
            cpu.update(seen)
            time.sleep(0.02)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, peak / 2**20, proc.returncode, sum(cpu.values())


def _remove(*paths: Path) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def evict(*paths: Path) -> None:
    """Drop ``paths`` from the page cache (``--cold``): each run then reads its input from disk.

    ``posix_fadvise(DONTNEED)`` on the files alone: other jobs' cached files stay cached.
    """
    for p in paths:
        if p.is_file() and hasattr(os, "posix_fadvise"):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _runs(
    name: str, argv: list[str], outputs: list[Path], repeat: int, folder: Path,
    cold: list[Path] | None = None,
) -> dict:  # fmt: skip
    walls, peaks, codes, cpus = [], [], [], []
    for r in range(repeat):
        if cold:
            evict(*cold)
        wall, peak, code, cpu = measure(argv, folder / f"{name}.log")
        _remove(*outputs)
        walls.append(wall), peaks.append(peak), codes.append(code), cpus.append(cpu)
        print(f"  {name} run {r + 1}: {wall:.1f} s, {peak:.0f} MiB, cpu {cpu:.1f} s, "
              f"exit {code}, load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        if code:
            print((folder / f"{name}.log").read_text()[-1500:], file=sys.stderr)
            break
    return {"wall_s": walls, "peak_mib": peaks, "exit": codes, "cpu_s": cpus,
            "median_s": statistics.median(walls), "median_peak_mib": statistics.median(peaks),
            "median_cpu_s": statistics.median(cpus)}  # fmt: skip


def bench(layers: int, args: argparse.Namespace, layer: Path) -> dict:
    """Every command on the ``layers``-layer model."""
    folder = Path(args.folder)
    start = time.perf_counter()
    model = stacked_model(folder, layers, layer)
    data = folder / (model.name + ".data")
    size = data.stat().st_size
    print(f"{layers} layers: {size / 2**30:.2f} GiB (built in {time.perf_counter() - start:.0f} s)")
    out = folder / "out.onnx"
    outs = [out, folder / "out.onnx.data", folder / "report.json"]
    cli = [sys.executable, "-m", "onnx_moe_fuse.cli", str(model), "-o", str(out), "-q"]
    if args.jobs:
        cli += ["--jobs", str(args.jobs)]
    result: dict = {"layers": layers, "data_bytes": size}
    cold = [model, data] if args.cold else None
    result["fuse"] = _runs("fuse", cli, outs, args.repeat, folder, cold)
    if "verify" not in args.skip:
        verify = [*cli, "--verify", "--report", str(folder / "report.json")]
        result["fuse+verify"] = _runs("fuse+verify", verify, [], 1, folder, cold)
        report = folder / "report.json"
        if report.is_file():
            result["verification"] = json.loads(report.read_text()).get("verification")
        _remove(*outs)
    copy = [str(folder / "copy.onnx"), "copy.onnx.data"]
    copies = [folder / "copy.onnx", folder / "copy.onnx.data"]
    if "onnx" not in args.skip and 2.2 * size < _available_bytes():
        result["onnx load+save"] = _runs(
            "onnx load+save", [sys.executable, "-c", _ONNX, str(model), *copy], copies,
            args.repeat, folder, cold,
        )  # fmt: skip
    elif "onnx" not in args.skip:
        result["onnx load+save"] = {"skipped": f"needs ~{2 * size / 2**30:.0f} GiB of memory"}
    result["onnx-ir load+save"] = _runs(
        "onnx-ir load+save", [sys.executable, "-c", _IR, str(model), *copy], copies,
        args.repeat, folder, cold,
    )  # fmt: skip
    if args.clean:
        _remove(model, data)
    return result


_TOOLS = ("fuse", "fuse+verify", "onnx load+save", "onnx-ir load+save")


def _cell(r: dict, tool: str) -> list[str]:
    m = r.get(tool)
    if m is None or "median_s" not in m:
        return ["-", "-", "-"] if m is None else [m.get("skipped", "-"), "-", "-"]
    spread = f" ({min(m['wall_s']):.1f}-{max(m['wall_s']):.1f})" if len(m["wall_s"]) > 1 else ""
    return [
        f"{m['median_s']:.1f}{spread}",
        f"{m['median_cpu_s']:.1f}",
        f"{m['median_peak_mib']:.0f}",
    ]


def report(results: list[dict]) -> None:
    """The table and the Done-when checks."""
    header = ["layers", "data GiB"] + [
        f"{t} {w}" for t in _TOOLS for w in ("s", "cpu s", "peak MiB")
    ]
    rows = [[r["layers"], f"{r['data_bytes'] / 2**30:.2f}"] + sum((_cell(r, t) for t in _TOOLS), [])
            for r in results]  # fmt: skip
    print_table(header, rows)
    for r in results:
        fuse, ref = r["fuse"], r.get("onnx load+save", {})
        if "median_s" in ref:
            ratio = fuse["median_s"] / ref["median_s"]
            cpu = fuse["median_cpu_s"] / ref["median_cpu_s"]
            print(f"{r['layers']} layers: fuse / onnx load+save = {ratio:.2f} wall, {cpu:.2f} "
                  f"cpu (<= 1.5: {'yes' if ratio <= 1.5 else 'NO'})")  # fmt: skip
        print(f"{r['layers']} layers: fuse peak {fuse['median_peak_mib']:.0f} MiB (<= 1024: "
              f"{'yes' if fuse['median_peak_mib'] <= 1024 else 'NO'})")  # fmt: skip
        ver = r.get("fuse+verify")
        if ver and "median_s" in ver:
            layers = (r.get("verification") or {}).get("layers") or []
            per = [x.get("seconds", 0) for x in layers]
            cpu = [x.get("cpu_seconds", float("nan")) for x in layers]
            per_layer = max(per) if per else float("nan")
            # CPU seconds besides wall: on a shared machine a layer's wall time is mostly waiting
            print(f"{r['layers']} layers: fuse+verify peak {ver['median_peak_mib']:.0f} MiB "
                  f"(<= 2048: {'yes' if ver['median_peak_mib'] <= 2048 else 'NO'}), "
                  f"slowest layer's verification {per_layer:.1f} s (<= 10: "
                  f"{'yes' if per_layer <= 10 else 'NO'}; median "
                  f"{statistics.median(per) if per else float('nan'):.1f} s, CPU a layer "
                  f"{min(cpu, default=float('nan')):.1f}-{max(cpu, default=float('nan')):.1f} s)")  # fmt: skip


def plot(results: list[dict], path: Path) -> None:
    """Median time and peak memory per tool and model size, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.2
    for j, tool in enumerate(_TOOLS):
        xs, ts, ms = [], [], []
        for i, r in enumerate(results):
            m = r.get(tool) or {}
            if "median_s" in m:
                xs.append(i + (j - 1.5) * width)
                ts.append(m["median_s"])
                ms.append(m["median_peak_mib"])
        ax_t.bar(xs, ts, width, label=tool)
        ax_m.bar(xs, ms, width, label=tool)
    for ax, title in ((ax_t, "wall time, s (median)"), (ax_m, "peak RSS, MiB (process tree)")):
        ax.set_xticks(range(len(results)), [f"{r['layers']} layers" for r in results])
        ax.set_title(title)
    ax_m.axhline(1024, color="grey", ls="--", lw=0.8)
    ax_t.legend(fontsize=8)
    fig.suptitle("onnx-moe-fuse on Qwen3-30B-A3B-size int4 models (2 shared cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    """Build, run and measure each model size; print and save the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 48])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=0, help="the fuser's --jobs (0: its default)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--folder", default="/tmp/bench_scale")
    parser.add_argument("--out", default=".")
    parser.add_argument("--skip", default="", help="comma-separated: verify, onnx")
    parser.add_argument("--clean", action="store_true", help="remove the models at the end")
    parser.add_argument(
        "--cold", action="store_true", help="evict the model from the page cache before each run"
    )
    args = parser.parse_args()
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    layer = layer_model(folder, args.hidden, args.inter, args.experts)
    results = [bench(n, args, layer) for n in sorted(args.layers)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_scale.json").write_text(json.dumps(results, indent=1))
    report(results)
    plot(results, out / "bench_scale.png")
    print(f"wrote {out / 'bench_scale.json'}, {out / 'bench_scale.png'}")
    if args.clean:
        _remove(layer, folder / (layer.name + ".data"))


if __name__ == "__main__":
    main()
