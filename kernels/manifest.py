"""Kernel manifests: a strict loader for both manifest dialects and the model it builds.

Two dialects exist (see ``docs/manifest-schema.md``):

* the *binding-set* dialect (the QMoE seed, and every package of this project):
  ``inputs``/``outputs`` as lists keyed by ``role``, ``args`` mapping bind keys to
  semantics, ``bindingSets`` of bindings, ``constants``, per-variant ``constants``,
  passes naming a binding set, ``repeat`` groups, ``source`` shaders;
* the *binding-map* dialect (the MatMulNBitsQkv seed): ``inputs``/``outputs`` as maps
  keyed by bind key, a top-level ``when``, one ``bindings`` map whose entries passes
  list by name, ``scratch`` buffers, ``struct`` field lists, ``length``, ``$name``
  references and per-pass ``derive``.

Both load into one :class:`KernelManifest`. Every key is checked against the schema:
an unknown key is a :class:`ManifestError` naming the file and the key path, and every
expression is parsed at load time so that a malformed one is reported there too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnx_moe_fuse.kernels.expressions import ExpressionError, parse


class ManifestError(ValueError):
    """A manifest does not follow the schema; the message names the file and key path."""


#: Element dtypes a manifest may name for tensors and intermediates.
DTYPES = ("float32", "float16", "float64", "bfloat16", "int32", "int64", "uint32", "uint8", "int8")
BUFFER_TYPES = ("read-only-storage", "storage", "uniform")
UNIFORM_FIELD_TYPES = (
    "f32",
    "u32",
    "i32",
    "vec2<f32>",
    "vec2<u32>",
    "vec2<i32>",
    "vec4<f32>",
    "vec4<u32>",
    "vec4<i32>",
)


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


class _Reader:
    """Checks a JSON object against the schema and reports errors with file and key path."""

    def __init__(self, path: Path):
        self.path = path

    def error(self, where: str, message: str) -> ManifestError:
        return ManifestError(f"{self.path}: {where}: {message}")

    def obj(self, value: Any, where: str, allowed: set[str], required: set[str] = frozenset()):
        if not isinstance(value, dict):
            raise self.error(where, f"expected an object, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                raise self.error(f"{where}.{key}" if where else key, "unknown key")
        for key in required:
            if key not in value:
                raise self.error(where or "(top level)", f"missing required key '{key}'")
        return value

    def typed(self, value: Any, where: str, kinds: tuple[type, ...], what: str) -> Any:
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.error(where, f"expected {what}, got {value!r}")
        return value

    def string(self, value: Any, where: str) -> str:
        return self.typed(value, where, (str,), "a string")

    def expr(self, value: Any, where: str, allow_literals: bool = True) -> Any:
        """An expression: a string parsed now, or (where allowed) a number / bool / list."""
        if isinstance(value, str):
            if value.startswith("$") and value[1:].isidentifier():
                value = value[1:]  # binding-map dialect: "$name" refers to a derived value
            try:
                parse(value)
            except ExpressionError as exc:
                raise self.error(where, f"{value!r}: {exc}") from None
            return value
        if allow_literals and isinstance(value, (int, float, bool)):
            return value
        if allow_literals and isinstance(value, list):
            return [self.expr(v, f"{where}[{i}]") for i, v in enumerate(value)]
        raise self.error(where, f"expected an expression, got {value!r}")

    def expr_map(self, value: Any, where: str) -> dict[str, Any]:
        self.typed(value, where, (dict,), "an object")
        return {k: self.expr(v, f"{where}.{k}") for k, v in value.items()}

    def expr_list(self, value: Any, where: str) -> tuple[str, ...]:
        self.typed(value, where, (list,), "a list")
        return tuple(
            self.expr(v, f"{where}[{i}]", allow_literals=False) for i, v in enumerate(value)
        )


_TOP_KEYS = {
    "domain",
    "name",
    "sinceVersion",
    "version",
    "description",
    "inputs",
    "outputs",
    "attributes",
    "attributeDescriptions",
    "attributeConstraints",
    "typeConstraints",
    "args",
    "tunables",
    "derive",
    "constants",
    "when",
    "checks",
    "indexChecks",
    "bindingSets",
    "bindings",
    "variants",
}


def load_manifest(path: str | Path) -> KernelManifest:
    """Read and check a manifest file; raise :class:`ManifestError` on any schema error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    return parse_manifest(data, path)


