"""Per-layer verification: each fused layer against the original region it replaced, one at a time.

Whole-model verification (:func:`onnx_moe_fuse.verify.checker.verify`) runs both models whole,
so it needs every weight of both in memory, several times over (a 4-layer, 361 MiB model peaked
at 7.9 GiB). :func:`verify_layers` instead takes each fusion of the report in turn, cuts the two
regions out of the model files (:func:`.regions.layer_models`: protos without data, types by
shape inference), and runs the same checker on the pair: fresh random inputs per seed, the
original region on the reference path (with :func:`.regions.select_before_dequantize`: only
the selected experts dequantised, an exact identity; its gathered expert weights read from
memory maps of the data file, :mod:`.mapped_weights`, so only the picked experts' pages are
read), the fused region on ONNX Runtime (which maps the layer's weights from the fused data
file itself: no copy in this process) and on the WebGPU kernels (which read them). Memory is
then one layer's, whatever the model's size, and each layer's error and time are reported.

Before it starts, :func:`estimate_bytes` sizes the largest layer's run (its weights on both
sides, as numpy arrays and as ORT's and the adapter's copies, plus a fixed budget); when that
is more than the memory available it refuses with :class:`VerifyMemoryError` naming the
figures, before any work.

A fused layer whose weight tensor is larger than the adapter's largest storage binding cannot
run on the WebGPU kernels there (a software adapter binds 128 MiB; a Qwen3-30B-A3B layer's FC1
is 192 MiB): that layer's WebGPU path is skipped, with the figures as its reason, and ORT
alone compares it.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnx_moe_fuse.errors import MoEFuseError
from onnx_moe_fuse.io.model_io import load_model
from onnx_moe_fuse.io.output_paths import size_text
from onnx_moe_fuse.io.processes import single_threaded_blas, worker_context
from onnx_moe_fuse.verify.checker import PATHS, verify
from onnx_moe_fuse.verify.coverage import covering_feeds
from onnx_moe_fuse.verify.mapped_weights import UnpackFourBit, map_gathered_weights
from onnx_moe_fuse.verify.quant_error import QuantizedTolerance
from onnx_moe_fuse.verify.reference import (
    DEFAULT_DIM_VALUES,
    reference_evaluator,
)
from onnx_moe_fuse.verify.reference_dq import DequantizeLinear
from onnx_moe_fuse.verify.reference_matmul import DequantizeMatMul, fuse_dequantize_matmul
from onnx_moe_fuse.verify.regions import (
    layer_models,
    select_before_dequantize,
    value_infos,
)
from onnx_moe_fuse.verify.selected_only import wgpu_on_selected

__all__ = ["FIXED_BYTES", "VerifyMemoryError", "estimate_bytes", "verify_layers"]

#: The working budget of a layer's run besides its weights (interpreter, ORT, wgpu, feeds).
FIXED_BYTES = 400 << 20


class VerifyMemoryError(MoEFuseError, MemoryError):
    """Per-layer verification would not fit in the memory available (a bad-input error)."""


def _tensor_bytes(t: onnx.TensorProto) -> int:
    info = {e.key: e.value for e in t.external_data}
    if "length" in info:
        return int(info["length"])
    return len(t.raw_data) or t.ByteSize()


def _weights(model: onnx.ModelProto) -> int:
    return sum(_tensor_bytes(t) for t in model.graph.initializer)


def estimate_bytes(original: int, fused: int, on_adapter: bool = True) -> int:
    """Peak bytes of one layer's run with ``original`` and ``fused`` bytes of weights.

    The original's weights once (the reference reads them from memory maps, whose pages are
    resident once touched, and every expert is selected; it widens one picked expert at a
    time); the fused weights as ORT maps and prepacks them (2x) and, when the WebGPU path
    runs (``on_adapter``), as read for the adapter (3x); plus :data:`FIXED_BYTES`. Measured
    on a Qwen3-30B-A3B-size int4 layer (361 MiB): 575 MiB, against 1480 MiB estimated.
    """
    return original + (3 if on_adapter else 2) * fused + FIXED_BYTES


def available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _binding_limit() -> int | None:
    """The WebGPU adapter's largest storage binding in bytes (None: no adapter)."""
    try:
        from onnx_moe_fuse.kernels import default_device

        return int(default_device().limits["maxStorageBufferBindingSize"])
    except Exception:  # no adapter: the checker's own wgpu path says why
        return None


