"""The device side of one kernel call: its buffers, uniform packing and dispatch commands.

:class:`CallBuffers` holds the GPU buffers of a call (tensors, intermediates, the placeholder
for absent optional tensors, uniforms); :class:`Command` is one recorded dispatch;
:func:`encode_commands` puts every dispatch of a run into one compute pass. Uniform structs
are packed by WGSL's layout rules (:func:`pack_uniform`), and buffer sizes are padded to
:data:`ALIGN` bytes (:func:`padded`). :func:`warm_up` and :func:`timestamp_period_ns` serve
the timing methods of :class:`~onnx_moe_fuse.kernels.kernel.Kernel`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from onnx_moe_fuse.kernels.planner import KernelCallError

ALIGN = 16  # buffer sizes are padded to this many bytes (vec4 loads, copy rules)


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of :data:`ALIGN` blocks (one at least)."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def pack_uniform(fields: list[tuple[str, str, Any]]) -> bytes:
    """Pack (name, WGSL type, value) fields by WGSL's uniform layout rules."""
    offset, chunks, max_align = 0, [], 4
    for name, wgsl_type, value in fields:
        lanes = 1 if "<" not in wgsl_type else int(wgsl_type[3])
        scalar = wgsl_type if lanes == 1 else wgsl_type[5:-1]
        align = {1: 4, 2: 8, 3: 16, 4: 16}[lanes]
        max_align = max(max_align, align)
        offset = -(-offset // align) * align
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if len(values) != lanes:
            raise KernelCallError(f"uniform field {name}: expected {lanes} values, got {value!r}")
        fmt = {"f32": "f", "u32": "I", "i32": "i"}[scalar]
        for v in values:
            if fmt == "I" and (not float(v).is_integer() or v < 0 or v >= 2**32):
                raise KernelCallError(f"uniform field {name} (u32) cannot hold {v!r}")
            if fmt == "i" and (not float(v).is_integer() or not -(2**31) <= v < 2**31):
                raise KernelCallError(f"uniform field {name} (i32) cannot hold {v!r}")
            chunks.append((offset, struct.pack("<" + fmt, int(v) if fmt != "f" else float(v))))
            offset += 4
    size = -(-offset // max_align) * max_align
    size = max(16, -(-size // 16) * 16)
    data = bytearray(size)
    for at, raw in chunks:
        data[at : at + 4] = raw
    return bytes(data)


@dataclass
class CallBuffers:
    """The GPU buffers of one call."""

    tensors: dict[str, Any]
    intermediates: dict[str, Any]
    dummy: Any
    uniforms: list[Any] = field(default_factory=list)

    def destroy(self) -> None:
        for buf in [
            *self.tensors.values(),
            *self.intermediates.values(),
            self.dummy,
            *self.uniforms,
        ]:
            buf.destroy()


@dataclass
class Command:
    """One recorded dispatch: pipeline, bind group and grid, encodable any number of times."""

    label: str
    pipeline: Any
    group: Any
    grid: tuple[int, int, int]

    def encode(self, compute: Any) -> None:
        compute.set_pipeline(self.pipeline)
        compute.set_bind_group(0, self.group)
        compute.dispatch_workgroups(*self.grid)


def encode_commands(
    encoder: Any, commands: list[Command], label: str, timestamp_writes: dict | None = None
) -> None:
    """Every dispatch of a run in ONE compute pass.

    WebGPU orders the dispatches of a pass and makes each one's storage writes visible
    to the next (every dispatch is its own usage scope), so passes need no pass break
    between them; one pass saves the driver's per-pass barrier and bookkeeping, which on
    the H200 cost more than a small decode dispatch itself.
    """
    compute = encoder.begin_compute_pass(label=label, timestamp_writes=timestamp_writes)
    for command in commands:
        command.encode(compute)
    compute.end()


def warm_up(d: Any, commands: list[Command], label: str, runs: int, seconds: float) -> None:
    """At least ``runs`` runs and ``seconds`` of back-to-back GPU work.

    An idle GPU drops its clock (the H200 to 345-900 MHz) and raises it only under load; a
    loop of one short run per submit and wait keeps it mostly idle (a 40 us decode run
    against about 100 us per submit), so runs are batched per submit, the batch doubling
    until one submit holds at least 20 ms of work.
    """
    import time as clock

    started, done, batch = clock.perf_counter(), 0, 1
    while done < runs or clock.perf_counter() - started < seconds:
        encoder = d.create_command_encoder(label=label)
        for _ in range(batch):
            encode_commands(encoder, commands, label)
        submitted = clock.perf_counter()
        d.queue.submit([encoder.finish()])
        d._poll_wait()
        done += batch
        if clock.perf_counter() - submitted < 0.02 and batch < 4096:
            batch *= 2


def timestamp_period_ns(device: Any) -> float:
    """Nanoseconds per timestamp tick (wgpu-py has no wrapper; ask wgpu-native)."""
    try:
        from wgpu.backends.wgpu_native._api import libf

        return float(libf.wgpuQueueGetTimestampPeriod(device.queue._internal))
    except Exception:  # noqa: BLE001 - an older/newer wgpu-native: WebGPU specifies 1 ns
        return 1.0
