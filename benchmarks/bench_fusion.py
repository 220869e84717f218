"""What fusion buys: ONNX Runtime CPU latency and peak memory, original vs fused, one MoE layer.

Builds one MoE layer at Qwen3-30B-A3B sizes (H=2048, I=768, E=128, k=8; int4 weights blocked
32, behind DequantizeLinear; the Gather/Expand/MatMul decomposition ORT can run) with the
sample generator, fuses it with the tool (timed), then runs each model in ONNX Runtime's CPU
provider at 1, 16 and 128 tokens. Every (model, tokens) session runs in its own process with
the same intra-op thread count; the parent watches the child's resident memory and stops it
past --mem-limit-gb, reporting "out of memory". Prints medians over --runs calls and the
ratio original/fused, plus peak resident memory.

A second table (``--float-scale``, 0 skips it) takes the same layer with float32 weights and
compares, side by side: the unfused float layer, the fused float ``MoE``, and ``QMoE`` int4
(blocks of 32, ``--quantize int4``) with accuracy_level 0 and 4, with each QMoE's measured
quantisation error; ratios are unfused / each. When the ``openvino`` package is importable,
OpenVINO's CPU plugin runs the same unfused float layer too (a line says so when it is not;
it is no dependency of this project). The float layer is 4x the int4 one on disk (2.4 GB at
full size), so ``--float-scale`` defaults to 0.5 (H=1024, I=384, E=64) to keep the run modest
on 2 cores.

    .venv/bin/python benchmarks/bench_fusion.py [--threads 2] [--runs 5] [--tokens 1 16 128]
                                                [--float-scale 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}


def _build_layer(scale: float, weights: str = "int4b32") -> tuple[object, dict[str, int]]:
    from onnx_moe_fuse.samples.layers import LayerSpec, build_layer

    sizes = {k: max(1, int(v * scale)) if k != "top_k" else v for k, v in SIZES.items()}
    spec = LayerSpec(
        name="qwen3_30b_a3b_layer",
        hidden=sizes["hidden"],
        inter=sizes["inter"],
        experts=sizes["experts"],
        top_k=sizes["top_k"],
        routing="softmax_topk_renorm",
        activation="swiglu",
        spelling="dec",
        weights=weights,
        seed_key="bench_fusion",
    )
    return build_layer(spec), sizes


def _ort_runner(model: str, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    (feed,) = session.get_inputs()
    return feed.shape[-1], lambda x: session.run(None, {feed.name: x})


def _openvino_runner(model: str, threads: int):
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(core.read_model(model), "CPU", {"INFERENCE_NUM_THREADS": threads})
    request = compiled.create_infer_request()
    hidden = compiled.input(0).get_partial_shape()[-1].get_length()
    return hidden, lambda x: request.infer({0: x})


def _child(model: str, tokens: int, threads: int, runs: int, engine: str = "ort") -> None:
    """Run inside the child process: load, warm up, time; print one JSON line."""
    import numpy as np

    start = time.perf_counter()
    hidden, run = (_openvino_runner if engine == "openvino" else _ort_runner)(model, threads)
    load_s = time.perf_counter() - start
    x = np.random.default_rng(0).standard_normal((tokens, hidden)).astype(np.float32)
    run(x)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - start)
    # VmHWM, not ru_maxrss: ru_maxrss survives exec and would count the parent's memory.
    peak_gb = _status_gb(os.getpid(), "VmHWM:")
    print(json.dumps({"median_s": float(np.median(times)), "load_s": load_s, "peak_gb": peak_gb}))


def _status_gb(pid: int, key: str) -> float:
    """A memory figure (kB in /proc/PID/status) in GiB; 0 when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def _rss_gb(pid: int) -> float:
    return _status_gb(pid, "VmRSS:")


