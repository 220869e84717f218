"""The kernel objects users call: check a call, choose a variant, run it, time it.

A :class:`Kernel` wraps one package (its manifest and folder). Calling it with the
manifest's bind keys as numpy arrays plans the call (:mod:`.planner`), has the
:class:`~onnx_moe_fuse.kernels.recording.Recorder` allocate the call's buffers and record
one command per dispatch, runs every dispatch in one compute pass of one command encoder and
one submit, and reads every output (and every index-check flag) back through one staging
buffer. :meth:`Kernel.time` and :meth:`Kernel.stage_times` time a plan on the GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from onnx_moe_fuse.kernels.commands import encode_commands, padded, timestamp_period_ns, warm_up
from onnx_moe_fuse.kernels.device import Device, default_device
from onnx_moe_fuse.kernels.manifest_model import KernelManifest
from onnx_moe_fuse.kernels.planner import (
    MANIFEST_DTYPES,
    DeviceFacts,
    KernelCallError,
    Plan,
    make_plan,
)
from onnx_moe_fuse.kernels.recording import Recorder
from onnx_moe_fuse.kernels.templates import ShaderTemplates

#: What an index-check flag holds when no index was out of range (its fill value).
NO_INDEX_ERROR = 0xFFFFFFFF


class Kernel:
    """A kernel package: call it with numpy arrays keyed by the manifest's bind keys."""

    def __init__(self, manifest: KernelManifest, folder: Path, device: Device | None = None):
        self.manifest = manifest
        self.folder = folder
        self._device = device
        self.templates = ShaderTemplates(manifest, folder)
        self.recorder = Recorder(manifest, self.templates)

    @property
    def name(self) -> str:
        """The operator's qualified name."""
        return self.manifest.qualified_name

    @property
    def variants(self) -> list[str]:
        """Variant ids in manifest order."""
        return [v.id for v in self.manifest.variants]

    @property
    def device(self) -> Device:
        """The device this kernel runs on (the shared default unless one was given)."""
        if self._device is None:
            self._device = default_device()
        return self._device

    def device_facts(self, device_limits: Mapping[str, int] | None = None) -> DeviceFacts:
        """The device's limits (optionally lowered for this call), features and adapter info."""
        limits = dict(self.device.limits)
        for name, value in (device_limits or {}).items():
            if name not in limits:
                raise KernelCallError(f"{self.name}: unknown device limit {name!r}")
            if value > limits[name]:
                raise KernelCallError(
                    f"{self.name}: device limit {name}={value} is above the "
                    f"device's {limits[name]}; limits can only be lowered"
                )
            limits[name] = value
        return DeviceFacts(limits, self.device.features, dict(self.device.adapter_info))

    def plan(
        self,
        attrs: Mapping[str, Any] | None = None,
        tunables: Mapping[str, Any] | None = None,
        device_limits: Mapping[str, int] | None = None,
        variant: str | None = None,
        optional_outputs: Iterable[str] = (),
        **tensors: Any,
    ) -> Plan:
        """Check a call and choose its variant without running it.

        ``optional_outputs`` names the optional outputs (bind keys) to produce.
        """
        return make_plan(
            self.manifest,
            self.device_facts(device_limits),
            tensors,
            attrs,
            tunables,
            variant,
            optional_outputs,
        )

    def __call__(
        self,
        attrs: Mapping[str, Any] | None = None,
        variant: str | None = None,
        tunables: Mapping[str, Any] | None = None,
        device_limits: Mapping[str, int] | None = None,
        poison_outputs: bool = False,
        optional_outputs: Iterable[str] = (),
        **tensors: Any,
    ) -> dict[str, np.ndarray]:
        """Run the kernel; return its outputs keyed by bind key.

        ``poison_outputs`` fills the output buffers with NaN bits before the run, so an
        element the kernel never writes shows up. ``optional_outputs`` names the optional
        outputs (bind keys) to produce; the others are not computed.
        """
        plan = self.plan(
            attrs=attrs,
            tunables=tunables,
            device_limits=device_limits,
            variant=variant,
            optional_outputs=optional_outputs,
            **tensors,
        )
        return self.run(plan, poison_outputs=poison_outputs)

    # -- execution -----------------------------------------------------------------------

    def run(self, plan: Plan, poison_outputs: bool = False) -> dict[str, np.ndarray]:
        """Execute a plan made by :meth:`plan`; return the outputs keyed by bind key."""
        import wgpu

        buffers, out_sizes = self.recorder.allocate(self.device, plan, poison_outputs)
        try:
            commands = self.recorder.record(self.device, plan, buffers)
            d = self.device.device
            label = f"{self.name}.{plan.variant.id}"
            encoder = d.create_command_encoder(label=label)
            if commands:
                encode_commands(encoder, commands, label)
            tensors, intermediates = buffers.tensors, buffers.intermediates

            # One staging buffer and one map for every output and every index-check flag.
            reads = [(key, tensors[key], n) for key, n in out_sizes.items() if n > 0]
            reads += [
                (f"flag:{c.flag}", intermediates[c.flag], 4) for c in self.manifest.index_checks
            ]
            offsets, total = {}, 0
            for key, _, n in reads:
                offsets[key] = total
                total += padded(n)
            results: dict[str, np.ndarray] = {}
            if total:
                staging = d.create_buffer(
                    label=f"{label}.readback",
                    size=total,
                    usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
                )
                for key, buf, n in reads:
                    encoder.copy_buffer_to_buffer(buf, 0, staging, offsets[key], padded(n))
                d.queue.submit([encoder.finish()])
                staging.map_sync(wgpu.MapMode.READ)
                try:
                    raw = bytes(staging.read_mapped())
                finally:
                    staging.unmap()
                staging.destroy()
            else:
                d.queue.submit([encoder.finish()])
                raw = b""
            for check in self.manifest.index_checks:
                at = offsets[f"flag:{check.flag}"]
                flag = int(np.frombuffer(raw[at : at + 4], dtype=np.uint32)[0])
                if flag != NO_INDEX_ERROR:
                    self._raise_index_error(plan, check, flag)
            for key, shape in plan.output_shapes.items():
                dtype = MANIFEST_DTYPES[plan.output_dtypes[key]]
                n = out_sizes[key]
                if n == 0:
                    results[key] = np.zeros(shape, dtype=dtype)
                else:
                    at = offsets[key]
                    results[key] = (
                        np.frombuffer(raw[at : at + n], dtype=dtype).reshape(shape).copy()
                    )
            return results
        finally:
            buffers.destroy()

    def time(
        self, plan: Plan, runs: int = 10, warmup: int = 2, warmup_seconds: float = 0.5
    ) -> tuple[list[float], str]:
        """Seconds per run of the plan's passes, inputs uploaded once.

        With the adapter's ``timestamp-query`` feature each run is timed on the GPU, from
        the start of its first pass to the end of its last; otherwise by wall clock around
        a submit and a wait. Returns the times and the method ("gpu-timestamps"/"wall").
        Warm-up runs go on for ``warmup_seconds`` at least, batched so that the GPU stays
        busy (:func:`.commands.warm_up`): an idle GPU drops its clock and needs a few
        hundred milliseconds of load to raise it again.
        """
        import time as clock

        d = self.device.device
        buffers, _ = self.recorder.allocate(self.device, plan, poison_outputs=False)
        try:
            commands = self.recorder.record(self.device, plan, buffers)
            if not commands:
                return [0.0] * runs, "empty"
            warm_up(d, commands, f"{self.name}.warmup", warmup, warmup_seconds)
            if "timestamp-query" not in self.device.features:
                times = []
                for _ in range(runs):
                    encoder = d.create_command_encoder(label=f"{self.name}.timed")
                    encode_commands(encoder, commands, f"{self.name}.timed")
                    start = clock.perf_counter()
                    d.queue.submit([encoder.finish()])
                    d._poll_wait()
                    times.append(clock.perf_counter() - start)
                return times, "wall"
            queries, resolved = _timestamp_queries(d, f"{self.name}.timestamps", 2 * runs)
            encoder = d.create_command_encoder(label=f"{self.name}.timed")
            for run in range(runs):
                writes = {
                    "query_set": queries,
                    "beginning_of_pass_write_index": 2 * run,
                    "end_of_pass_write_index": 2 * run + 1,
                }
                encode_commands(encoder, commands, f"{self.name}.timed", writes)
            encoder.resolve_query_set(queries, 0, 2 * runs, resolved, 0)
            d.queue.submit([encoder.finish()])
            ticks = np.frombuffer(d.queue.read_buffer(resolved), dtype=np.uint64).astype(np.float64)
            period_ns = timestamp_period_ns(d)
            seconds = (ticks[1::2] - ticks[0::2]) * period_ns * 1e-9
            return [float(t) for t in seconds], "gpu-timestamps"
        finally:
            buffers.destroy()

    def stage_times(
        self, plan: Plan, runs: int = 10, warmup_seconds: float = 0.5
    ) -> list[tuple[str, float]] | None:
        """Median GPU seconds of each dispatch of the plan, labelled by pass id.

        Timestamps are written inside the one compute pass, before every dispatch and
        after the last, so a dispatch's time includes the wait for its predecessor (the
        barrier between them). None without the adapter's
        ``timestamp-query-inside-passes`` feature.
        """
        from wgpu.backends.wgpu_native.extras import write_timestamp

        if "timestamp-query-inside-passes" not in self.device.features:
            return None
        d = self.device.device
        buffers, _ = self.recorder.allocate(self.device, plan, poison_outputs=False)
        try:
            commands = self.recorder.record(self.device, plan, buffers)
            if not commands:
                return []
            warm_up(d, commands, f"{self.name}.warmup", 1, warmup_seconds)
            marks = len(commands) + 1
            queries, resolved = _timestamp_queries(d, f"{self.name}.stages", marks * runs)
            encoder = d.create_command_encoder(label=f"{self.name}.stages")
            for run in range(runs):
                compute = encoder.begin_compute_pass(label=f"{self.name}.stages")
                for i, command in enumerate(commands):
                    write_timestamp(compute, queries, run * marks + i)
                    command.encode(compute)
                write_timestamp(compute, queries, run * marks + marks - 1)
                compute.end()
            encoder.resolve_query_set(queries, 0, marks * runs, resolved, 0)
            d.queue.submit([encoder.finish()])
            ticks = np.frombuffer(d.queue.read_buffer(resolved), dtype=np.uint64)
            seconds = np.diff(ticks.astype(np.float64).reshape(runs, marks), axis=1)
            seconds *= timestamp_period_ns(d) * 1e-9
            resolved.destroy()
            labels = [c.label.rsplit(".", 1)[-1] for c in commands]
            return [(lab, float(np.median(seconds[:, i]))) for i, lab in enumerate(labels)]
        finally:
            buffers.destroy()

    def prefix_times(
        self, plan: Plan, runs: int = 10, warmup_seconds: float = 0.5
    ) -> list[tuple[str, float]] | None:
        """Median GPU seconds of the plan's first n dispatches, for n = 1 .. all, labelled.

        Each prefix runs alone in its own compute pass, timed from the start of the pass to
        its end, so the difference between consecutive prefixes is what adding that
        dispatch costs, barrier and launch included. On the H200 the timestamps written
        *inside* one pass (:meth:`stage_times`) overlap and add up to more than the run;
        these do not. Later dispatches read what earlier ones wrote, so every prefix is a
        valid run. None without the adapter's ``timestamp-query`` feature.
        """
        if "timestamp-query" not in self.device.features:
            return None
        d = self.device.device
        buffers, _ = self.recorder.allocate(self.device, plan, poison_outputs=False)
        try:
            commands = self.recorder.record(self.device, plan, buffers)
            if not commands:
                return []
            warm_up(d, commands, f"{self.name}.warmup", 1, warmup_seconds)
            count = len(commands) * runs
            queries, resolved = _timestamp_queries(d, f"{self.name}.prefixes", 2 * count)
            encoder = d.create_command_encoder(label=f"{self.name}.prefixes")
            # Interleaved (run-major), so that the clock drifts alike for every prefix.
            for run in range(runs):
                for n in range(1, len(commands) + 1):
                    at = 2 * (run * len(commands) + n - 1)
                    writes = {
                        "query_set": queries,
                        "beginning_of_pass_write_index": at,
                        "end_of_pass_write_index": at + 1,
                    }
                    encode_commands(encoder, commands[:n], f"{self.name}.prefix", writes)
            encoder.resolve_query_set(queries, 0, 2 * count, resolved, 0)
            d.queue.submit([encoder.finish()])
            ticks = np.frombuffer(d.queue.read_buffer(resolved), dtype=np.uint64).astype(np.float64)
            seconds = (ticks[1::2] - ticks[0::2]) * timestamp_period_ns(d) * 1e-9
            seconds = seconds.reshape(runs, len(commands))
            resolved.destroy()
            labels = [c.label.rsplit(".", 1)[-1] for c in commands]
            return [(lab, float(np.median(seconds[:, i]))) for i, lab in enumerate(labels)]
        finally:
            buffers.destroy()

    def _raise_index_error(self, plan: Plan, check: Any, flag: int) -> None:
        array = plan.tensors[check.arg]
        low = plan.scope.evaluate(check.low, "index range")
        high = plan.scope.evaluate(check.high, "index range")
        if flag >= array.size:
            raise ValueError(
                f"{self.name}: {check.arg} holds an index outside [{low}, {high}) "
                f"(the kernel flagged position {flag})"
            )
        position = np.unravel_index(flag, array.shape)
        where = ", ".join(str(int(i)) for i in position)
        raise ValueError(
            f"{self.name}: {check.arg}[{where}] = {int(array[position])} is outside [{low}, {high})"
        )

    def render(self, shader: str, constants: dict[str, Any], decls: list[dict]) -> str:
        """Render a pass template: constants plus the generated binding declarations."""
        return self.templates.render(shader, constants, decls)


def _timestamp_queries(d: Any, label: str, count: int) -> tuple[Any, Any]:
    """A timestamp query set of ``count`` marks and the buffer it resolves into (8 bytes each)."""
    import wgpu  # lazily, as the device: the manifests and plans need no adapter

    queries = d.create_query_set(label=label, type="timestamp", count=count)
    resolved = d.create_buffer(
        label=label,
        size=8 * count,
        usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC,
    )
    return queries, resolved
