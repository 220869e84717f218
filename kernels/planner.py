"""Checking a kernel call against its manifest and choosing a variant.

:func:`make_plan` turns a manifest, the call's tensors, attributes and tunables, and a
device's limits into a :class:`Plan`: the expression scope every later expression is
evaluated in, the output shapes and dtypes, the chosen variant, and for every rejected
variant the first condition that failed (followed into the derive rules it names).
Selection: every ``when`` condition true (the manifest's top-level ones too) and the
``requires`` block met; the highest priority wins; ties go to the variant listed first.
"""

from __future__ import annotations

import ast
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnx_moe_fuse.kernels.expressions import (
    ExpressionError,
    FeatureSet,
    Record,
    Scope,
    make_f16_ok,
    parse,
)
from onnx_moe_fuse.kernels.manifest_model import KernelManifest, TensorSpec, Variant

#: numpy dtype -> manifest dtype name.
NUMPY_DTYPES = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float16): "float16",
    np.dtype(np.float64): "float64",
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
    np.dtype(np.uint32): "uint32",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.int8): "int8",
}
MANIFEST_DTYPES = {name: dt for dt, name in NUMPY_DTYPES.items()}


class KernelCallError(ValueError):
    """A kernel call does not fit the manifest's contract; the message says what and where."""


@dataclass
class DeviceFacts:
    """What expressions may ask of the device: limits, features, adapter information."""

    limits: dict[str, int]
    features: frozenset[str]
    adapter_info: dict[str, Any]

    def record(self) -> Record:
        """The ``device`` namespace."""
        return Record(
            "device",
            {
                "limits": Record("device.limits", self.limits),
                "features": FeatureSet("device.features", sorted(self.features)),
                "adapterInfo": Record("device.adapterInfo", self.adapter_info),
            },
        )


@dataclass
class Plan:
    """A checked call: scope, tensors, outputs, the chosen variant and the rejections."""

    manifest: KernelManifest
    scope: Scope
    tensors: dict[str, np.ndarray]
    output_shapes: dict[str, tuple[int, ...]]
    output_dtypes: dict[str, str]
    variant: Variant | None
    rejected: dict[str, str] = field(default_factory=dict)
    priorities: dict[str, int] = field(default_factory=dict)

    @property
    def variant_id(self) -> str | None:
        """The chosen variant's id (None when no variant fits)."""
        return self.variant.id if self.variant else None

    def explain(self) -> str:
        """A few lines saying which variant was chosen and why the others were not."""
        lines = [f"{self.manifest.qualified_name}: chose {self.variant_id or 'nothing'}"]
        for vid, reason in self.rejected.items():
            lines.append(f"  {vid}: rejected: {reason}")
        return "\n".join(lines)


def _dtype_name(array: np.ndarray, key: str, kernel: str) -> str:
    name = NUMPY_DTYPES.get(array.dtype)
    if name is None:
        raise KernelCallError(f"{kernel}: {key} has dtype {array.dtype}, which no kernel accepts")
    return name


