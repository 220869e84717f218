"""Benchmark every valid QMoE / MoE kernel variant beside ONNX Runtime (CPU and WebGPU).

For each bench.json case (1, 16, 128 and 512 tokens at Qwen3-30B-A3B and gpt-oss-20b layer
sizes, plus reduced-expert copies whose weights fit a 128 MiB storage binding) it prints,
per variant whose ``when`` holds on this adapter: the kernel's median time (GPU timestamps
where the adapter has ``timestamp-query``, else wall clock around submit and wait), its
relative error against ORT CPU, and two ceilings measured in the same run: the expert-weight
bytes read per second against a vec4 copy kernel's bandwidth (read + write counted; the
decode ceiling) and the FLOP rate against a vec4 FMA kernel's (the prefill ceiling); for
up to 16 tokens also each dispatch's time for the decode variants (timestamps inside the
pass, where the adapter has them).
Variants that do not hold are listed with the rule that failed. A summary table follows:
per case the planner's choice, the fastest variant, ORT CPU (this process, same inputs) and
onnxruntime-webgpu (``--ort-webgpu DIR``: a ``pip install --target DIR onnxruntime-webgpu``,
run in a subprocess by ``ort_webgpu_worker.py``, see ``ort_references.py``, because it has
the import name ``onnxruntime`` too; same adapter where it finds one) with the ratios to
both. Usage::

    .venv/bin/python benchmarks/bench_moe_kernels.py [--ops qmoe moe] [--cases GLOB ...]
        [--runs 10] [--budget 20] [--all] [--ort-threads N] [--ort-webgpu DIR]
        [--ort-webgpu-results JSON] [--json OUT] [--plot PNG] [--table TXT] [--chosen-only]
        [--dtype float32 float16] [--tokens 1 16] [--stages] [--sweep JSON]

Last it prints the comparison table (``moe_report.py``): per layer and token count our
kernel (the planner's choice, and the fastest variant where others were timed) against
ORT WebGPU and ORT CPU and against the call's copy-bandwidth and FMA floors, then where the
planner's choice spends its time (timestamps before every dispatch, summed by pass, where the
adapter has ``timestamp-query-inside-passes``). ``--plot`` draws time against tokens per
layer (matplotlib), ``--table`` writes the comparison tables as text, ``--chosen-only`` times
the planner's choice alone (a shorter run), ``--dtype float32 float16`` runs every case in
both (float16: the same draws rounded, on the float16 kernels; a table of float16 against
float32 follows). On the GPU machine: ``scripts/gpu_run.sh``.

``--tokens 1 16`` keeps the cases of those token counts. ``--stages`` times, for every
timed variant, each prefix of its dispatches alone (the first n dispatches in one pass, for
n = 1 .. all; ``Kernel.prefix_times``) and prints each dispatch's added cost: unlike the
timestamps inside one pass, which overlap on the H200, these add up to the run. ``--sweep``
takes a JSON list of tunable objects (``'[{"decodeRoutedRows": 2}, {"decodeRoutedGroups":
8}]'``): every variant is timed with the base tunables and with each of these merged in
(rows labelled ``variant{...}``; a setting a variant's conditions refuse is listed so). The
decode measurement of issue 20::

    bench_moe_kernels.py --ops qmoe moe --cases '*_a3b' --tokens 1 16 --stages --no-ort \
        --variants '*decode*' '*gemv*' --budget 4 --sweep '[...]'

``--budget`` caps the seconds spent timing one (case, variant): slow adapters (lavapipe)
get fewer runs. Cases where no variant fits this adapter are skipped unless ``--all``.
``--ort-webgpu-results`` takes the onnxruntime-webgpu times of an earlier ``--json`` file
(for a run that cannot carry its wheel). For ORT releases older than 1.32 (the WebGPU
package is 1.27) nodes are written without the attributes those do not know
(``accuracy_level``, ``swiglu_limit_after_activation``, ``weights_prepacked``) where the
value written is their meaning anyway.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    copy_bandwidth,
    fma_rate,
    median,
    print_table,
    rel_err,
    wall_times,
)
from moe_report import print_report, write_plot  # noqa: E402
from ort_references import OPS, WEIGHTS, OrtCpu, OrtWebGpu  # noqa: E402

from onnx_moe_fuse.kernels.cases import load_cases  # noqa: E402
from onnx_moe_fuse.kernels.device import default_device  # noqa: E402
from onnx_moe_fuse.kernels.planner import MANIFEST_DTYPES, KernelCallError  # noqa: E402
from onnx_moe_fuse.kernels.runtime import get_kernel, package_folders  # noqa: E402
from onnx_moe_fuse.verify.oracles.moe import route_moe, route_qmoe  # noqa: E402

# -- inputs -------------------------------------------------------------------------------


class Inputs:
    """Materialises cases; weights with the same spec are drawn once and shared by cases."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self._weights: dict[str, tuple[str, np.ndarray]] = {}

    def _draw(self, spec: dict) -> np.ndarray:
        dtype, shape, kind = MANIFEST_DTYPES[spec["dtype"]], tuple(spec["shape"]), spec["random"]
        if kind == "integers":
            return self.rng.integers(spec["low"], spec["high"], size=shape, dtype=dtype)
        if kind == "uniform":
            low, high = spec.get("low", -1.0), spec.get("high", 1.0)
            return self.rng.uniform(low, high, size=shape).astype(dtype)
        out = self.rng.standard_normal(shape, dtype=np.float32)
        out *= spec.get("scale", 1.0)
        return out.astype(dtype, copy=False)

    def call(self, op: str, case) -> dict[str, np.ndarray]:
        """The case's arrays; weights reused from the previous case with the same spec."""
        out = {}
        for key, spec in case.inputs.items():
            if spec is None:
                continue
            if "random" not in spec:
                out[key] = case.materialize(self.rng)[key]
                continue
            if key not in WEIGHTS[op]:
                out[key] = self._draw(spec)
                continue
            tag = f"{op}:{json.dumps(spec, sort_keys=True)}"
            cached = self._weights.get(key)
            if cached is None or cached[0] != tag:
                self._weights.pop(key, None)  # free the old weights before drawing new ones
                cached = self._weights[key] = (tag, self._draw(spec))
            out[key] = cached[1]
        return out


