"""Loading kernel manifests: check against the declared schema, then build the model.

Two dialects exist (see ``docs/manifest-schema.md``):

* the *binding-set* dialect (the QMoE seed, and the MoE, QMoE and GroupedMatMul packages):
  ``inputs``/``outputs`` as lists keyed by ``role``, ``args`` mapping bind keys to
  semantics, ``bindingSets`` of bindings, passes naming a binding set;
* the *binding-map* dialect (the MatMulNBitsQkv seed and package): ``inputs``/``outputs`` as
  maps keyed by bind key, one ``bindings`` map whose entries passes list by name,
  ``scratch`` buffers, ``struct`` field lists and ``$name`` references.

Both load into one :class:`KernelManifest`. Every key, type and allowed value is checked
against the dialect's JSON Schema first (:mod:`.manifest_schema`; an unknown key is a
:class:`ManifestError` naming the file and the key path). This module then checks what a
schema cannot: every expression is parsed (so a malformed one is reported at load time), and
every reference resolves (roles, bind keys, binding sets and names, intermediates, index-check
flags); and it builds the model (:mod:`.manifest_model`, whose names it re-exports).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from onnx_moe_fuse.kernels.expressions import ExpressionError, parse
from onnx_moe_fuse.kernels.manifest_model import (
    AttributeSpec,
    BindingSpec,
    ContractCheck,
    Dispatch,
    IndexCheck,
    Intermediate,
    KernelManifest,
    Pass,
    RepeatGroup,
    Requirements,
    TensorSpec,
    UniformField,
    Variant,
    iter_passes,  # noqa: F401 - re-exported: the old import path
)
from onnx_moe_fuse.kernels.manifest_schema import (
    BUFFER_TYPES,  # noqa: F401 - re-exported: the old import path
    DTYPES,
    UNIFORM_FIELD_TYPES,  # noqa: F401 - re-exported: the old import path
    ManifestError,
    check_manifest,
    manifest_error,
)

Where = list[str | int]  # a key path into the manifest: ["variants", 1, "passes", 0]
#: A pass's ``bindings`` value and its key path -> the bindings it stands for.
BindingLookup = Callable[[Any, Where], tuple[BindingSpec, ...]]


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
    dialect = check_manifest(data, Path(path))
    return _Builder(Path(path), data).manifest(dialect)


class _Builder:
    """Builds the model of a schema-valid manifest, checking expressions and references.

    The schema has vouched for every key and type, so this reads the JSON directly; the
    order of its checks is the order the loader has always reported problems in.
    """

    def __init__(self, path: Path, data: dict[str, Any]):
        self.path = path
        self.data = data
        self.tensor_paths: dict[str, Where] = {}  # bind key -> where its entry is

    def error(self, where: Where, message: str) -> ManifestError:
        return manifest_error(self.path, self.data, where, message)

    # -- expressions -------------------------------------------------------------------------

    def expr(self, value: Any, where: Where) -> Any:
        """An expression: a string parsed now, or a literal (a list's items are expressions)."""
        if isinstance(value, str):
            if value.startswith("$") and value[1:].isidentifier():
                value = value[1:]  # binding-map dialect: "$name" refers to a derived value
            try:
                parse(value)
            except ExpressionError as exc:
                raise self.error(where, f"{value!r}: {exc}") from None
            return value
        if isinstance(value, list):
            return [self.expr(v, [*where, i]) for i, v in enumerate(value)]
        return value

    def expr_map(self, value: dict[str, Any], where: Where) -> dict[str, Any]:
        return {k: self.expr(v, [*where, k]) for k, v in value.items()}

    def expr_list(self, value: list[str], where: Where) -> tuple[str, ...]:
        return tuple(self.expr(v, [*where, i]) for i, v in enumerate(value))

    # -- the manifest ------------------------------------------------------------------------

    def manifest(self, dialect: str) -> KernelManifest:
        data = self.data
        tensors = self.tensors_map() if dialect == "binding-map" else self.tensors_list()
        attributes = self.attributes()
        type_constraints = {
            var: tuple(dtypes) for var, dtypes in data.get("typeConstraints", {}).items()
        }
        for t in tensors.values():
            if t.dtype not in type_constraints and t.dtype not in DTYPES:
                raise self.error(
                    [*self.tensor_paths[t.bind_key], "dtype"], f"unknown type variable {t.dtype!r}"
                )
        tunables = {
            name: value["default"] if isinstance(value, dict) else value
            for name, value in data.get("tunables", {}).items()
        }
        derive = self.expr_map(data.get("derive", {}), ["derive"])
        constants = self.expr_map(data["constants"], ["constants"]) if "constants" in data else None
        when = self.expr_list(data.get("when", []), ["when"])
        checks = tuple(
            ContractCheck(self.expr(item["assert"], ["checks", i, "assert"]), item["message"])
            for i, item in enumerate(data.get("checks", []))
        )
        index_checks = []
        for i, item in enumerate(data.get("indexChecks", [])):
            where: Where = ["indexChecks", i]
            if item["arg"] not in tensors:
                raise self.error([*where, "arg"], f"unknown tensor {item['arg']!r}")
            low, high = item["range"]
            index_checks.append(
                IndexCheck(
                    item["flag"],
                    item["arg"],
                    self.expr(low, [*where, "range", 0]),
                    self.expr(high, [*where, "range", 1]),
                )
            )
        lookup = (
            self.binding_map(tensors) if dialect == "binding-map" else self.binding_sets(tensors)
        )
        variants = self.variants(lookup)
        for i, check in enumerate(index_checks):
            for variant in variants:
                if check.flag not in {m.id for m in variant.intermediates}:
                    raise self.error(
                        ["indexChecks", i, "flag"],
                        f"variant {variant.id!r} does not declare the flag intermediate "
                        f"{check.flag!r}",
                    )
        return KernelManifest(
            path=self.path,
            dialect=dialect,
            domain=data.get("domain", ""),
            name=data["name"],
            since_version=data.get("sinceVersion", 1),
            version=data.get("version", 1),
            description=data.get("description", ""),
            tensors=tensors,
            attributes=attributes,
            type_constraints=type_constraints,
            tunables=tunables,
            derive=derive,
            constants=constants,
            when=when,
            checks=checks,
            index_checks=tuple(index_checks),
            variants=variants,
        )

    # -- tensors and attributes --------------------------------------------------------------

    def tensors_list(self) -> dict[str, TensorSpec]:
        """Binding-set dialect: ``inputs``/``outputs`` lists by role, ``args`` by bind key."""
        roles: dict[str, tuple[str, Where, dict]] = {}
        for io in ("inputs", "outputs"):
            for i, item in enumerate(self.data[io]):
                if item["role"] in roles:
                    raise self.error([io, i, "role"], f"duplicate role {item['role']!r}")
                roles[item["role"]] = (io[:-1], [io, i], item)
        tensors: dict[str, TensorSpec] = {}
        for key, arg in self.data["args"].items():
            semantic = arg["semantic"]
            if semantic not in roles:
                raise self.error(
                    ["args", key, "semantic"], f"no input or output has role {semantic!r}"
                )
            io, where, item = roles[semantic]
            if arg["role"] != io:
                raise self.error(
                    ["args", key, "role"], f"{semantic!r} is an {io}, not {arg['role']!r}"
                )
            tensors[key] = self.tensor(
                key, semantic, io, where, item, arg.get("optional", item.get("optional", False))
            )
        bound = {t.semantic for t in tensors.values()}
        for role, (_, where, _) in roles.items():
            if role not in bound:
                raise self.error(where, "no entry of 'args' binds this tensor")
        return tensors

    def tensors_map(self) -> dict[str, TensorSpec]:
        """Binding-map dialect: ``inputs``/``outputs`` maps keyed by bind key."""
        tensors: dict[str, TensorSpec] = {}
        for io in ("inputs", "outputs"):
            for key, item in self.data[io].items():
                if key in tensors:
                    raise self.error([io, key], "bind key used twice")
                semantic = item.get("onnx", key)
                optional = item.get("optional", False)
                tensors[key] = self.tensor(key, semantic, io[:-1], [io, key], item, optional)
        return tensors

    def tensor(
        self, key: str, semantic: str, io: str, where: Where, item: dict, optional: bool
    ) -> TensorSpec:
        self.tensor_paths[key] = where
        rank = item.get("rank")
        if rank is not None:
            rank = self.expr(rank, [*where, "rank"])
        shape = item.get("shape")  # an input's shape is documentation: never evaluated
        if io == "output":
            shape = self.expr(shape, [*where, "shape"])
        return TensorSpec(
            bind_key=key,
            semantic=semantic,
            io=io,
            dtype=item["dtype"],
            rank=rank,
            shape=shape,
            optional=optional,
            description=item.get("description", ""),
        )

    def attributes(self) -> dict[str, AttributeSpec]:
        raw = self.data.get("attributes", {})
        descriptions = self.data.get("attributeDescriptions", {})
        constraints = self.data.get("attributeConstraints", {})
        names = list(raw) + [n for n in list(descriptions) + list(constraints) if n not in raw]
        out: dict[str, AttributeSpec] = {}
        for name in names:
            value = raw.get(name)
            has_default = name in raw
            description = descriptions.get(name, "")
            if isinstance(value, dict):  # {"default"?, "description"?}
                has_default = "default" in value
                description = value.get("description", description)
                value = value.get("default")
            c = constraints.get(name, {})
            out[name] = AttributeSpec(
                name=name,
                default=value,
                has_default=has_default,
                required=c.get("required", False),
                values=tuple(c["values"]) if "values" in c else None,
                description=description,
            )
        return out

    # -- bindings ----------------------------------------------------------------------------

    def binding_sets(self, tensors: dict[str, TensorSpec]) -> BindingLookup:
        """Binding-set dialect: ``bindingSets`` name -> list; a pass names a set."""
        sets: dict[str, tuple[BindingSpec, ...]] = {}
        for set_name, items in self.data.get("bindingSets", {}).items():
            specs = []
            for i, item in enumerate(items):
                where: Where = ["bindingSets", set_name, i]
                struct = item.get("struct", {})
                specs.append(
                    self.binding(
                        where,
                        item,
                        item["name"],
                        item["buffer"]["type"],
                        tensors,
                        fields=(struct.get("fields", []), [*where, "struct", "fields"]),
                        struct_name=struct.get("name", "Params"),
                        scratch=item.get("semantic"),
                    )
                )
            sets[set_name] = tuple(specs)

        def lookup(value: str, where: Where) -> tuple[BindingSpec, ...]:
            if value not in sets:
                raise self.error(where, f"unknown binding set {value!r}")
            return sets[value]

        return lookup

    def binding_map(self, tensors: dict[str, TensorSpec]) -> BindingLookup:
        """Binding-map dialect: one ``bindings`` map; a pass lists entries by name."""
        entries: dict[str, BindingSpec] = {}
        for key, item in self.data.get("bindings", {}).items():
            where: Where = ["bindings", key]
            entries[key] = self.binding(
                where,
                item,
                item.get("name", key),
                item["buffer"],
                tensors,
                fields=(item.get("struct", []), [*where, "struct"]),
                struct_name="Params",
                scratch=item.get("scratch"),
            )

        def lookup(value: list[str], where: Where) -> tuple[BindingSpec, ...]:
            out = []
            for i, name in enumerate(value):
                if name not in entries:
                    raise self.error([*where, i], f"unknown binding {name!r}")
                out.append(entries[name])
            return tuple(out)

        return lookup

    def binding(
        self,
        where: Where,
        item: dict,
        var_name: str,
        buffer: str,
        tensors: dict[str, TensorSpec],
        fields: tuple[list[dict], Where],
        struct_name: str,
        scratch: str | None,
    ) -> BindingSpec:
        """One binding; ``fields`` is a uniform's field list with its key path."""
        length = self.expr(item["length"], [*where, "length"]) if "length" in item else None
        if buffer == "uniform":
            field_list, fields_where = fields
            return BindingSpec(
                var_name=var_name,
                kind="uniform",
                ref="",
                buffer=buffer,
                struct_name=struct_name,
                fields=tuple(
                    UniformField(f["name"], f["type"], self.expr(f["value"], [*fields_where, j]))
                    for j, f in enumerate(field_list)
                ),
            )
        element = item["elementType"]
        if "arg" in item:
            arg = item["arg"]
            if arg not in tensors:
                raise self.error([*where, "arg"], f"unknown bind key {arg!r}")
            return BindingSpec(
                var_name=var_name,
                kind="tensor",
                ref=arg,
                buffer=buffer,
                element_type=element,
                length=length,
                optional=tensors[arg].optional,
            )
        return BindingSpec(
            var_name=var_name,
            kind="intermediate",
            ref=scratch,
            buffer=buffer,
            element_type=element,
            length=length,
        )

    # -- variants and passes -----------------------------------------------------------------

    def variants(self, lookup: BindingLookup) -> tuple[Variant, ...]:
        variants = []
        seen_ids: set[str] = set()
        for i, item in enumerate(self.data["variants"]):
            variant = self.variant(item, ["variants", i], lookup)
            if variant.id in seen_ids:
                raise self.error(["variants", i, "id"], f"duplicate variant id {variant.id!r}")
            seen_ids.add(variant.id)
            declared = {m.id for m in variant.intermediates}
            for where, p in _passes_with_paths(item["passes"], variant.passes, ["variants", i]):
                for b in p.bindings:
                    if b.kind == "intermediate" and b.ref not in declared:
                        raise self.error(
                            [*where, "bindings"],
                            f"binding {b.var_name!r}: intermediate {b.ref!r} is not declared "
                            "by the variant",
                        )
            variants.append(variant)
        return tuple(variants)

    def variant(self, item: dict, where: Where, lookup: BindingLookup) -> Variant:
        intermediates = tuple(
            Intermediate(
                id=m["id"],
                dtype=m["dtype"],
                shape=self.expr(m["shape"], [*where, "intermediates", i, "shape"]),
                fill=m.get("fill"),
            )
            for i, m in enumerate(item.get("intermediates", []))
        )
        req = item.get("requires", {})
        requires = Requirements(
            features=tuple(req.get("features", [])),
            limits=dict(req.get("limits", {})),
            subgroup_matrix_configs=tuple(req.get("subgroupMatrixConfigs", [])),
        )
        passes = self.passes(item["passes"], [*where, "passes"], lookup)
        return Variant(
            id=item["id"],
            priority=self.expr(item.get("priority", 0), [*where, "priority"]),
            when=self.expr_list(item.get("when", []), [*where, "when"]),
            constants=self.expr_map(item.get("constants", {}), [*where, "constants"]),
            intermediates=intermediates,
            passes=passes,
            requires=requires,
            description=item.get("description", ""),
        )

    def passes(
        self, items: list[dict], where: Where, lookup: BindingLookup
    ) -> tuple[Pass | RepeatGroup, ...]:
        out: list[Pass | RepeatGroup] = []
        for i, item in enumerate(items):
            at: Where = [*where, i]
            if "repeat" in item:
                out.append(
                    RepeatGroup(
                        id=item["id"],
                        count=self.expr(item["repeat"]["count"], [*at, "repeat", "count"]),
                        index=item["repeat"]["index"],
                        passes=self.passes(item["passes"], [*at, "passes"], lookup),
                    )
                )
                continue
            shader_inputs: dict[str, Any] = {}
            if "source" in item:
                shader = item["source"]["shader"]
                inputs = item["source"].get("inputs", {})
                shader_inputs = self.expr_map(inputs, [*at, "source", "inputs"])
            else:
                shader = item["shader"]
            out.append(
                Pass(
                    id=item["id"],
                    name=item.get("name", item["id"]),
                    shader=shader,
                    shader_inputs=shader_inputs,
                    bindings=lookup(item["bindings"], [*at, "bindings"]),
                    dispatch=self.dispatch(item["dispatch"], [*at, "dispatch"]),
                    derive=self.expr_map(item.get("derive", {}), [*at, "derive"]),
                    subgroup_width=item.get("subgroupCollectivesWidth"),
                )
            )
        return tuple(out)

    def dispatch(self, d: dict, where: Where) -> Dispatch:
        if "threads" in d:
            return Dispatch(
                threads=self.expr(d["threads"], [*where, "threads"]),
                workgroup_size=self.expr(d["workgroupSize"], [*where, "workgroupSize"]),
            )
        return Dispatch(
            x=self.expr(d["x"], [*where, "x"]),
            y=self.expr(d.get("y", 1), [*where, "y"]),
            z=self.expr(d.get("z", 1), [*where, "z"]),
        )


def _passes_with_paths(
    items: list[dict], built: tuple[Pass | RepeatGroup, ...], where: Where
) -> Iterator[tuple[Where, Pass]]:
    """Each pass of a variant with its key path, repeat groups flattened (as iter_passes)."""
    for i, (item, p) in enumerate(zip(items, built, strict=True)):
        at: Where = [*where, "passes", i]
        if isinstance(p, RepeatGroup):
            yield from _passes_with_paths(item["passes"], p.passes, at)
        else:
            yield at, p