def parse_manifest(data: Any, path: str | Path = "<manifest>") -> KernelManifest:
    """Check a manifest already parsed from JSON and build its model."""
    r = _Reader(Path(path))
    r.obj(data, "", _TOP_KEYS, {"name", "inputs", "outputs", "variants"})
    dialect = "binding-map" if isinstance(data["inputs"], dict) else "binding-sets"
    if dialect == "binding-sets" and "bindings" in data:
        raise r.error("bindings", "a manifest with list 'inputs' uses 'bindingSets'")
    if dialect == "binding-map" and ("bindingSets" in data or "args" in data):
        key = "bindingSets" if "bindingSets" in data else "args"
        raise r.error(key, "a manifest with map 'inputs' uses 'bindings' and no 'args'")

    tensors = (_tensors_map if dialect == "binding-map" else _tensors_list)(r, data)
    attributes = _attributes(r, data)
    type_constraints = {}
    for var, dtypes in r.typed(
        data.get("typeConstraints", {}), "typeConstraints", (dict,), "an object"
    ).items():
        r.typed(dtypes, f"typeConstraints.{var}", (list,), "a list of dtypes")
        for i, dt in enumerate(dtypes):
            if dt not in DTYPES:
                raise r.error(f"typeConstraints.{var}[{i}]", f"unknown dtype {dt!r}")
        type_constraints[var] = tuple(dtypes)
    for t in tensors.values():
        if t.dtype not in type_constraints and t.dtype not in DTYPES:
            raise r.error(f"tensors.{t.bind_key}.dtype", f"unknown type variable {t.dtype!r}")

    tunables: dict[str, Any] = {}
    for name, value in r.typed(data.get("tunables", {}), "tunables", (dict,), "an object").items():
        if isinstance(value, dict):
            r.obj(value, f"tunables.{name}", {"default", "description"}, {"default"})
            value = value["default"]
        tunables[name] = r.typed(value, f"tunables.{name}", (int, float, str), "a number")

    derive = r.expr_map(data.get("derive", {}), "derive")
    constants = r.expr_map(data["constants"], "constants") if "constants" in data else None
    when = r.expr_list(data.get("when", []), "when")
    checks = []
    for i, item in enumerate(r.typed(data.get("checks", []), "checks", (list,), "a list")):
        r.obj(item, f"checks[{i}]", {"assert", "message"}, {"assert", "message"})
        checks.append(
            ContractCheck(
                r.expr(item["assert"], f"checks[{i}].assert", False),
                r.string(item["message"], f"checks[{i}].message"),
            )
        )
    index_checks = []
    for i, item in enumerate(
        r.typed(data.get("indexChecks", []), "indexChecks", (list,), "a list")
    ):
        where = f"indexChecks[{i}]"
        r.obj(item, where, {"flag", "arg", "range"}, {"flag", "arg", "range"})
        if item["arg"] not in tensors:
            raise r.error(f"{where}.arg", f"unknown tensor {item['arg']!r}")
        rng = r.typed(item["range"], f"{where}.range", (list,), "[low, high]")
        if len(rng) != 2:
            raise r.error(f"{where}.range", "expected [low, high]")
        index_checks.append(
            IndexCheck(
                r.string(item["flag"], f"{where}.flag"),
                item["arg"],
                r.expr(rng[0], f"{where}.range[0]"),
                r.expr(rng[1], f"{where}.range[1]"),
            )
        )

    if dialect == "binding-sets":
        binding_lookup = _binding_sets(r, data, tensors)
    else:
        binding_lookup = _binding_map(r, data, tensors)

    variants = []
    seen_ids: set[str] = set()
    for i, item in enumerate(r.typed(data["variants"], "variants", (list,), "a list")):
        variant = _variant(r, item, f"variants[{i}]", binding_lookup, dialect)
        if variant.id in seen_ids:
            raise r.error(f"variants[{i}].id", f"duplicate variant id {variant.id!r}")
        seen_ids.add(variant.id)
        for p in iter_passes(variant.passes):
            for b in p.bindings:
                if b.kind == "intermediate" and b.ref not in {m.id for m in variant.intermediates}:
                    raise r.error(
                        f"variants[{i}].passes.{p.id}.bindings.{b.var_name}",
                        f"intermediate {b.ref!r} is not declared by the variant",
                    )
        variants.append(variant)
    if not variants:
        raise r.error("variants", "a manifest needs at least one variant")
    for check in index_checks:
        for variant in variants:
            if check.flag not in {m.id for m in variant.intermediates}:
                raise r.error(
                    "indexChecks",
                    f"variant {variant.id!r} does not declare the flag intermediate {check.flag!r}",
                )

    version = data.get("version", 1)
    return KernelManifest(
        path=Path(path),
        dialect=dialect,
        domain=r.typed(data.get("domain", ""), "domain", (str,), "a string"),
        name=r.string(data["name"], "name"),
        since_version=r.typed(data.get("sinceVersion", 1), "sinceVersion", (int,), "an integer"),
        version=r.typed(version, "version", (int,), "an integer"),
        description=r.typed(data.get("description", ""), "description", (str,), "a string"),
        tensors=tensors,
        attributes=attributes,
        type_constraints=type_constraints,
        tunables=tunables,
        derive=derive,
        constants=constants,
        when=when,
        checks=tuple(checks),
        index_checks=tuple(index_checks),
        variants=tuple(variants),
    )


