"""Helpers shared by the benchmark scripts: medians, errors, the copy-bandwidth ceiling, tables.

Benchmarks are scripts, not tests: they print medians and ratios against references run
side by side in the same process. Absolute kernel times mean something only on a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

COPY_WGSL = """
@group(0) @binding(0) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<u32>>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(num_workgroups) grid: vec3<u32>) {
    let i = gid.x + gid.y * grid.x * 256u;
    if (i < arrayLength(&src)) {
        dst[i] = src[i];
    }
}
"""


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """``max|got - want| / max|want|``, in float64."""
    w = want.astype(np.float64)
    return float(np.abs(got.astype(np.float64) - w).max() / max(np.abs(w).max(), 1e-30))


def median(values: list[float]) -> float:
    """The median of ``values``."""
    return float(statistics.median(values))


def wall_times(fn: Callable[[], Any], runs: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn`` by wall clock, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def copy_bandwidth(device: Any, nbytes: int = 256 << 20, runs: int = 10) -> float:
    """Bytes per second moved (read + write counted) by a vec4 copy kernel on ``device``.

    Timed with timestamp queries where the adapter has them, else by wall clock.
    """
    import wgpu

    from onnx_moe_fuse.kernels.runtime import _timestamp_period_ns

    d = device.device
    nbytes = min(nbytes, device.limits["maxStorageBufferBindingSize"] // 16 * 16)
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST
    src = d.create_buffer(label="bench.copy.src", size=nbytes, usage=usage)
    dst = d.create_buffer(label="bench.copy.dst", size=nbytes, usage=usage)
    module = d.create_shader_module(label="bench.copy", code=COPY_WGSL)
    pipeline = d.create_compute_pipeline(
        label="bench.copy", layout="auto", compute={"module": module, "entry_point": "main"}
    )
    group = d.create_bind_group(
        label="bench.copy",
        layout=pipeline.get_bind_group_layout(0),
        entries=[
            {"binding": 0, "resource": {"buffer": src}},
            {"binding": 1, "resource": {"buffer": dst}},
        ],
    )
    groups = -(-(nbytes // 16) // 256)
    max_dim = device.limits["maxComputeWorkgroupsPerDimension"]
    rows = -(-groups // max_dim)
    grid = (-(-groups // rows), rows, 1)
    timestamps = "timestamp-query" in device.features
    queries = (
        d.create_query_set(label="bench.copy", type="timestamp", count=2 * runs)
        if timestamps
        else None
    )
    resolved = d.create_buffer(
        label="bench.copy.ts",
        size=16 * runs,
        usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC,
    )

    def encode(encoder: Any, index: int | None) -> None:
        writes = None
        if queries is not None and index is not None:
            writes = {
                "query_set": queries,
                "beginning_of_pass_write_index": 2 * index,
                "end_of_pass_write_index": 2 * index + 1,
            }
        compute = encoder.begin_compute_pass(label="bench.copy", timestamp_writes=writes)
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, group)
        compute.dispatch_workgroups(*grid)
        compute.end()

    warm = d.create_command_encoder(label="bench.copy.warmup")
    for _ in range(3):
        encode(warm, None)
    d.queue.submit([warm.finish()])
    d._poll_wait()
    if queries is not None:
        encoder = d.create_command_encoder(label="bench.copy")
        for i in range(runs):
            encode(encoder, i)
        encoder.resolve_query_set(queries, 0, 2 * runs, resolved, 0)
        d.queue.submit([encoder.finish()])
        ticks = np.frombuffer(d.queue.read_buffer(resolved), dtype=np.uint64).astype(np.float64)
        seconds = list((ticks[1::2] - ticks[0::2]) * _timestamp_period_ns(d) * 1e-9)
    else:
        seconds = []
        for _ in range(runs):
            encoder = d.create_command_encoder(label="bench.copy")
            encode(encoder, None)
            start = time.perf_counter()
            d.queue.submit([encoder.finish()])
            d._poll_wait()
            seconds.append(time.perf_counter() - start)
    for buf in (src, dst, resolved):
        buf.destroy()
    return 2 * nbytes / median(seconds)


def print_table(header: list[str], rows: list[list[Any]]) -> None:
    """Print rows as an aligned text table (markdown-compatible)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for n, row in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