def _too_big_for_adapter(fused: onnx.ModelProto, limit: int | None) -> str | None:
    if limit is None:
        return None
    big = [(t.name, _tensor_bytes(t)) for t in fused.graph.initializer if _tensor_bytes(t) > limit]
    if not big:
        return None
    listed = ", ".join(f"{n} {size_text(b)}" for n, b in big)
    return (
        f"the WebGPU adapter binds at most {size_text(limit)} per storage buffer and this "
        f"layer's {listed} is larger; ORT compares the layer"
    )


def _max_rel(report: Any) -> float:
    errs = [o.max_rel for p in report.paths.values() for o in p.outputs.values() if o.per_seed]
    return max(errs) if errs else float("nan")


def _reference_outputs(
    original: onnx.ModelProto, base_dir: Path, feeds: Mapping[int, Mapping[str, np.ndarray]]
) -> dict[int, dict[str, np.ndarray]]:
    """The original region's outputs on each seed's ``feeds``.

    ``original``'s external weights are read from ``base_dir``: those only gathered, from
    memory maps (:func:`.mapped_weights.map_gathered_weights`), the others into memory.
    """
    mapped = onnx.ModelProto()
    mapped.CopyFrom(original)
    weights = map_gathered_weights(mapped, base_dir)
    fuse_dequantize_matmul(mapped)
    mapped = load_model(mapped, base_dir=base_dir)
    evaluator = reference_evaluator(
        mapped, extra_ops=(DequantizeLinear, UnpackFourBit, DequantizeMatMul)
    )
    names = list(evaluator.output_names)
    out = {}
    for seed, given in feeds.items():
        out[seed] = dict(zip(names, evaluator.run(names, {**given, **weights}), strict=True))
    return out


def _peak_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _cpu_seconds() -> float:
    """This process's user + system CPU seconds (a fresh process: the job's own)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def reference_job(
    orig_cut: onnx.ModelProto, original_path: Path, feeds: Mapping[int, Mapping[str, np.ndarray]]
) -> tuple[dict[int, dict[str, np.ndarray]], float, float]:
    """A layer's first process: the original region's outputs per seed, peak MiB, CPU s."""
    single_threaded_blas()  # one matrix-vector product per picked expert: no hand-offs
    select_before_dequantize(orig_cut)
    refs = _reference_outputs(orig_cut, original_path.parent, feeds)
    return refs, _peak_mib(), _cpu_seconds()


def fused_job(
    name: str,
    orig_cut: onnx.ModelProto,
    fused_cut: onnx.ModelProto,
    fused_path: Path,
    feeds: Mapping[int, Mapping[str, np.ndarray]],
    quantization: QuantizedTolerance | None,
    limit: int | None,
    references: dict[int, dict[str, np.ndarray]],
) -> dict[str, Any]:
    """A layer's second process: the fused region compared with ``references``; the record."""
    adapter_note = _too_big_for_adapter(fused_cut, limit)
    paths = tuple(p for p in PATHS if not (adapter_note and p == "wgpu"))
    del orig_cut.graph.initializer[:]  # its inputs and outputs are all verify reads now
    report = verify(
        orig_cut,
        fused_cut,  # weights left in their file: ORT maps them, the wgpu path reads them
        seeds=list(feeds),
        paths=paths,
        quantization=quantization,
        references=references,
        fused_data_folder=fused_path.parent,
        feeds=feeds,
    )
    record: dict[str, Any] = {
        "layer": name,
        "passed": report.passed,
        "max_rel": _max_rel(report),
        "peak_rss_mib": _peak_mib(),
        "cpu_seconds": _cpu_seconds(),
        **report.to_dict(),
    }
    if adapter_note:
        selected = wgpu_on_selected(
            verify, orig_cut, fused_cut, fused_path.parent, feeds, references, limit,
            quantization=quantization,
        )  # fmt: skip
        if selected is None:
            record["paths"]["wgpu"] = {"status": "skipped", "reason": adapter_note}
        else:
            wgpu, messages = selected
            record["paths"]["wgpu"] = wgpu.to_dict()
            record["messages"] = [*record["messages"], *messages]
            record["passed"] = record["passed"] and wgpu.status != "failed" and not messages
            errs = [o.max_rel for o in wgpu.outputs.values() if o.per_seed]
            record["max_rel"] = max([record["max_rel"], *errs])
        record["cpu_seconds"] = _cpu_seconds()
        record["peak_rss_mib"] = _peak_mib()
    return record