def _tensors_list(r: _Reader, data: dict) -> dict[str, TensorSpec]:
    """Binding-set dialect: ``inputs``/``outputs`` lists by role, ``args`` by bind key."""
    roles: dict[str, tuple[str, dict]] = {}
    for io in ("inputs", "outputs"):
        items = r.typed(data[io], io, (list,), "a list")
        for i, item in enumerate(items):
            where = f"{io}[{i}]"
            r.obj(
                item,
                where,
                {"role", "dtype", "rank", "shape", "description", "optional"},
                {"role", "dtype"},
            )
            role = r.string(item["role"], f"{where}.role")
            if role in roles:
                raise r.error(f"{where}.role", f"duplicate role {role!r}")
            roles[role] = (io[:-1], item)
    args = r.typed(data.get("args"), "args", (dict,), "an object mapping bind keys")
    tensors: dict[str, TensorSpec] = {}
    for key, arg in args.items():
        where = f"args.{key}"
        r.obj(arg, where, {"kind", "semantic", "role", "optional"}, {"semantic", "role"})
        if arg.get("kind", "tensor") != "tensor":
            raise r.error(f"{where}.kind", f"unsupported kind {arg['kind']!r}")
        semantic = r.string(arg["semantic"], f"{where}.semantic")
        if semantic not in roles:
            raise r.error(f"{where}.semantic", f"no input or output has role {semantic!r}")
        io, item = roles[semantic]
        if arg["role"] != io:
            raise r.error(f"{where}.role", f"{semantic!r} is an {io}, not {arg['role']!r}")
        rank = item.get("rank")
        if rank is not None:
            rank = r.expr(rank, f"{io}s.{semantic}.rank")
        shape = item.get("shape")
        if io == "output":
            if shape is None:
                raise r.error(f"outputs.{semantic}", "an output needs a 'shape' expression")
            shape = r.expr(shape, f"outputs.{semantic}.shape", allow_literals=False)
        tensors[key] = TensorSpec(
            bind_key=key,
            semantic=semantic,
            io=io,
            dtype=r.string(item["dtype"], f"{semantic}.dtype"),
            rank=rank,
            shape=shape,
            optional=bool(arg.get("optional", item.get("optional", False))),
            description=item.get("description", ""),
        )
    bound = {t.semantic for t in tensors.values()}
    for role in roles:
        if role not in bound:
            raise r.error(f"{roles[role][0]}s.{role}", "no entry of 'args' binds this tensor")
    return tensors