def in_dtype(call: dict, dtype: str) -> dict:
    """The call with its float32 tensors (activations, biases, scales, MoE weights) in ``dtype``.

    The bench.json cases are written in float32; ``--dtype float16`` rounds the same draws to
    float16, so float16 and float32 runs of a case see (nearly) the same values.
    """
    if dtype == "float32":
        return call
    target = MANIFEST_DTYPES[dtype]
    return {k: a.astype(target) if a.dtype == np.float32 else a for k, a in call.items()}


# -- measures -----------------------------------------------------------------------------


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


def layer_flops(call: dict, attrs: dict) -> float:
    """Multiply-adds x 2 of the FFNs of every (token, selection): FC1 (+ FC3) and FC2."""
    hidden = call["inputT"].shape[-1]
    tokens = call["inputT"].size // hidden
    fc1_rows = call["fc1T"].shape[1]
    inter = fc1_rows // (2 if attrs.get("swiglu_fusion", 0) in (1, 2) else 1)
    fc3_rows = call["fc3T"].shape[1] if call.get("fc3T") is not None else 0
    return 2.0 * tokens * attrs["k"] * hidden * (fc1_rows + fc3_rows + inter)


def time_variant(kernel, plan, runs: int, budget: float) -> tuple[list[float], str, np.ndarray]:
    """Check one run, then time as many runs as fit ``budget`` seconds.

    Timed runs follow at least 0.5 s of warm-up (an idle GPU runs at a low clock). On a
    CPU adapter where one run alone takes longer than ``budget`` (lavapipe at prefill
    sizes) that checked run's wall time is reported instead, upload and readback included
    (on a GPU the check run's time is mostly the weight upload, so it is always timed).
    """
    start = time.perf_counter()
    out = kernel.run(plan, poison_outputs=True)["outputT"]
    once = time.perf_counter() - start
    if once > budget and kernel.device.kind != "gpu":
        return [once], "wall (one run, with upload and readback)", out
    n = max(1, min(runs, int(budget / max(once, 1e-6))))
    times, method = kernel.time(plan, runs=n, warmup=1, warmup_seconds=0.5)
    return times, method, out


def case_label(name: str, call: dict) -> tuple[str, int]:
    """(model, tokens) of a bench.json case name such as ``prefill128_qwen3_30b_a3b``."""
    hidden = call["inputT"].shape[-1]
    return name.split("_", 1)[1], call["inputT"].size // hidden