def _verify_layer(
    pool: ProcessPoolExecutor,
    fusion: Mapping[str, Any],
    orig_cut: onnx.ModelProto,
    fused_cut: onnx.ModelProto,
    paths: tuple[Path, Path],
    seeds: tuple[int, ...],
    quantization: QuantizedTolerance | None,
    limit: int | None,
) -> dict[str, Any]:
    """One layer: its original region in one fresh process, then its fused one in the next.

    The inputs are drawn here, once for both, so that every expert is selected
    (:func:`.coverage.covering_feeds`; seeds are added when the given ones are too few).
    """
    original_path, fused_path = paths
    start = time.perf_counter()
    feeds, experts = covering_feeds(orig_cut, fused_cut, seeds, DEFAULT_DIM_VALUES)
    refs, ref_peak, ref_cpu = pool.submit(reference_job, orig_cut, original_path, feeds).result()
    job = (fusion["name"], orig_cut, fused_cut, fused_path, feeds, quantization, limit, refs)
    record = pool.submit(fused_job, *job).result()
    record["seconds"] = round(time.perf_counter() - start, 3)
    record["cpu_seconds"] = round(record["cpu_seconds"] + ref_cpu, 3)
    record["peak_rss_mib"] = max(record["peak_rss_mib"], ref_peak)
    record["experts"] = experts
    return record


def verify_layers(
    original_path: str | os.PathLike[str],
    fused_path: str | os.PathLike[str],
    fusions: Sequence[Mapping[str, Any]],
    *,
    seeds: Sequence[int] = (0, 1, 2),
    quantization: QuantizedTolerance | None = None,
    progress: Any = None,
    jobs: int = 1,
) -> dict[str, Any]:
    """Verify every fusion of ``fusions`` layer by layer; the report's ``verification`` section.

    ``original_path`` and ``fused_path`` are model files (their data beside them). ``jobs``
    layers are verified at once, each in processes of its own (fewer when ``jobs`` of the
    largest layer's estimate would not fit in the memory available). Returns
    ``{"mode": "per-layer", "passed", "seeds", "estimate_mib", "jobs", "layers": [...]}``,
    each layer with its ``seconds``, ``max_rel`` (the worst relative error over paths,
    outputs and seeds), its paths' results and messages. Raises :class:`VerifyMemoryError`
    before any work when the largest layer's estimate exceeds the memory available.
    """
    original_path, fused_path = Path(original_path), Path(fused_path)
    original = onnx.load(str(original_path), load_external_data=False)
    fused = onnx.load(str(fused_path), load_external_data=False)
    infos = {**value_infos(original), **value_infos(fused)}
    cuts = [(f, *layer_models(original, fused, f, infos)) for f in fusions]
    limit = _binding_limit()
    worst = max(
        (estimate_bytes(_weights(o), _weights(z), not _too_big_for_adapter(z, limit))
         for _, o, z in cuts),
        default=0,
    )  # fmt: skip
    available = available_bytes()
    if available is not None and worst > available:
        raise VerifyMemoryError(
            f"per-layer verification of {original_path} needs about {size_text(worst)} for its "
            f"largest layer but {size_text(available)} of memory is available; free memory or "
            "fuse without --verify"
        )
    jobs = max(1, min(int(jobs), len(cuts) or 1))
    if available is not None and worst:
        jobs = max(1, min(jobs, available // worst))  # each job's processes hold one layer
    context = worker_context(__name__)
    layers: list[dict[str, Any]] = []
    # fresh processes per region: all of its memory goes back when it ends (in one process
    # glibc's arenas kept a fraction of each layer: 2.1 GiB for one, 4.7 for eight); a
    # thread per job waits on its layer's two processes in turn
    with (
        ProcessPoolExecutor(max_workers=jobs, mp_context=context, max_tasks_per_child=1) as pool,
        ThreadPoolExecutor(max_workers=jobs) as waiters,
    ):
        futures = [
            waiters.submit(_verify_layer, pool, fusion, orig_cut, fused_cut,
                           (original_path, fused_path), tuple(int(s) for s in seeds),
                           quantization, limit)
            for fusion, orig_cut, fused_cut in cuts
        ]  # fmt: skip
        for i, future in enumerate(futures):
            layers.append(future.result())
            if progress is not None:
                progress(i + 1, len(cuts), layers[-1])
    return {
        "mode": "per-layer",
        "passed": bool(layers) and all(r["passed"] for r in layers),
        "seeds": [int(s) for s in seeds],
        "estimate_mib": round(worst / 2**20, 1),
        "jobs": jobs,
        "layers": layers,
    }