def _tensors_map(r: _Reader, data: dict) -> dict[str, TensorSpec]:
    """Binding-map dialect: ``inputs``/``outputs`` maps keyed by bind key."""
    tensors: dict[str, TensorSpec] = {}
    for io in ("inputs", "outputs"):
        for key, item in r.typed(data[io], io, (dict,), "an object").items():
            where = f"{io}.{key}"
            r.obj(
                item,
                where,
                {"onnx", "dtype", "rank", "shape", "optional", "layout", "description"},
                {"dtype"},
            )
            if key in tensors:
                raise r.error(where, "bind key used twice")
            rank = item.get("rank")
            if rank is not None:
                rank = r.expr(rank, f"{where}.rank")
            shape = item.get("shape")
            if io == "outputs":
                if shape is None:
                    raise r.error(where, "an output needs a 'shape' expression")
                shape = r.expr(shape, f"{where}.shape", allow_literals=False)
            tensors[key] = TensorSpec(
                bind_key=key,
                semantic=r.string(item.get("onnx", key), f"{where}.onnx"),
                io=io[:-1],
                dtype=r.string(item["dtype"], f"{where}.dtype"),
                rank=rank,
                shape=shape,
                optional=bool(item.get("optional", False)),
                description=item.get("description", ""),
            )
    return tensors


def _attributes(r: _Reader, data: dict) -> dict[str, AttributeSpec]:
    raw = r.typed(data.get("attributes", {}), "attributes", (dict,), "an object")
    descriptions = r.typed(
        data.get("attributeDescriptions", {}), "attributeDescriptions", (dict,), "an object"
    )
    constraints = r.typed(
        data.get("attributeConstraints", {}), "attributeConstraints", (dict,), "an object"
    )
    names = list(raw) + [n for n in list(descriptions) + list(constraints) if n not in raw]
    out: dict[str, AttributeSpec] = {}
    for name in names:
        value = raw.get(name)
        has_default = name in raw
        description = descriptions.get(name, "")
        if isinstance(value, dict):  # binding-map dialect: {"default": ...}
            r.obj(value, f"attributes.{name}", {"default", "description"})
            has_default = "default" in value
            description = value.get("description", description)
            value = value.get("default")
        c = r.obj(constraints.get(name, {}), f"attributeConstraints.{name}", {"values", "required"})
        values = c.get("values")
        if values is not None:
            values = tuple(
                r.typed(values, f"attributeConstraints.{name}.values", (list,), "a list")
            )
        out[name] = AttributeSpec(
            name=name,
            default=value,
            has_default=has_default,
            required=bool(c.get("required", False)),
            values=values,
            description=r.typed(description, f"attributeDescriptions.{name}", (str,), "a string"),
        )
    return out


_BINDING_SET_KEYS = {
    "name",
    "arg",
    "semantic",
    "buffer",
    "elementType",
    "struct",
    "length",
    "optional",
}


def _binding_sets(r: _Reader, data: dict, tensors: dict[str, TensorSpec]):
    """Binding-set dialect: ``bindingSets`` name -> list; passes name a set."""
    sets: dict[str, tuple[BindingSpec, ...]] = {}
    raw_sets = r.typed(data.get("bindingSets", {}), "bindingSets", (dict,), "an object")
    for set_name, items in raw_sets.items():
        specs = []
        for i, item in enumerate(r.typed(items, f"bindingSets.{set_name}", (list,), "a list")):
            where = f"bindingSets.{set_name}[{i}]"
            r.obj(item, where, _BINDING_SET_KEYS, {"name", "buffer"})
            buffer = r.obj(item["buffer"], f"{where}.buffer", {"type"}, {"type"})["type"]
            specs.append(
                _binding(
                    r,
                    where,
                    item,
                    buffer,
                    tensors,
                    item.get("struct"),
                    scratch=None if "arg" in item else item.get("semantic"),
                )
            )
        sets[set_name] = tuple(specs)

    def lookup(value: Any, where: str) -> tuple[BindingSpec, ...]:
        name = r.string(value, where)
        if name not in sets:
            raise r.error(where, f"unknown binding set {name!r}")
        return sets[name]

    return lookup


def _binding_map(r: _Reader, data: dict, tensors: dict[str, TensorSpec]):
    """Binding-map dialect: one ``bindings`` map; passes list entries by name."""
    entries: dict[str, BindingSpec] = {}
    for key, item in r.typed(data.get("bindings", {}), "bindings", (dict,), "an object").items():
        where = f"bindings.{key}"
        r.obj(
            item,
            where,
            {"name", "arg", "scratch", "buffer", "elementType", "struct", "length", "optional"},
            {"buffer"},
        )
        struct = item.get("struct")
        if struct is not None:
            struct = {"name": "Params", "fields": struct}
        entries[key] = _binding(
            r,
            where,
            {"name": key, **item},
            r.string(item["buffer"], f"{where}.buffer"),
            tensors,
            struct,
            scratch=item.get("scratch"),
        )

    def lookup(value: Any, where: str) -> tuple[BindingSpec, ...]:
        names = r.typed(value, where, (list,), "a list of binding names")
        out = []
        for i, name in enumerate(names):
            if name not in entries:
                raise r.error(f"{where}[{i}]", f"unknown binding {name!r}")
            out.append(entries[name])
        return tuple(out)

    return lookup


