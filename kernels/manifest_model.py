"""The model a kernel manifest loads into: :class:`KernelManifest` and its parts.

Plain frozen dataclasses, the same for both manifest dialects (``docs/manifest-schema.md``):
:mod:`.manifest` builds them from a manifest that :mod:`.manifest_schema` has checked, and
the planner and the runtime read them. Expressions are kept as the strings the manifest
holds (parsed once at load time, evaluated per call).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the kernel's interface, keyed by its bind key (``inputT``)."""

    bind_key: str
    semantic: str  # the role / ONNX name; the shapes namespace knows the tensor by both
    io: str  # "input" or "output"
    dtype: str  # a type-constraint variable ("T") or a concrete dtype
    rank: Any = None  # int, expression string, or None
    shape: str | None = None  # outputs: expression giving the shape
    optional: bool = False
    description: str = ""


@dataclass(frozen=True)
class AttributeSpec:
    """An operator attribute: default (absent means none), constraints, description."""

    name: str
    default: Any = None
    has_default: bool = False
    required: bool = False
    values: tuple[Any, ...] | None = None
    description: str = ""


@dataclass(frozen=True)
class UniformField:
    """One field of a uniform struct, filled per dispatch from ``value``."""

    name: str
    type: str
    value: Any


@dataclass(frozen=True)
class BindingSpec:
    """One shader binding: a tensor, an intermediate (scratch) buffer or a uniform struct."""

    var_name: str  # the WGSL variable name
    kind: str  # "tensor", "intermediate" or "uniform"
    ref: str  # bind key, intermediate id, or "" for uniforms
    buffer: str  # "read-only-storage", "storage" or "uniform"
    element_type: str = ""  # WGSL element type or "$derivedName"
    length: Any = None
    struct_name: str = "Params"
    fields: tuple[UniformField, ...] = ()
    optional: bool = False


@dataclass(frozen=True)
class Intermediate:
    """A buffer that lives for one kernel call."""

    id: str
    dtype: str
    shape: str
    fill: int | float | None = None  # initial value of every element; None: uninitialised


@dataclass(frozen=True)
class Dispatch:
    """Either ``threads`` with ``workgroup_size`` (1-D, folded past the limit) or x/y/z."""

    threads: Any = None
    workgroup_size: Any = None
    x: Any = None
    y: Any = 1
    z: Any = 1


@dataclass(frozen=True)
class Pass:
    """One compute dispatch of a template."""

    id: str
    name: str
    shader: str
    shader_inputs: dict[str, Any]
    bindings: tuple[BindingSpec, ...]
    dispatch: Dispatch
    derive: dict[str, Any] = field(default_factory=dict)
    subgroup_width: str | None = None


@dataclass(frozen=True)
class RepeatGroup:
    """Passes run once per index ``0 .. count-1``; the index is ``repeat.<index>``."""

    id: str
    count: Any
    index: str
    passes: tuple[Pass | RepeatGroup, ...]


@dataclass(frozen=True)
class Requirements:
    """Device features and limits a variant needs beyond its ``when`` conditions."""

    features: tuple[str, ...] = ()
    limits: dict[str, int] = field(default_factory=dict)
    subgroup_matrix_configs: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Variant:
    """One implementation strategy, chosen when all its ``when`` conditions hold."""

    id: str
    priority: Any  # an integer, or an expression (a size-dependent preference)
    when: tuple[str, ...]
    constants: dict[str, Any]
    intermediates: tuple[Intermediate, ...]
    passes: tuple[Pass | RepeatGroup, ...]
    requires: Requirements
    description: str = ""


@dataclass(frozen=True)
class ContractCheck:
    """A condition on the call, checked before variant selection, with a message."""

    condition: str
    message: str


@dataclass(frozen=True)
class IndexCheck:
    """An index tensor the kernel validates on the device.

    The kernel writes the smallest flat position of a bad index into ``flag`` (an
    intermediate filled with ``0xFFFFFFFF``); the call then raises ``ValueError``
    naming that position, the value found there and the valid range.
    """

    flag: str
    arg: str
    low: Any
    high: Any


@dataclass(frozen=True)
class KernelManifest:
    """A loaded kernel manifest: the operator contract and its variants."""

    path: Path
    dialect: str  # "binding-sets" or "binding-map"
    domain: str
    name: str
    since_version: int
    version: int
    description: str
    tensors: dict[str, TensorSpec]
    attributes: dict[str, AttributeSpec]
    type_constraints: dict[str, tuple[str, ...]]
    tunables: dict[str, Any]
    derive: dict[str, Any]
    constants: dict[str, Any] | None
    when: tuple[str, ...]
    checks: tuple[ContractCheck, ...]
    index_checks: tuple[IndexCheck, ...]
    variants: tuple[Variant, ...]

    @property
    def qualified_name(self) -> str:
        """``domain.name`` (``GroupedMatMul`` for the default domain)."""
        return f"{self.domain}.{self.name}" if self.domain else self.name

    @property
    def inputs(self) -> list[TensorSpec]:
        """Input tensors in manifest order."""
        return [t for t in self.tensors.values() if t.io == "input"]

    @property
    def outputs(self) -> list[TensorSpec]:
        """Output tensors in manifest order."""
        return [t for t in self.tensors.values() if t.io == "output"]

    def expressions(self) -> list[tuple[str, str]]:
        """Every expression string in the manifest with its key path (for tests and docs)."""
        found: list[tuple[str, str]] = []

        def add(where: str, value: Any) -> None:
            if isinstance(value, str):
                found.append((where, value))

        for name, expr in self.derive.items():
            add(f"derive.{name}", expr)
        for name, expr in (self.constants or {}).items():
            add(f"constants.{name}", expr)
        for i, expr in enumerate(self.when):
            add(f"when[{i}]", expr)
        for variant in self.variants:
            for i, expr in enumerate(variant.when):
                add(f"variants.{variant.id}.when[{i}]", expr)
            for name, expr in variant.constants.items():
                add(f"variants.{variant.id}.constants.{name}", expr)
            for inter in variant.intermediates:
                add(f"variants.{variant.id}.intermediates.{inter.id}.shape", inter.shape)
            for p in iter_passes(variant.passes):
                base = f"variants.{variant.id}.passes.{p.id}"
                for name, expr in p.derive.items():
                    add(f"{base}.derive.{name}", expr)
                for name, expr in p.shader_inputs.items():
                    add(f"{base}.source.inputs.{name}", expr)
                d = p.dispatch
                for key in ("threads", "workgroup_size", "x", "y", "z"):
                    add(f"{base}.dispatch.{key}", getattr(d, key))
                for b in p.bindings:
                    for f in b.fields:
                        add(f"{base}.bindings.{b.var_name}.{f.name}", f.value)
                    add(f"{base}.bindings.{b.var_name}.length", b.length)
        for t in self.tensors.values():
            add(f"tensors.{t.bind_key}.shape", t.shape)
            add(f"tensors.{t.bind_key}.rank", t.rank)
        return found


def iter_passes(items: tuple[Pass | RepeatGroup, ...]) -> list[Pass]:
    """All passes of a pass list, repeat groups flattened (each pass once)."""
    out: list[Pass] = []
    for item in items:
        if isinstance(item, RepeatGroup):
            out.extend(iter_passes(item.passes))
        else:
            out.append(item)
    return out
