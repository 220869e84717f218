"""Running a planned kernel call on the device, and the kernel objects users call.

``get_kernel("GroupedMatMul", version=1)`` finds the package folder whose manifest has
that name and version and returns a :class:`Kernel`. Calling it with the manifest's
bind keys as numpy arrays plans the call (see :mod:`.planner`), renders each pass's
Jinja2 template with the pass's constants, takes the compute pipeline from a cache
keyed by (template, rendered constants), packs uniforms by WGSL layout rules,
allocates intermediates, runs every pass (``repeat`` groups once per index) as one
dispatch each, all in one compute pass of one command encoder and one submit, and reads
every output back through one staging buffer.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from onnx_moe_fuse.kernels.device import Device, default_device
from onnx_moe_fuse.kernels.expressions import ExpressionError, Record, Scope
from onnx_moe_fuse.kernels.manifest import (
    BindingSpec,
    Dispatch,
    KernelManifest,
    Pass,
    RepeatGroup,
    load_manifest,
)
from onnx_moe_fuse.kernels.planner import (
    MANIFEST_DTYPES,
    DeviceFacts,
    KernelCallError,
    Plan,
    make_plan,
)

PACKAGE_ROOT = Path(__file__).resolve().parent
COMMON_TEMPLATES = PACKAGE_ROOT / "common"
_NO_INDEX_ERROR = 0xFFFFFFFF
_ALIGN = 16  # buffer sizes are padded to this many bytes (vec4 loads, copy rules)

_WGSL_SIZES = {
    "f32": 4,
    "u32": 4,
    "i32": 4,
    "f16": 2,
    "atomic<u32>": 4,
    "atomic<i32>": 4,
    "vec2<f32>": 8,
    "vec2<u32>": 8,
    "vec2<i32>": 8,
    "vec4<f32>": 16,
    "vec4<u32>": 16,
    "vec4<i32>": 16,
    "vec2<f16>": 4,
    "vec4<f16>": 8,
}


def _padded(nbytes: int) -> int:
    return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)


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
class _Buffers:
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
class _Command:
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
    encoder: Any, commands: list[_Command], label: str, timestamp_writes: dict | None = None
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


def _warm_up(d: Any, commands: list[_Command], label: str, runs: int, seconds: float) -> None:
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


class Kernel:
    """A kernel package: call it with numpy arrays keyed by the manifest's bind keys."""

    def __init__(self, manifest: KernelManifest, folder: Path, device: Device | None = None):
        self.manifest = manifest
        self.folder = folder
        self._device = device
        loader = jinja2.ChoiceLoader(
            [jinja2.FileSystemLoader(str(folder)), jinja2.FileSystemLoader(str(COMMON_TEMPLATES))]
        )
        self._env = jinja2.Environment(
            loader=loader,
            undefined=jinja2.StrictUndefined,
            autoescape=False,
            keep_trailing_newline=True,
        )
        for p in self._all_passes():
            if not (folder / p.shader).is_file() and not (COMMON_TEMPLATES / p.shader).is_file():
                raise KernelCallError(
                    f"{manifest.path}: pass {p.id} names a missing shader {p.shader!r}"
                )

    def _all_passes(self) -> list[Pass]:
        from onnx_moe_fuse.kernels.manifest import iter_passes

        return [p for v in self.manifest.variants for p in iter_passes(v.passes)]

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

        buffers, out_sizes = self._allocate(plan, poison_outputs)
        try:
            commands = self._record(plan, buffers)
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
                total += _padded(n)
            results: dict[str, np.ndarray] = {}
            if total:
                staging = d.create_buffer(
                    label=f"{label}.readback",
                    size=total,
                    usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
                )
                for key, buf, n in reads:
                    encoder.copy_buffer_to_buffer(buf, 0, staging, offsets[key], _padded(n))
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
                if flag != _NO_INDEX_ERROR:
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

    def _allocate(self, plan: Plan, poison_outputs: bool) -> tuple[_Buffers, dict[str, int]]:
        """Upload inputs; allocate outputs (NaN-filled when poisoned) and intermediates."""
        import wgpu

        dev = self.device
        d = dev.device
        variant = plan.variant
        assert variant is not None
        label = f"{self.name}.{variant.id}"
        scope = self._variant_scope(plan)
        usage_io = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST

        tensors: dict[str, Any] = {}
        for key, array in plan.tensors.items():
            raw = array.tobytes()
            data = raw + bytes(_padded(len(raw)) - len(raw))
            tensors[key] = d.create_buffer_with_data(
                label=f"{label}.{key}", data=data, usage=usage_io
            )
        out_sizes: dict[str, int] = {}
        for key, shape in plan.output_shapes.items():
            nbytes = math.prod(shape) * MANIFEST_DTYPES[plan.output_dtypes[key]].itemsize
            out_sizes[key] = nbytes
            if poison_outputs:
                tensors[key] = d.create_buffer_with_data(
                    label=f"{label}.{key}", data=b"\xff" * _padded(nbytes), usage=usage_io
                )
            else:
                tensors[key] = d.create_buffer(
                    label=f"{label}.{key}", size=_padded(nbytes), usage=usage_io
                )
        intermediates: dict[str, Any] = {}
        inter_sizes: dict[str, int] = {}
        for inter in variant.intermediates:
            shape = scope.evaluate(inter.shape, f"shape of intermediate {inter.id}")
            count = math.prod(shape)
            dtype = MANIFEST_DTYPES[inter.dtype]
            nbytes = count * dtype.itemsize
            inter_sizes[inter.id] = nbytes
            if nbytes > dev.limits.get("maxBufferSize", nbytes):
                raise KernelCallError(
                    f"{self.name}: intermediate {inter.id} needs {nbytes} bytes, "
                    f"above the device's maxBufferSize"
                )
            if inter.fill is not None:
                data = np.full(count, inter.fill, dtype=dtype).tobytes()
                data += bytes(_padded(len(data)) - len(data))
                intermediates[inter.id] = d.create_buffer_with_data(
                    label=f"{label}.{inter.id}", data=data, usage=usage_io
                )
            else:
                intermediates[inter.id] = d.create_buffer(
                    label=f"{label}.{inter.id}", size=_padded(nbytes), usage=usage_io
                )
        dummy = d.create_buffer(label=f"{label}.absent", size=_ALIGN, usage=usage_io)
        return _Buffers(tensors, intermediates, dummy), out_sizes

    def time(
        self, plan: Plan, runs: int = 10, warmup: int = 2, warmup_seconds: float = 0.5
    ) -> tuple[list[float], str]:
        """Seconds per run of the plan's passes, inputs uploaded once.

        With the adapter's ``timestamp-query`` feature each run is timed on the GPU, from
        the start of its first pass to the end of its last; otherwise by wall clock around
        a submit and a wait. Returns the times and the method ("gpu-timestamps"/"wall").
        Warm-up runs go on for ``warmup_seconds`` at least, batched so that the GPU stays
        busy (:func:`_warm_up`): an idle GPU drops its clock and needs a few hundred
        milliseconds of load to raise it again.
        """
        import time as clock

        import wgpu

        d = self.device.device
        buffers, _ = self._allocate(plan, poison_outputs=False)
        try:
            commands = self._record(plan, buffers)
            if not commands:
                return [0.0] * runs, "empty"
            _warm_up(d, commands, f"{self.name}.warmup", warmup, warmup_seconds)
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
            queries = d.create_query_set(
                label=f"{self.name}.timestamps", type="timestamp", count=2 * runs
            )
            resolved = d.create_buffer(
                label=f"{self.name}.timestamps",
                size=16 * runs,
                usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC,
            )
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
        import wgpu
        from wgpu.backends.wgpu_native.extras import write_timestamp

        if "timestamp-query-inside-passes" not in self.device.features:
            return None
        d = self.device.device
        buffers, _ = self._allocate(plan, poison_outputs=False)
        try:
            commands = self._record(plan, buffers)
            if not commands:
                return []
            _warm_up(d, commands, f"{self.name}.warmup", 1, warmup_seconds)
            marks = len(commands) + 1
            queries = d.create_query_set(
                label=f"{self.name}.stages", type="timestamp", count=marks * runs
            )
            resolved = d.create_buffer(
                label=f"{self.name}.stages",
                size=8 * marks * runs,
                usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC,
            )
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

    def _variant_scope(self, plan: Plan) -> Scope:
        """The plan's scope plus the ``constants`` namespace of the chosen variant."""
        variant = plan.variant
        assert variant is not None
        exprs = dict(self.manifest.constants or {})
        exprs.update(variant.constants)
        base = plan.scope
        values = {}
        for name, expr in exprs.items():
            values[name] = base.evaluate(expr, f"constant '{name}'")
        return base.child(values={"constants": Record("constants", values)})

    def _template_constants(self, scope: Scope, p: Pass) -> dict[str, Any]:
        """What a pass's template sees: constants (or, lacking any, every derive value)."""
        pass_scope = scope
        if self.manifest.constants is None:
            values = {}
            for name in self.manifest.derive:
                try:
                    values[name] = pass_scope.lookup(name)
                except ExpressionError:
                    continue  # e.g. a derive about an absent optional tensor
        else:
            values = scope.lookup("constants").to_dict()
        for name, expr in p.shader_inputs.items():
            values[name] = pass_scope.evaluate(expr, f"{p.id}.source.inputs.{name}")
        for name in p.derive:
            values[name] = pass_scope.lookup(name)
        return values

    def _record(self, plan: Plan, buffers: _Buffers) -> list[_Command]:
        """Every dispatch of the plan's variant, pipelines and bind groups made, in order."""
        variant = plan.variant
        assert variant is not None
        commands: list[_Command] = []
        self._record_items(
            commands,
            variant.passes,
            self._variant_scope(plan),
            buffers,
            f"{self.name}.{variant.id}",
            {},
        )
        return commands

    def _record_items(
        self,
        commands: list[_Command],
        items: tuple,
        scope: Scope,
        buffers: _Buffers,
        label: str,
        repeat: dict[str, int],
    ) -> None:
        for item in items:
            if isinstance(item, RepeatGroup):
                count = scope.evaluate(item.count, f"repeat count of {item.id}")
                for index in range(int(count)):
                    inner = {**repeat, item.index: index}
                    self._record_items(
                        commands,
                        item.passes,
                        scope.child(values={"repeat": Record("repeat", inner)}),
                        buffers,
                        f"{label}.{item.id}[{index}]",
                        inner,
                    )
                continue
            command = self._record_pass(item, scope.child(derived=item.derive), buffers, label)
            if command is not None:
                commands.append(command)

    def _record_pass(self, p: Pass, scope: Scope, buffers: _Buffers, label: str) -> _Command | None:
        import wgpu

        dev = self.device
        d = dev.device
        groups = self._workgroups(p.dispatch, scope, p.id)
        if groups is None:
            return None
        constants = self._template_constants(scope, p)
        bindings = self._resolved_bindings(p, scope)
        pipeline, layout = self._pipeline(p, constants, bindings)
        entries = []
        for index, (spec, _) in enumerate(bindings):
            if spec.kind == "uniform":
                fields = [
                    (f.name, f.type, scope.evaluate(f.value, f"{p.id}.{spec.var_name}.{f.name}"))
                    for f in spec.fields
                ]
                buf = d.create_buffer_with_data(
                    label=f"{label}.{p.id}.{spec.var_name}",
                    data=pack_uniform(fields),
                    usage=wgpu.BufferUsage.UNIFORM,
                )
            elif spec.kind == "tensor":
                buf = buffers.tensors.get(spec.ref, buffers.dummy)
            else:
                buf = buffers.intermediates[spec.ref]
            entries.append(
                {"binding": index, "resource": {"buffer": buf, "offset": 0, "size": buf.size}}
            )
            if spec.kind == "uniform":
                buffers.uniforms.append(buf)
        group = d.create_bind_group(label=f"{label}.{p.id}", layout=layout, entries=entries)
        return _Command(f"{label}.{p.id}", pipeline, group, groups)

    def _workgroups(self, dispatch: Dispatch, scope: Scope, pid: str):
        """The grid for a pass, or None when there is nothing to do."""
        # The plan's limits, which a call may have lowered (tests use that to fold grids).
        max_dim = int(scope.evaluate("device.limits.maxComputeWorkgroupsPerDimension"))
        if dispatch.threads is not None:
            threads = int(scope.evaluate(dispatch.threads, f"{pid}.dispatch.threads"))
            size = int(scope.evaluate(dispatch.workgroup_size, f"{pid}.dispatch.workgroupSize"))
            count = -(-threads // size) if threads > 0 else 0
            if count == 0:
                return None
            # Fold a long 1-D grid into 2-D; shaders linearise with num_workgroups.x.
            rows = -(-count // max_dim)
            if rows > max_dim:
                raise KernelCallError(
                    f"{self.name}: pass {pid} needs {count} workgroups, more workgroups than "
                    f"a {max_dim} x {max_dim} grid holds"
                )
            return (-(-count // rows), rows, 1)
        dims = tuple(
            int(scope.evaluate(v, f"{pid}.dispatch.{k}"))
            for k, v in (("x", dispatch.x), ("y", dispatch.y), ("z", dispatch.z))
        )
        if any(n <= 0 for n in dims):
            return None
        for axis, n in zip("xyz", dims, strict=True):
            if n > max_dim:
                raise KernelCallError(
                    f"{self.name}: pass {pid} needs {n} workgroups along "
                    f"{axis}, above the device's {max_dim}"
                )
        return dims

    def _resolved_bindings(self, p: Pass, scope: Scope) -> list[tuple[BindingSpec, dict]]:
        """Each binding with its WGSL declaration facts (element type, length, access)."""
        out = []
        for spec in p.bindings:
            element = spec.element_type
            if element.startswith("$"):  # a derived name, e.g. "$aScalar"
                element = scope.evaluate(element[1:], f"{p.id}.{spec.var_name}.elementType")
            length = None
            if spec.length is not None:
                length = int(scope.evaluate(spec.length, f"{p.id}.{spec.var_name}.length"))
            out.append(
                (
                    spec,
                    {
                        "var": spec.var_name,
                        "kind": spec.kind,
                        "buffer": spec.buffer,
                        "element": element,
                        "length": length,
                        "struct_name": spec.struct_name,
                        "fields": [{"name": f.name, "type": f.type} for f in spec.fields],
                    },
                )
            )
        return out

    def _pipeline(self, p: Pass, constants: dict[str, Any], bindings: list) -> tuple[Any, Any]:
        import wgpu

        dev = self.device
        decls = [facts for _, facts in bindings]
        key = (
            str(self.folder),
            p.shader,
            json.dumps(constants, sort_keys=True, default=str),
            json.dumps(decls, sort_keys=True),
        )
        with dev.lock:
            cached = dev.pipelines.get(key)
        if cached is not None:
            return cached
        code = self.render(p.shader, constants, decls)
        # Second level, keyed by the WGSL itself: passes whose templates ignore most
        # constants (routing, grouping, mixing) share one pipeline across shapes and
        # variants. The code holds the binding declarations, so it fixes the layout too.
        code_key = ("wgsl", code)
        with dev.lock:
            cached = dev.pipelines.get(code_key)
            if cached is not None:
                dev.pipelines[key] = cached
        if cached is not None:
            return cached
        d = dev.device
        label = p.name
        module = d.create_shader_module(label=label, code=code)
        buffer_types = {
            "uniform": wgpu.BufferBindingType.uniform,
            "storage": wgpu.BufferBindingType.storage,
            "read-only-storage": wgpu.BufferBindingType.read_only_storage,
        }
        layout = d.create_bind_group_layout(
            label=label,
            entries=[
                {
                    "binding": i,
                    "visibility": wgpu.ShaderStage.COMPUTE,
                    "buffer": {"type": buffer_types[facts["buffer"]]},
                }
                for i, facts in enumerate(decls)
            ],
        )
        pipeline = d.create_compute_pipeline(
            label=label,
            layout=d.create_pipeline_layout(label=label, bind_group_layouts=[layout]),
            compute={"module": module, "entry_point": "main"},
        )
        with dev.lock:
            dev.pipelines[key] = dev.pipelines[code_key] = (pipeline, layout)
        return pipeline, layout

    def render(self, shader: str, constants: dict[str, Any], decls: list[dict]) -> str:
        """Render a pass template: constants plus the generated binding declarations."""
        declarations = self._env.get_template("bindings.wgsl.jinja").render(
            bindings=[{**facts, "index": i} for i, facts in enumerate(decls)],
            enable_f16=any("f16" in (facts["element"] or "") for facts in decls),
        )
        try:
            return self._env.get_template(shader).render(**constants, bindings=declarations)
        except jinja2.UndefinedError as exc:
            raise KernelCallError(f"{self.folder / shader}: {exc.message}") from None


def package_folders() -> list[Path]:
    """Every kernel package folder shipped with the project."""
    return sorted(p.parent for p in PACKAGE_ROOT.glob("*/manifest.json"))


@cache
def _catalogue() -> dict[tuple[str, int], Path]:
    found: dict[tuple[str, int], Path] = {}
    for folder in package_folders():
        m = load_manifest(folder / "manifest.json")
        for name in {m.name, m.qualified_name}:
            found[(name, m.version)] = folder
    return found


_kernels: dict[tuple[str, int], Kernel] = {}


def get_kernel(name: str, version: int = 1, device: Device | None = None) -> Kernel:
    """The kernel package for operator ``name`` (``GroupedMatMul``, ``com.microsoft.QMoE``)."""
    folder = _catalogue().get((name, version))
    if folder is None:
        known = sorted({f"{n} v{v}" for n, v in _catalogue()})
        raise KeyError(f"no kernel package {name!r} version {version} (have: {', '.join(known)})")
    if device is not None:
        return Kernel(load_manifest(folder / "manifest.json"), folder, device)
    key = (name, version)
    if key not in _kernels:
        _kernels[key] = Kernel(load_manifest(folder / "manifest.json"), folder)
    return _kernels[key]