def _measure(
    model: Path, tokens: int, threads: int, runs: int, limit_gb: float, engine: str = "ort"
) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    child = [str(model), str(tokens), str(threads), str(runs), engine]
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", *child],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    peak = 0.0
    while proc.poll() is None:
        peak = max(peak, _rss_gb(proc.pid))
        if peak > limit_gb:
            proc.kill()
            proc.wait()
            return {"error": f"out of memory (> {limit_gb:.0f} GB resident)", "peak_gb": peak}
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode != 0:
        last = (err.strip().splitlines() or ["?"])[-1]
        return {"error": f"failed: {last[:120]}", "peak_gb": peak}
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_gb"] = max(result["peak_gb"], peak)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 128])
    parser.add_argument("--mem-limit-gb", type=float, default=16.0)
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="shrink H, I and E by this factor (a quick trial run)",
    )
    parser.add_argument(
        "--float-scale",
        type=float,
        default=0.5,
        help="the float-layer table (unfused / MoE / QMoE int4) at this fraction of the sizes; "
        "0 skips it",
    )
    parser.add_argument(
        "--child",
        nargs=5,
        metavar=("MODEL", "TOKENS", "THREADS", "RUNS", "ENGINE"),
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args()
    if args.child:
        model, tokens, threads, runs, engine = args.child
        _child(model, int(tokens), int(threads), int(runs), engine)
        return

    import onnx
    import onnxruntime

    from onnx_moe_fuse import fuse

    with tempfile.TemporaryDirectory(prefix="bench_fusion_") as tmp:
        start = time.perf_counter()
        original, sizes = _build_layer(args.scale)
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        result = fuse(original)
        fuse_s = time.perf_counter() - start
        ops = [f["op"] for f in result.report.fusions]
        paths = {"original": Path(tmp) / "original.onnx", "fused": Path(tmp) / "fused.onnx"}
        onnx.save_model(original, paths["original"])
        onnx.save_model(result.model, paths["fused"])
        del original, result
        print(
            f"layer: {sizes}, int4 blocked 32, SwiGLU, softmax-top-k-renormalised; "
            f"built in {build_s:.1f} s"
        )
        print(f"fusion: {ops} in {fuse_s:.2f} s (fuse() on the in-memory model, weights repacked)")
        print(
            f"onnxruntime {onnxruntime.__version__} CPU, {args.threads} threads, default "
            f"graph optimisations, median of {args.runs} runs after one warm-up; one process "
            f"per cell; memory limit {args.mem_limit_gb:.0f} GB"
        )
        print(
            "| tokens | original ms | fused ms | original / fused | original peak GB | "
            "fused peak GB |"
        )
        print("|---|---|---|---|---|---|")
        for tokens in args.tokens:
            cells = {
                name: _measure(path, tokens, args.threads, args.runs, args.mem_limit_gb)
                for name, path in paths.items()
            }
            o, f = cells["original"], cells["fused"]

            def ms(cell: dict) -> str:
                return cell["error"] if "error" in cell else f"{cell['median_s'] * 1e3:.1f}"

            ratio = (
                f"{o['median_s'] / f['median_s']:.0f}x"
                if "median_s" in o and "median_s" in f
                else "-"
            )
            print(
                f"| {tokens} | {ms(o)} | {ms(f)} | {ratio} | {o['peak_gb']:.2f} | "
                f"{f['peak_gb']:.2f} |",
                flush=True,
            )
    if args.float_scale > 0:
        _float_table(args)


def _ms(cell: dict) -> str:
    return cell["error"] if "error" in cell else f"{cell['median_s'] * 1e3:.1f}"


def _ratio(base: dict, cell: dict) -> str:
    if "median_s" not in base or "median_s" not in cell:
        return "-"
    return f"{base['median_s'] / cell['median_s']:.1f}x"


def _float_table(args: argparse.Namespace) -> None:
    """Unfused float vs MoE vs QMoE int4 (accuracy_level 0 and 4), and OpenVINO if present."""
    import importlib.util

    import onnx

    from onnx_moe_fuse import fuse

    variants = {
        "MoE": {},
        "QMoE int4": {"quantize": "int4"},
        "QMoE int4 acc4": {"quantize": "int4", "accuracy_level": 4},
    }
    with tempfile.TemporaryDirectory(prefix="bench_fusion_float_") as tmp:
        original, sizes = _build_layer(args.float_scale, "f32")
        paths = {"unfused": Path(tmp) / "unfused.onnx"}
        notes = []
        for name, options in variants.items():
            start = time.perf_counter()
            result = fuse(original, **options)
            fuse_s = time.perf_counter() - start
            (fusion,) = result.report.fusions
            quant = fusion.get("quantization")
            error = f", measured max rel error {quant['max_rel_error']:.3g}" if quant else ""
            notes.append(f"{name}: {fusion['op']} fused in {fuse_s:.1f} s{error}")
            paths[name] = Path(tmp) / f"{name.replace(' ', '_')}.onnx"
            onnx.save_model(
                result.model,
                paths[name],
                save_as_external_data=True,
                location=paths[name].name + ".data",
            )
            del result
        onnx.save_model(
            original, paths["unfused"], save_as_external_data=True, location="unfused.onnx.data"
        )
        del original
        openvino = importlib.util.find_spec("openvino") is not None
        print()
        print(
            f"float layer: {sizes}, float32 weights, SwiGLU; " + "; ".join(notes) + " "
            "(QMoE: --quantize int4, blocks of 32; acc4: --accuracy-level 4, int8 activations)"
        )
        if not openvino:
            print("openvino: not installed, its column is skipped (pip install openvino to add it)")
        head = ["tokens", "unfused ms", *(f"{n} ms" for n in variants)]
        head += [f"unfused / {n}" for n in variants]
        if openvino:
            head += ["OpenVINO unfused ms", "unfused / OpenVINO"]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for tokens in args.tokens:
            cells = {
                name: _measure(path, tokens, args.threads, args.runs, args.mem_limit_gb)
                for name, path in paths.items()
            }
            base = cells["unfused"]
            row = [str(tokens), _ms(base), *(_ms(cells[n]) for n in variants)]
            row += [_ratio(base, cells[n]) for n in variants]
            if openvino:
                ov = _measure(
                    paths["unfused"], tokens, args.threads, args.runs, args.mem_limit_gb, "openvino"
                )
                row += [_ms(ov), _ratio(base, ov)]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