def _binding(
    r: _Reader,
    where: str,
    item: dict,
    buffer: str,
    tensors: dict[str, TensorSpec],
    struct: Any,
    scratch: str | None,
) -> BindingSpec:
    if buffer not in BUFFER_TYPES:
        raise r.error(f"{where}.buffer", f"unknown buffer type {buffer!r}")
    var_name = r.string(item["name"], f"{where}.name")
    length = r.expr(item["length"], f"{where}.length") if "length" in item else None
    if buffer == "uniform":
        if struct is None:
            raise r.error(where, "a uniform binding needs a 'struct'")
        s = r.obj(struct, f"{where}.struct", {"name", "fields"}, {"fields"})
        fields = []
        for j, f in enumerate(r.typed(s["fields"], f"{where}.struct.fields", (list,), "a list")):
            fw = f"{where}.struct.fields[{j}]"
            r.obj(f, fw, {"name", "type", "value"}, {"name", "type", "value"})
            if f["type"] not in UNIFORM_FIELD_TYPES:
                raise r.error(f"{fw}.type", f"unsupported uniform field type {f['type']!r}")
            fields.append(
                UniformField(
                    r.string(f["name"], f"{fw}.name"), f["type"], r.expr(f["value"], f"{fw}.value")
                )
            )
        return BindingSpec(
            var_name=var_name,
            kind="uniform",
            ref="",
            buffer=buffer,
            struct_name=r.string(s.get("name", "Params"), f"{where}.struct.name"),
            fields=tuple(fields),
        )
    if struct is not None:
        raise r.error(f"{where}.struct", "only uniform bindings have a struct")
    element = r.string(item.get("elementType", ""), f"{where}.elementType")
    if not element:
        raise r.error(where, "a storage binding needs an 'elementType'")
    if "arg" in item:
        arg = r.string(item["arg"], f"{where}.arg")
        if arg not in tensors:
            raise r.error(f"{where}.arg", f"unknown bind key {arg!r}")
        return BindingSpec(
            var_name=var_name,
            kind="tensor",
            ref=arg,
            buffer=buffer,
            element_type=element,
            length=length,
            optional=tensors[arg].optional,
        )
    if not scratch:
        raise r.error(where, "a storage binding needs an 'arg' or an intermediate")
    return BindingSpec(
        var_name=var_name,
        kind="intermediate",
        ref=r.string(scratch, where),
        buffer=buffer,
        element_type=element,
        length=length,
    )


_VARIANT_KEYS = {
    "id",
    "priority",
    "when",
    "constants",
    "intermediates",
    "passes",
    "requires",
    "description",
}


def _variant(r: _Reader, item: Any, where: str, lookup: Callable, dialect: str) -> Variant:
    r.obj(item, where, _VARIANT_KEYS, {"id", "passes"})
    vid = r.string(item["id"], f"{where}.id")
    where = f"variants.{vid}"
    inters = []
    for i, m in enumerate(
        r.typed(item.get("intermediates", []), f"{where}.intermediates", (list,), "a list")
    ):
        mw = f"{where}.intermediates[{i}]"
        r.obj(m, mw, {"id", "dtype", "shape", "fill"}, {"id", "dtype", "shape"})
        if m["dtype"] not in DTYPES:
            raise r.error(f"{mw}.dtype", f"unknown dtype {m['dtype']!r}")
        fill = m.get("fill")
        if fill is not None:
            r.typed(fill, f"{mw}.fill", (int, float), "a number")
        inters.append(
            Intermediate(
                r.string(m["id"], f"{mw}.id"),
                m["dtype"],
                r.expr(m["shape"], f"{mw}.shape", allow_literals=False),
                fill,
            )
        )
    req = r.obj(
        item.get("requires", {}),
        f"{where}.requires",
        {"features", "limits", "subgroupMatrixConfigs"},
    )
    requires = Requirements(
        features=tuple(
            r.typed(req.get("features", []), f"{where}.requires.features", (list,), "a list")
        ),
        limits=dict(
            r.typed(req.get("limits", {}), f"{where}.requires.limits", (dict,), "an object")
        ),
        subgroup_matrix_configs=tuple(req.get("subgroupMatrixConfigs", [])),
    )
    passes = _passes(r, item["passes"], f"{where}.passes", lookup)
    if not passes:
        raise r.error(f"{where}.passes", "a variant needs at least one pass")
    return Variant(
        id=vid,
        priority=r.expr(item.get("priority", 0), f"{where}.priority"),
        when=r.expr_list(item.get("when", []), f"{where}.when"),
        constants=r.expr_map(item.get("constants", {}), f"{where}.constants"),
        intermediates=tuple(inters),
        passes=passes,
        requires=requires,
        description=r.typed(
            item.get("description", ""), f"{where}.description", (str,), "a string"
        ),
    )