def variant_constants(plan) -> dict:
    """The chosen variant's template constants, evaluated (what a tunable setting changes)."""
    return {k: plan.scope.evaluate(v, k) for k, v in plan.variant.constants.items()}


def case_tokens(case) -> int:
    """A case's token count, from its input's declared shape (nothing drawn)."""
    return math.prod(case.inputs["inputT"]["shape"][:-1])


def prefix_text(prefixes: list[tuple[str, float]]) -> str:
    """Each dispatch's added cost from the prefix times, e.g. ``route 5.1 + fc1 +8.0 us``."""
    parts, before = [], 0.0
    for lab, sec in prefixes:
        parts.append(f"{lab} +{(sec - before) * 1e6:.1f}")
        before = sec
    return "prefix us: " + ", ".join(parts) + f" (= {before * 1e6:.1f})"


def _fits(case, device) -> dict[str, int]:
    """The inputs above one storage binding (the packages' bindingsFit rule), by shape."""
    limit = min(device.limits["maxStorageBufferBindingSize"], device.limits["maxBufferSize"])
    sizes = {
        k: math.prod(v["shape"]) * MANIFEST_DTYPES[v["dtype"]].itemsize
        for k, v in case.inputs.items()
        if v is not None
    }
    return {k: n for k, n in sizes.items() if n > limit}


