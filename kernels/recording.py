"""Recording a planned kernel call: its buffers, pipelines, bind groups and dispatches.

:class:`Recorder` turns a :class:`~onnx_moe_fuse.kernels.planner.Plan` into device work:
it uploads the inputs and allocates outputs and intermediates (:meth:`Recorder.allocate`),
evaluates the chosen variant's constants, renders each pass's template, takes the compute
pipeline from the device's cache (keyed by template and rendered constants, then by the
WGSL itself), packs uniforms and makes one bind group and one :class:`Command` per dispatch,
``repeat`` groups once per index (:meth:`Recorder.record`). Running the commands is
:class:`~onnx_moe_fuse.kernels.kernel.Kernel`'s business.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from onnx_moe_fuse.kernels.commands import ALIGN, CallBuffers, Command, pack_uniform, padded
from onnx_moe_fuse.kernels.device import Device
from onnx_moe_fuse.kernels.expressions import ExpressionError, Record, Scope
from onnx_moe_fuse.kernels.manifest_model import (
    BindingSpec,
    Dispatch,
    KernelManifest,
    Pass,
    RepeatGroup,
)
from onnx_moe_fuse.kernels.planner import MANIFEST_DTYPES, KernelCallError, Plan
from onnx_moe_fuse.kernels.templates import ShaderTemplates


class Recorder:
    """Records the device work of one kernel package's calls (any device, any plan)."""

    def __init__(self, manifest: KernelManifest, templates: ShaderTemplates):
        self.manifest = manifest
        self.templates = templates
        self.name = manifest.qualified_name

    def allocate(
        self, dev: Device, plan: Plan, poison_outputs: bool
    ) -> tuple[CallBuffers, dict[str, int]]:
        """Upload inputs; allocate outputs (NaN-filled when poisoned) and intermediates."""
        import wgpu

        d = dev.device
        variant = plan.variant
        assert variant is not None
        label = f"{self.name}.{variant.id}"
        scope = self.variant_scope(plan)
        usage_io = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST

        tensors: dict[str, Any] = {}
        for key, array in plan.tensors.items():
            if array.nbytes and array.nbytes % ALIGN == 0:
                data = array.reshape(-1).view(np.uint8)  # no copies of gigabyte weights
            else:
                raw = array.tobytes()
                data = raw + bytes(padded(len(raw)) - len(raw))
            tensors[key] = d.create_buffer_with_data(
                label=f"{label}.{key}", data=data, usage=usage_io
            )
        out_sizes: dict[str, int] = {}
        for key, shape in plan.output_shapes.items():
            nbytes = math.prod(shape) * MANIFEST_DTYPES[plan.output_dtypes[key]].itemsize
            out_sizes[key] = nbytes
            if poison_outputs:
                tensors[key] = d.create_buffer_with_data(
                    label=f"{label}.{key}", data=b"\xff" * padded(nbytes), usage=usage_io
                )
            else:
                tensors[key] = d.create_buffer(
                    label=f"{label}.{key}", size=padded(nbytes), usage=usage_io
                )
        intermediates: dict[str, Any] = {}
        for inter in variant.intermediates:
            shape = scope.evaluate(inter.shape, f"shape of intermediate {inter.id}")
            count = math.prod(shape)
            dtype = MANIFEST_DTYPES[inter.dtype]
            nbytes = count * dtype.itemsize
            if nbytes > dev.limits.get("maxBufferSize", nbytes):
                raise KernelCallError(
                    f"{self.name}: intermediate {inter.id} needs {nbytes} bytes, "
                    f"above the device's maxBufferSize"
                )
            if inter.fill is not None:
                data = np.full(count, inter.fill, dtype=dtype).tobytes()
                data += bytes(padded(len(data)) - len(data))
                intermediates[inter.id] = d.create_buffer_with_data(
                    label=f"{label}.{inter.id}", data=data, usage=usage_io
                )
            else:
                intermediates[inter.id] = d.create_buffer(
                    label=f"{label}.{inter.id}", size=padded(nbytes), usage=usage_io
                )
        dummy = d.create_buffer(label=f"{label}.absent", size=ALIGN, usage=usage_io)
        return CallBuffers(tensors, intermediates, dummy), out_sizes

    def variant_scope(self, plan: Plan) -> Scope:
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

    def template_constants(self, scope: Scope, p: Pass) -> dict[str, Any]:
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

    def record(self, dev: Device, plan: Plan, buffers: CallBuffers) -> list[Command]:
        """Every dispatch of the plan's variant, pipelines and bind groups made, in order."""
        variant = plan.variant
        assert variant is not None
        commands: list[Command] = []
        self._record_items(
            dev,
            commands,
            variant.passes,
            self.variant_scope(plan),
            buffers,
            f"{self.name}.{variant.id}",
            {},
        )
        return commands

    def _record_items(
        self,
        dev: Device,
        commands: list[Command],
        items: tuple,
        scope: Scope,
        buffers: CallBuffers,
        label: str,
        repeat: dict[str, int],
    ) -> None:
        for item in items:
            if isinstance(item, RepeatGroup):
                count = scope.evaluate(item.count, f"repeat count of {item.id}")
                for index in range(int(count)):
                    inner = {**repeat, item.index: index}
                    self._record_items(
                        dev,
                        commands,
                        item.passes,
                        scope.child(values={"repeat": Record("repeat", inner)}),
                        buffers,
                        f"{label}.{item.id}[{index}]",
                        inner,
                    )
                continue
            command = self._record_pass(dev, item, scope.child(derived=item.derive), buffers, label)
            if command is not None:
                commands.append(command)

    def _record_pass(
        self, dev: Device, p: Pass, scope: Scope, buffers: CallBuffers, label: str
    ) -> Command | None:
        import wgpu

        d = dev.device
        groups = self.workgroups(p.dispatch, scope, p.id)
        if groups is None:
            return None
        constants = self.template_constants(scope, p)
        bindings = self.resolved_bindings(p, scope)
        pipeline, layout = self.pipeline(dev, p, constants, bindings)
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
        return Command(f"{label}.{p.id}", pipeline, group, groups)

    def workgroups(self, dispatch: Dispatch, scope: Scope, pid: str):
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

    def resolved_bindings(self, p: Pass, scope: Scope) -> list[tuple[BindingSpec, dict]]:
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

    def pipeline(
        self, dev: Device, p: Pass, constants: dict[str, Any], bindings: list
    ) -> tuple[Any, Any]:
        """A pass's compute pipeline and bind group layout, from the device's cache if there."""
        import wgpu

        decls = [facts for _, facts in bindings]
        key = (
            str(self.templates.folder),
            p.shader,
            json.dumps(constants, sort_keys=True, default=str),
            json.dumps(decls, sort_keys=True),
        )
        with dev.lock:
            cached = dev.pipelines.get(key)
        if cached is not None:
            return cached
        code = self.templates.render(p.shader, constants, decls)
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
