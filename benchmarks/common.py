"""Helpers shared by the benchmark scripts: medians, errors, the copy-bandwidth ceiling, tables.

Benchmarks are scripts, not tests: they print medians and ratios against references run
side by side in the same process. Absolute kernel times mean something only on a GPU.
The ceilings measured in the same run: a vec4 copy kernel's bandwidth (the decode
ceiling) and a vec4 FMA kernel's float32 rate (the prefill ceiling).
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


# Eight independent vec4 FMA chains per invocation (enough to hide the FMA latency), a
# runtime trip count so the loop cannot be folded, one store so it cannot be removed.
FMA_WGSL = """
@group(0) @binding(0) var<storage, read_write> dst: array<vec4<f32>>;
struct Params { trips: u32, seed: f32 }
@group(0) @binding(1) var<uniform> params: Params;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(num_workgroups) grid: vec3<u32>) {
    let i = gid.x + gid.y * grid.x * 256u;
    let m = vec4<f32>(0.999, 0.998, 0.997, 0.996);
    let c = vec4<f32>(params.seed);
    var a0 = vec4<f32>(f32(i)); var a1 = a0 + c; var a2 = a1 + c; var a3 = a2 + c;
    var a4 = a3 + c; var a5 = a4 + c; var a6 = a5 + c; var a7 = a6 + c;
    for (var t = 0u; t < params.trips; t = t + 1u) {
        a0 = fma(a0, m, c); a1 = fma(a1, m, c); a2 = fma(a2, m, c); a3 = fma(a3, m, c);
        a4 = fma(a4, m, c); a5 = fma(a5, m, c); a6 = fma(a6, m, c); a7 = fma(a7, m, c);
    }
    dst[i] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
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


def _pipeline(d, label: str, wgsl: str, buffers: list) -> tuple:
    """A compute pipeline of ``wgsl``'s ``main`` and its bind group (binding i = buffers[i])."""
    module = d.create_shader_module(label=label, code=wgsl)
    pipeline = d.create_compute_pipeline(
        label=label, layout="auto", compute={"module": module, "entry_point": "main"}
    )
    group = d.create_bind_group(
        label=label,
        layout=pipeline.get_bind_group_layout(0),
        entries=[{"binding": i, "resource": {"buffer": b}} for i, b in enumerate(buffers)],
    )
    return pipeline, group


def copy_bandwidth(device: Any, nbytes: int = 256 << 20, runs: int = 10) -> float:
    """Bytes per second moved (read + write counted) by a vec4 copy kernel on ``device``.

    Timed with timestamp queries where the adapter has them, else by wall clock.
    """
    import wgpu

    from onnx_moe_fuse.kernels.runtime import timestamp_period_ns

    d = device.device
    nbytes = min(nbytes, device.limits["maxStorageBufferBindingSize"] // 16 * 16)
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST
    src = d.create_buffer(label="bench.copy.src", size=nbytes, usage=usage)
    dst = d.create_buffer(label="bench.copy.dst", size=nbytes, usage=usage)
    pipeline, group = _pipeline(d, "bench.copy", COPY_WGSL, [src, dst])
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
        seconds = list((ticks[1::2] - ticks[0::2]) * timestamp_period_ns(d) * 1e-9)
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


def _gpu_seconds(device: Any, encode: Callable[[Any, dict | None], None], runs: int) -> list[float]:
    """Seconds per run of ``encode`` (one compute pass), by timestamps where available."""
    import wgpu

    from onnx_moe_fuse.kernels.runtime import timestamp_period_ns

    d = device.device
    warm = d.create_command_encoder(label="bench.warmup")
    for _ in range(3):
        encode(warm, None)
    d.queue.submit([warm.finish()])
    d._poll_wait()
    if "timestamp-query" not in device.features:
        seconds = []
        for _ in range(runs):
            encoder = d.create_command_encoder(label="bench.timed")
            encode(encoder, None)
            start = time.perf_counter()
            d.queue.submit([encoder.finish()])
            d._poll_wait()
            seconds.append(time.perf_counter() - start)
        return seconds
    queries = d.create_query_set(label="bench.timestamps", type="timestamp", count=2 * runs)
    resolved = d.create_buffer(
        label="bench.timestamps",
        size=16 * runs,
        usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC,
    )
    encoder = d.create_command_encoder(label="bench.timed")
    for i in range(runs):
        encode(
            encoder,
            {
                "query_set": queries,
                "beginning_of_pass_write_index": 2 * i,
                "end_of_pass_write_index": 2 * i + 1,
            },
        )
    encoder.resolve_query_set(queries, 0, 2 * runs, resolved, 0)
    d.queue.submit([encoder.finish()])
    ticks = np.frombuffer(d.queue.read_buffer(resolved), dtype=np.uint64).astype(np.float64)
    resolved.destroy()
    return list((ticks[1::2] - ticks[0::2]) * timestamp_period_ns(d) * 1e-9)


def fma_rate(device: Any, runs: int = 10) -> float:
    """float32 FLOP/s (an FMA counted as 2) of a WGSL kernel of independent vec4 FMA chains.

    The prefill ceiling: sized to fill the adapter many times over on a GPU (about 2
    million invocations x 1024 trips x 32 FMAs), much smaller on a CPU adapter.
    """
    import struct

    import wgpu

    d = device.device
    gpu = device.kind == "gpu"
    invocations, trips = (1 << 21, 1024) if gpu else (1 << 13, 64)
    dst = d.create_buffer(
        label="bench.fma.dst", size=16 * invocations, usage=wgpu.BufferUsage.STORAGE
    )
    params = d.create_buffer_with_data(
        label="bench.fma.params",
        data=struct.pack("<If8x", trips, 1e-3),
        usage=wgpu.BufferUsage.UNIFORM,
    )
    pipeline, group = _pipeline(d, "bench.fma", FMA_WGSL, [dst, params])
    groups = invocations // 256
    max_dim = device.limits["maxComputeWorkgroupsPerDimension"]
    rows = -(-groups // max_dim)
    grid = (groups // rows, rows, 1)

    def encode(encoder: Any, writes: dict | None) -> None:
        compute = encoder.begin_compute_pass(label="bench.fma", timestamp_writes=writes)
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, group)
        compute.dispatch_workgroups(*grid)
        compute.end()

    seconds = _gpu_seconds(device, encode, runs)
    dst.destroy()
    params.destroy()
    flops = 2.0 * 32 * trips * grid[0] * grid[1] * 256
    return flops / min(seconds)


def print_table(header: list[str], rows: list[list[Any]]) -> None:
    """Print rows as an aligned text table (markdown-compatible)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for n, row in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