# -- main ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="*", default=["qmoe", "moe"], choices=sorted(OPS))
    parser.add_argument("--cases", nargs="*", default=None, help="case names or globs")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--budget", type=float, default=20.0)
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--ort-threads", type=int, default=None)
    parser.add_argument("--ort-webgpu", default=None, help="pip --target dir of onnxruntime-webgpu")
    parser.add_argument(
        "--ort-webgpu-results", nargs="*", default=(), help="--json files of runs with it"
    )
    parser.add_argument("--json", default=None, help="write every measurement to this file")
    parser.add_argument("--variants", nargs="*", default=None, help="variant ids or globs")
    parser.add_argument("--tunables", default=None, help="JSON object of tunables for the plans")
    parser.add_argument("--no-ort", action="store_true", help="time the kernels only")
    parser.add_argument(
        "--skip", nargs="*", default=(), help="CASE:VARIANT globs not to time (listed as skipped)"
    )
    parser.add_argument("--ort-runs", type=int, default=10, help="ORT CPU runs per case")
    parser.add_argument("--plot", default=None, help="write time against tokens here (PNG)")
    parser.add_argument("--table", default=None, help="write the comparison tables here (text)")
    parser.add_argument("--chosen-only", action="store_true", help="time the planner's choice only")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["float32"],
        choices=["float32", "float16"],
        help="activation dtypes to run each case in (float16: the float16 kernels)",
    )
    parser.add_argument("--tokens", nargs="*", type=int, default=None, help="token counts to run")
    parser.add_argument(
        "--stages", action="store_true", help="time every variant's dispatch prefixes (GPU)"
    )
    parser.add_argument("--sweep", default=None, help="JSON list of tunable objects to try too")
    args = parser.parse_args()
    tunables = json.loads(args.tunables) if args.tunables else {}
    sweep = [{}] + (json.loads(args.sweep) if args.sweep else [])

    device = default_device()
    print(
        f"adapter: {device.description} ({device.kind}); subgroup size "
        f"{device.adapter_info.get('subgroupMinSize', '?')}; "
        f"timestamps: {'timestamp-query' in device.features}"
    )
    print(f"ORT CPU threads: {args.ort_threads or 'default'} of {os.cpu_count()} cores")
    bandwidth = copy_bandwidth(device)
    flop_rate = fma_rate(device)
    print(f"copy kernel bandwidth (read+write): {bandwidth / 1e9:.1f} GB/s")
    print(f"FMA kernel rate (float32): {flop_rate / 1e12:.2f} TFLOP/s")
    webgpu = OrtWebGpu(args.ort_webgpu) if args.ort_webgpu else None
    cpu = None if args.no_ort else OrtCpu(args.ort_threads)
    earlier = {}
    for path in args.ort_webgpu_results:
        earlier.update(json.loads(Path(path).read_text()).get("ortWebGpu", {}))
    inputs = Inputs(np.random.default_rng(0))
    rows, summary, record = _Rows(), [], {"ortWebGpu": {}, "cases": []}
    record["ceilings"] = {"copyBytesPerSecond": bandwidth, "fmaFlopPerSecond": flop_rate}
    record["adapter"] = device.description
    record["date"] = time.strftime("%Y-%m-%d")
    record["ortCpuVersion"] = None if cpu is None else cpu.version
    record["ortCpuThreads"] = args.ort_threads or f"default, {os.cpu_count()} cores"
    for op in args.ops:
        kernel = get_kernel(OPS[op])
        folder = next(f for f in package_folders() if f.name == op)
        for case, dtype in [(c, d) for c in load_cases(folder / "bench.json") for d in args.dtype]:
            if args.cases and not any(fnmatch.fnmatch(case.name, g) for g in args.cases):
                continue
            if args.tokens and case_tokens(case) not in args.tokens:
                continue
            name = case.name if dtype == "float32" else f"{case.name}@{dtype}"
            too_big = _fits(case, device)
            if too_big and not args.all:
                print(f"skip {op}/{name}: {too_big} bytes exceed one storage binding")
                continue
            t0 = time.perf_counter()
            call = in_dtype(inputs.call(op, case), dtype)
            model, tokens = case_label(case.name, call)
            if dtype != "float32":
                model = f"{model} {dtype}"  # its own rows, and its own ORT session
            reference, ort_s, ort_version = None, None, None
            if not args.no_ort:
                run_ort, ort_version = cpu.runner(op, model, call, case.attrs), cpu.version
                reference = run_ort()
                ort_s = median(wall_times(run_ort, max(1, args.ort_runs)))
            web = _webgpu(webgpu, earlier, op, name, model, call, case.attrs, reference)
            record["ortWebGpu"][f"{op}/{name}"] = web
            used = weights_read(op, call, case.attrs)
            flops = layer_flops(call, case.attrs)
            chosen, times, stage_record, prefix_record, first = None, {}, {}, {}, None
            try:
                probe = kernel.plan(attrs=case.attrs, tunables=tunables, **call)
                chosen, rejected = probe.variant_id, probe.rejected
            except KernelCallError as exc:
                rejected = {vid: str(exc).split(": ", 1)[-1] for vid in kernel.variants}
            for vid, extra in [(v, s) for v in kernel.variants for s in sweep]:
                if args.variants and not any(fnmatch.fnmatch(vid, g) for g in args.variants):
                    continue
                label = vid + (json.dumps(extra, separators=(",", ":")) if extra else "")
                if extra and vid not in rejected:
                    try:
                        swept = kernel.plan(
                            attrs=case.attrs, variant=vid, tunables=tunables | extra, **call
                        )
                    except KernelCallError as exc:
                        rows.append([op, name, label, "-", "-", "-", "-", str(exc)[-100:]])
                        continue
                    base = kernel.plan(attrs=case.attrs, variant=vid, tunables=tunables, **call)
                    if variant_constants(swept) == variant_constants(base):
                        continue  # the setting does not change this variant's shaders
                if vid in rejected:
                    if not vid.endswith("zero_inter") and not extra:
                        rows.append([op, name, vid, "-", "-", "-", "-", rejected[vid][:100]])
                    continue
                if args.chosen_only and vid != chosen:
                    continue
                if any(fnmatch.fnmatch(f"{name}:{vid}", g) for g in args.skip):
                    rows.append([op, name, label, "-", "-", "-", "-", "skipped (--skip)"])
                    continue
                plan = kernel.plan(attrs=case.attrs, variant=vid, tunables=tunables | extra, **call)
                ts, method, out = time_variant(kernel, plan, args.runs, args.budget)
                t = times[label] = median(ts)
                if reference is not None:
                    err = rel_err(out, reference)
                elif first is None:  # --no-ort: the others are checked against the first
                    err, first = float("nan"), (label, out)
                else:
                    err = rel_err(out, first[1])
                    method = f"err vs {first[0]}; {method}"
                decode = case_label(case.name, call)[1] <= 16 and ("decode" in vid or "gemv" in vid)
                # Per-dispatch times: the planner's choice, and the decode variants, as
                # many runs as fit the budget (none where one run alone overran it).
                stage_runs = min(5, int(args.budget / max(t, 1e-6)))
                if (vid == chosen or decode or args.stages) and stage_runs >= 1:
                    stages = kernel.stage_times(plan, runs=stage_runs, warmup_seconds=0.2)
                    if stages:
                        method += "; stages us: " + ", ".join(
                            f"{lab} {sec * 1e6:.1f}" for lab, sec in stages
                        )
                        stage_record[label] = stages
                if args.stages and stage_runs >= 1:
                    prefixes = kernel.prefix_times(
                        plan, runs=max(5, stage_runs), warmup_seconds=0.2
                    )
                    if prefixes:
                        method += "; " + prefix_text(prefixes)
                        prefix_record[label] = prefixes
                rows.append(
                    [
                        op,
                        name,
                        label,
                        f"{t * 1e3:.3f}",
                        f"{err:.1e}",
                        f"{used / t / bandwidth:.1%}",
                        f"{flops / t / flop_rate:.1%}",
                        f"{method} x{len(ts)}",
                    ]
                )
            entry = {
                "op": op,
                "case": name,
                "dtype": dtype,
                "model": model,
                "tokens": tokens,
                "chosen": chosen,
                "variantSeconds": times,
                "ortCpuSeconds": ort_s,
                "ortCpuVersion": ort_version,
                "weightBytes": used,
                "flops": flops,
                "tunables": tunables,
                "stageSeconds": stage_record,
                "prefixSeconds": prefix_record,
            }
            record["cases"].append(entry)
            if args.json:  # after every case: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps(record, indent=1))
            if times:
                summary.append(_summary_row(entry, web, bandwidth, flop_rate))
            print(f"done {op}/{name} in {time.perf_counter() - t0:.1f} s", flush=True)
    if webgpu:
        webgpu.close()
    print()
    header = ["op", "case", "variant", "kernel ms", "err vs ORT CPU", "weights/copy", "FLOP/FMA"]
    print_table([*header, "notes"], rows)
    print()
    print_table(
        [
            "op",
            "model",
            "tokens",
            "planner's choice",
            "fastest (ms)",
            "next best (ms)",
            "ORT WebGPU ms",
            "WebGPU/ours",
            "ORT CPU ms",
            "CPU/ours",
            "weights/copy",
            "FLOP/FMA",
        ],
        summary,
    )
    print()
    print_report(record)
    if args.table:
        import contextlib
        import io

        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            print_report(record)
        Path(args.table).write_text(text.getvalue())
    if args.plot:
        write_plot(record, args.plot)