_PASS_KEYS = {
    "id",
    "name",
    "shader",
    "source",
    "bindings",
    "dispatch",
    "derive",
    "subgroupCollectivesWidth",
    "description",
}


def _passes(r: _Reader, items: Any, where: str, lookup: Callable) -> tuple:
    out: list[Pass | RepeatGroup] = []
    for i, item in enumerate(r.typed(items, where, (list,), "a list")):
        pid = item.get("id", str(i)) if isinstance(item, dict) else str(i)
        pw = f"{where}.{pid}"
        if isinstance(item, dict) and "repeat" in item:
            r.obj(item, pw, {"id", "repeat", "passes"}, {"id", "repeat", "passes"})
            rep = r.obj(item["repeat"], f"{pw}.repeat", {"count", "index"}, {"count", "index"})
            out.append(
                RepeatGroup(
                    id=pid,
                    count=r.expr(rep["count"], f"{pw}.repeat.count"),
                    index=r.string(rep["index"], f"{pw}.repeat.index"),
                    passes=_passes(r, item["passes"], f"{pw}.passes", lookup),
                )
            )
            continue
        r.obj(item, pw, _PASS_KEYS, {"id", "bindings", "dispatch"})
        if ("shader" in item) == ("source" in item):
            raise r.error(pw, "a pass needs exactly one of 'shader' and 'source'")
        shader_inputs: dict[str, Any] = {}
        if "source" in item:
            src = r.obj(item["source"], f"{pw}.source", {"shader", "inputs"}, {"shader"})
            shader = r.string(src["shader"], f"{pw}.source.shader")
            shader_inputs = r.expr_map(src.get("inputs", {}), f"{pw}.source.inputs")
        else:
            shader = r.string(item["shader"], f"{pw}.shader")
        d = r.obj(item["dispatch"], f"{pw}.dispatch", {"threads", "workgroupSize", "x", "y", "z"})
        if "threads" in d:
            if "workgroupSize" not in d or any(k in d for k in "xyz"):
                raise r.error(f"{pw}.dispatch", "'threads' goes with 'workgroupSize' alone")
            dispatch = Dispatch(
                threads=r.expr(d["threads"], f"{pw}.dispatch.threads"),
                workgroup_size=r.expr(d["workgroupSize"], f"{pw}.dispatch.workgroupSize"),
            )
        else:
            if "x" not in d or "workgroupSize" in d:
                raise r.error(f"{pw}.dispatch", "expected 'threads'+'workgroupSize' or 'x'/'y'/'z'")
            dispatch = Dispatch(
                x=r.expr(d["x"], f"{pw}.dispatch.x"),
                y=r.expr(d.get("y", 1), f"{pw}.dispatch.y"),
                z=r.expr(d.get("z", 1), f"{pw}.dispatch.z"),
            )
        out.append(
            Pass(
                id=pid,
                name=r.typed(item.get("name", pid), f"{pw}.name", (str,), "a string"),
                shader=shader,
                shader_inputs=shader_inputs,
                bindings=lookup(item["bindings"], f"{pw}.bindings"),
                dispatch=dispatch,
                derive=r.expr_map(item.get("derive", {}), f"{pw}.derive"),
                subgroup_width=item.get("subgroupCollectivesWidth"),
            )
        )
    return tuple(out)