def _bind_tensors(manifest: KernelManifest, tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    kernel = manifest.qualified_name
    bound: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        spec = manifest.tensors.get(key)
        if spec is None:
            known = ", ".join(t.bind_key for t in manifest.inputs)
            raise KernelCallError(f"{kernel}: unknown tensor {key!r} (inputs: {known})")
        if spec.io != "input":
            raise KernelCallError(f"{kernel}: {key} is an output; it is returned, not passed")
        if value is None:
            if not spec.optional:
                raise KernelCallError(f"{kernel}: required input {key} is None")
            continue
        array = np.ascontiguousarray(value)
        _dtype_name(array, key, kernel)
        bound[key] = array
    for spec in manifest.inputs:
        if not spec.optional and spec.bind_key not in bound:
            raise KernelCallError(f"{kernel}: missing required input {spec.bind_key}")
    return bound


def _resolve_types(manifest: KernelManifest, tensors: dict[str, np.ndarray]) -> dict[str, str]:
    kernel = manifest.qualified_name
    chosen: dict[str, tuple[str, str]] = {}
    for key, array in tensors.items():
        spec = manifest.tensors[key]
        name = _dtype_name(array, key, kernel)
        allowed = manifest.type_constraints.get(spec.dtype, (spec.dtype,))
        if name not in allowed:
            raise KernelCallError(
                f"{kernel}: {key} has dtype {name}; {spec.dtype} must be one of {', '.join(allowed)}"
            )
        if spec.dtype in manifest.type_constraints:
            if spec.dtype in chosen and chosen[spec.dtype][0] != name:
                other = chosen[spec.dtype][1]
                raise KernelCallError(
                    f"{kernel}: {key} is {name} but {other} is {chosen[spec.dtype][0]}; "
                    f"both are type {spec.dtype} and must match"
                )
            chosen.setdefault(spec.dtype, (name, key))
    return {var: name for var, (name, _) in chosen.items()}


def _attributes(manifest: KernelManifest, attrs: Mapping[str, Any] | None) -> dict[str, Any]:
    kernel = manifest.qualified_name
    values: dict[str, Any] = {}
    given = dict(attrs or {})
    for name in given:
        if name not in manifest.attributes:
            known = ", ".join(sorted(manifest.attributes))
            raise KernelCallError(f"{kernel}: unknown attribute {name!r} (known: {known})")
    for name, spec in manifest.attributes.items():
        if name in given:
            value = given[name]
            if isinstance(value, np.generic):
                value = value.item()
            if spec.values is not None and value not in spec.values:
                allowed = ", ".join(repr(v) for v in spec.values)
                raise KernelCallError(
                    f"{kernel}: attribute {name}={value!r} is not supported (allowed: {allowed})"
                )
            values[name] = value
        elif spec.has_default:
            values[name] = spec.default
        elif spec.required:
            raise KernelCallError(f"{kernel}: attribute {name} is required")
    return values


def _tunables(manifest: KernelManifest, tunables: Mapping[str, Any] | None) -> dict[str, Any]:
    values = dict(manifest.tunables)
    for name, value in (tunables or {}).items():
        if name not in values:
            known = ", ".join(sorted(values)) or "none"
            raise KernelCallError(
                f"{manifest.qualified_name}: unknown tunable {name!r} (known: {known})"
            )
        values[name] = value
    return values


def _shape_records(specs: list[tuple[TensorSpec, tuple[int, ...], str]]):
    shapes, ranks, dtypes = {}, {}, {}
    for spec, shape, dtype in specs:
        for key in {spec.bind_key, spec.semantic}:
            shapes[key] = list(shape)
            ranks[key] = len(shape)
            dtypes[key] = dtype
    return shapes, ranks, dtypes


def _optional_outputs(manifest: KernelManifest, names: Iterable[str]) -> frozenset[str]:
    if isinstance(names, str):
        names = (names,)
    optional = [t.bind_key for t in manifest.outputs if t.optional]
    for name in names:
        if name not in optional:
            known = ", ".join(optional) or "none"
            raise KernelCallError(
                f"{manifest.qualified_name}: {name!r} is not an optional output "
                f"(optional outputs: {known})"
            )
    return frozenset(names)


def make_plan(
    manifest: KernelManifest,
    device: DeviceFacts,
    tensors: Mapping[str, Any],
    attrs: Mapping[str, Any] | None = None,
    tunables: Mapping[str, Any] | None = None,
    variant: str | None = None,
    optional_outputs: Iterable[str] = (),
) -> Plan:
    """Check a call and choose its variant (``variant`` forces one).

    Optional outputs are produced only when named in ``optional_outputs`` (bind keys);
    ``present.<key>`` tells the manifest's expressions which ones were asked for.
    """
    kernel = manifest.qualified_name
    wanted = _optional_outputs(manifest, optional_outputs)
    bound = _bind_tensors(manifest, tensors)
    type_vars = _resolve_types(manifest, bound)
    attr_values = _attributes(manifest, attrs)
    tunable_values = _tunables(manifest, tunables)

    inputs = [(manifest.tensors[k], a.shape, NUMPY_DTYPES[a.dtype]) for k, a in bound.items()]
    present = {t.bind_key: t.bind_key in bound for t in manifest.tensors.values()}
    present.update({t.semantic: present[t.bind_key] for t in manifest.tensors.values()})
    for spec in manifest.outputs:
        present[spec.bind_key] = present[spec.semantic] = (
            not spec.optional or spec.bind_key in wanted
        )

    def scope_for(specs) -> Scope:
        shapes, ranks, dtypes = _shape_records(specs)
        return Scope(
            values={
                "attrs": Record("attrs", attr_values),
                "shapes": Record("shapes", shapes),
                "ranks": Record("ranks", ranks),
                "tensorDtypes": Record("tensorDtypes", dtypes),
                "present": Record("present", present),
                "tunables": Record("tunables", tunable_values),
                "device": device.record(),
            },
            derived=manifest.derive,
            functions={"f16Ok": make_f16_ok("shader-f16" in device.features)},
        )

    input_scope = scope_for(inputs)
    for spec, shape, _ in inputs:
        if spec.rank is not None:
            want = input_scope.evaluate(spec.rank, f"rank of {spec.bind_key}")
            if len(shape) != want:
                raise KernelCallError(
                    f"{kernel}: {spec.bind_key} has rank {len(shape)} {list(shape)}; expected {want}"
                )
    output_shapes: dict[str, tuple[int, ...]] = {}
    output_dtypes: dict[str, str] = {}
    outputs = []
    for spec in manifest.outputs:
        if not present[spec.bind_key]:
            continue
        try:
            shape = input_scope.evaluate(spec.shape, f"shape of {spec.bind_key}")
        except ExpressionError as exc:
            raise KernelCallError(
                f"{kernel}: cannot derive the shape of {spec.bind_key}: {exc}"
            ) from None
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise KernelCallError(f"{kernel}: shape of {spec.bind_key} came out as {shape!r}")
        dtype = type_vars.get(spec.dtype, spec.dtype)
        if dtype not in MANIFEST_DTYPES:
            raise KernelCallError(
                f"{kernel}: cannot tell the dtype of {spec.bind_key} ({spec.dtype})"
            )
        output_shapes[spec.bind_key] = tuple(shape)
        output_dtypes[spec.bind_key] = dtype
        outputs.append((spec, tuple(shape), dtype))

    scope = scope_for(inputs + outputs)
    for check in manifest.checks:
        try:
            ok = scope.evaluate(check.condition, "check")
        except ExpressionError as exc:
            raise KernelCallError(
                f"{kernel}: {format_message(scope, check.message)} ({exc})"
            ) from None
        if not ok:
            raise KernelCallError(f"{kernel}: {format_message(scope, check.message)}")

    plan = Plan(manifest, scope, bound, output_shapes, output_dtypes, None)
    accepted: list[tuple[int, int, Variant]] = []
    for order, candidate in enumerate(manifest.variants):
        reason = rejection(scope, manifest, candidate, device)
        if reason is not None:
            plan.rejected[candidate.id] = reason
            continue
        try:
            priority = scope.evaluate(candidate.priority, f"priority of {candidate.id}")
        except ExpressionError as exc:
            plan.rejected[candidate.id] = str(exc)
            continue
        plan.priorities[candidate.id] = priority
        accepted.append((-priority, order, candidate))
    if variant is not None:
        ids = [v.id for v in manifest.variants]
        if variant not in ids:
            raise KernelCallError(
                f"{kernel}: unknown variant {variant!r} (variants: {', '.join(ids)})"
            )
        if variant in plan.rejected:
            raise KernelCallError(
                f"{kernel}: variant {variant} cannot run this call: {plan.rejected[variant]}"
            )
        plan.variant = next(v for v in manifest.variants if v.id == variant)
    elif accepted:
        plan.variant = min(accepted, key=lambda item: item[:2])[2]
    else:
        lines = "; ".join(f"{vid}: {why}" for vid, why in plan.rejected.items())
        raise KernelCallError(f"{kernel}: no variant accepts this call ({lines})")
    return plan


def rejection(scope: Scope, manifest: KernelManifest, variant: Variant, device: DeviceFacts):
    """Why ``variant`` cannot run (the first failing condition), or None when it can."""
    for feature in variant.requires.features:
        if feature not in device.features:
            return f"requires device feature {feature!r}"
    for name, minimum in variant.requires.limits.items():
        if device.limits.get(name, 0) < minimum:
            return f"requires device limit {name} >= {minimum} (device: {device.limits.get(name)})"
    if variant.requires.subgroup_matrix_configs:
        return "requires subgroup matrix configurations, which this runtime cannot query"
    for condition in (*manifest.when, *variant.when):
        try:
            ok = scope.evaluate(condition, "condition")
        except ExpressionError as exc:
            return f"when {condition!r} could not be evaluated: {exc}"
        if not ok:
            return "when " + " -> ".join(explain_false(scope, condition)) + " is false"
    return None


def explain_false(scope: Scope, source: str, depth: int = 0) -> list[str]:
    """Follow a false condition into the derive rule or conjunct that made it false.

    ``groupedContract`` becomes ``["groupedContract", "groupedShapeOk", "numTokens * ..."]``.
    """
    node = parse(source)
    derived = scope.derived_expressions()
    if depth < 16:
        if isinstance(node, ast.Name) and isinstance(derived.get(node.id), str):
            return [source, *explain_false(scope, derived[node.id], depth + 1)]
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            for operand in node.values:
                text = ast.unparse(operand)
                try:
                    value = scope.evaluate(text)
                except ExpressionError:
                    return [text]
                if not value:
                    return explain_false(scope, text, depth + 1)
    return [source]


def format_message(scope: Scope, message: str) -> str:
    """Fill ``{expression}`` fields of a manifest message from ``scope``."""
    out = []
    for literal, field_name, spec, _ in string.Formatter().parse(message):
        out.append(literal)
        if field_name is not None:
            try:
                value = scope.evaluate(field_name)
            except ExpressionError:
                value = f"<{field_name}?>"
            out.append(format(value, spec or ""))
    return "".join(out)