def _webgpu(webgpu, earlier, op, name, layer, call, attrs, reference) -> dict:
    """onnxruntime-webgpu's median (or why not) for a case, printed as it comes."""
    key = f"{op}/{name}"
    if webgpu is None:
        result = earlier.get(key, {"error": "not run (no --ort-webgpu)"})
    else:
        answer, out = webgpu.run(op, layer, call, attrs, runs=5)
        if "times" in answer:
            result = {"seconds": median(answer["times"]), "version": answer["version"]}
            if reference is not None:
                result["relErrVsOrtCpu"] = rel_err(out, reference)
        else:
            result = {"error": answer["error"]}
    print(f"ORT WebGPU {key}: {result}", flush=True)
    return result


def _summary_row(entry: dict, web: dict, bandwidth: float, flop_rate: float) -> list[str]:
    ranked = sorted(entry["variantSeconds"].items(), key=lambda kv: kv[1])
    best_vid, best = ranked[0]
    nxt = f"{ranked[1][0]} {ranked[1][1] * 1e3:.3f}" if len(ranked) > 1 else "-"
    web_s, cpu_s = web.get("seconds"), entry["ortCpuSeconds"]
    return [
        entry["op"],
        entry["model"],
        str(entry["tokens"]),
        entry["chosen"] or "-",
        f"{best_vid} {best * 1e3:.3f}",
        nxt,
        f"{web_s * 1e3:.2f}" if web_s else f"n/a ({web.get('error', '')[:60]})",
        f"{web_s / best:.3g}x" if web_s else "-",
        f"{cpu_s * 1e3:.2f}" if cpu_s else "-",
        f"{cpu_s / best:.3g}x" if cpu_s else "-",
        f"{entry['weightBytes'] / best / bandwidth:.1%}",
        f"{entry['flops'] / best / flop_rate:.1%}",
    ]


class _Rows(list):
    """Table rows, each also printed as it comes (a run cut short keeps its results)."""

    def append(self, row: list) -> None:
        print("row: " + " | ".join(str(c) for c in row), flush=True)
        super().append(row)


if __name__ == "__main__":
    main()
