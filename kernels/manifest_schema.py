"""The declared manifest schema: JSON Schema files per dialect, and errors worded from them.

The schema of a kernel manifest is declared in three JSON Schema (draft 2020-12) files beside
this module: ``manifest-binding-set.schema.json`` and ``manifest-binding-map.schema.json``, one
per dialect, and ``manifest-common.schema.json`` with the definitions they share. They say
every key a manifest may hold, its type and its allowed values; unknown keys are errors
(``additionalProperties: false`` throughout). What they cannot say (expressions, and references
between tensors, bindings, passes and intermediates) :mod:`.manifest` checks while it builds
the model.

:func:`check_manifest` picks the dialect from ``inputs`` (an object: binding-map; otherwise
binding-set), validates, and raises :class:`ManifestError` for the first error in document
order, worded from the schema: a subschema's ``errorMessage`` (keyword -> message, the
ajv-errors convention) when it has one, otherwise a message made from the failed keyword.
Every error names the file and the key path (``variants[1].passes[0].dispatch.w: unknown
key``), followed by the ids of the variant and pass it lies in.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, ValidationError, validators
from jsonschema.exceptions import best_match

SCHEMA_FOLDER = Path(__file__).resolve().parent
COMMON_SCHEMA = "manifest-common.schema.json"
#: Dialect (``KernelManifest.dialect``) -> the schema file its manifests are checked against.
DIALECT_SCHEMAS = {
    "binding-sets": "manifest-binding-set.schema.json",
    "binding-map": "manifest-binding-map.schema.json",
}


class ManifestError(ValueError):
    """A manifest does not follow the schema; the message names the file and key path."""


def _read_schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMA_FOLDER / name).read_text(encoding="utf-8"))


_COMMON_DEFS = _read_schema(COMMON_SCHEMA)["$defs"]
#: Element dtypes a manifest may name for tensors and intermediates (from the schema).
DTYPES = tuple(_COMMON_DEFS["dtype"]["enum"])
BUFFER_TYPES = tuple(_COMMON_DEFS["bufferType"]["enum"])
UNIFORM_FIELD_TYPES = tuple(_COMMON_DEFS["uniformField"]["properties"]["type"]["enum"])

# JSON Schema counts 1.0 as an integer; versions and device limits are Python ints in the
# model, and the loader has always refused 1.0 for them, so "integer" means int here.
_Validator = validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool)
    ),
)


@cache
def dialect_validator(dialect: str) -> Draft202012Validator:
    """The validator of one dialect: the schema files bundled, nothing to retrieve."""
    # A compound schema document, as JSON Schema 2020-12 bundles one: each file embedded under
    # its $id, so the relative $refs between them ("manifest-common.schema.json#/$defs/...")
    # resolve here as they do in an editor that opens the files from this folder.
    # - The entry is a $ref to the dialect's file, not the file itself: jsonschema then indexes
    #   the embedded files once, at that first $ref, instead of at every $ref out of the
    #   dialect's file (three times faster on the QMoE manifest).
    # - The embedded files drop their (same) "$schema": jsonschema would otherwise validate
    #   inside them with its stock class, without the "integer" above.
    embedded = {}
    for name in (DIALECT_SCHEMAS[dialect], COMMON_SCHEMA):
        embedded[name] = {k: v for k, v in _read_schema(name).items() if k != "$schema"}
    bundle = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$ref": DIALECT_SCHEMAS[dialect],
        "$defs": embedded,
    }
    return _Validator(bundle)


def dialect_of(data: Any) -> str:
    """``binding-map`` when ``inputs`` is an object, otherwise ``binding-sets``."""
    if isinstance(data, dict) and isinstance(data.get("inputs"), dict):
        return "binding-map"
    return "binding-sets"


def check_manifest(data: Any, path: Path) -> str:
    """Validate parsed manifest JSON against its dialect's schema; return the dialect.

    Raises :class:`ManifestError` for the first error in document order (an object's own
    errors before those inside it).
    """
    dialect = dialect_of(data)
    errors = list(dialect_validator(dialect).iter_errors(data))
    if errors:
        first = min(errors, key=lambda e: _order(data, e))
        where, message = _describe(first)
        raise manifest_error(path, data, where, message)
    return dialect


def manifest_error(
    path: Path, data: Any, where: Sequence[str | int], message: str
) -> ManifestError:
    """The error for ``where`` (a key path into ``data``) in manifest file ``path``."""
    return ManifestError(f"{path}: {format_path(where)}: {message}{_named_items(data, where)}")


def format_path(where: Sequence[str | int]) -> str:
    """``["variants", 1, "passes", 0]`` -> ``variants[1].passes[0]``."""
    text = ""
    for step in where:
        text += f"[{step}]" if isinstance(step, int) else (f".{step}" if text else str(step))
    return text or "(top level)"


# -- wording ---------------------------------------------------------------------------------

#: Keyword ranks among errors at one place: unknown keys first, then missing ones, then types.
_RANK = {"additionalProperties": 0, "required": 1, "type": 2}
_TYPE_WORDS = {
    "object": "an object",
    "array": "a list",
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean",
    "null": "null",
}


def _order(data: Any, error: ValidationError) -> tuple:
    """Sort key: the error's place in document order, then its keyword's rank."""
    positions, node = [], data
    for step in error.absolute_path:
        if isinstance(node, dict):
            keys = list(node)
            positions.append(keys.index(step) if step in node else len(keys))
            node = node.get(step)
        elif isinstance(node, list) and isinstance(step, int) and step < len(node):
            positions.append(step)
            node = node[step]
        else:
            positions.append(0)
            node = None
    return (tuple(positions), _RANK.get(error.validator, len(_RANK)))


def _describe(error: ValidationError) -> tuple[list[str | int], str]:
    """The key path and the message of a validation error."""
    where = list(error.absolute_path)
    keyword, value, instance = error.validator, error.validator_value, error.instance
    custom = error.schema.get("errorMessage", {}) if isinstance(error.schema, dict) else {}
    if keyword in custom:
        return where, custom[keyword].format(value=_shown(instance))
    if keyword == "additionalProperties":
        known = error.schema.get("properties", {})
        extra = next(key for key in instance if key not in known)
        return [*where, extra], "unknown key"
    if keyword == "required":
        missing = next(key for key in value if key not in instance)
        return where, f"missing required key {missing!r}"
    if keyword == "type":
        kinds = [value] if isinstance(value, str) else value
        wanted = " or ".join(_TYPE_WORDS[kind] for kind in kinds)
        return where, f"expected {wanted}, got {_shown(instance)}"
    if keyword == "enum":
        return where, f"expected one of {', '.join(map(repr, value))}, got {_shown(instance)}"
    if keyword == "const":
        return where, f"expected {value!r}, got {_shown(instance)}"
    if keyword in ("anyOf", "oneOf") and error.context:
        return _describe(best_match(error.context))
    if keyword is None or keyword == "not":  # a `false` subschema, or `not`
        return where, "not allowed here"
    return where, error.message


def _shown(value: Any) -> str:
    """A value in a message: scalars as written, containers by kind (they can be long)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return repr(value)


#: List key -> (what its items are called, the key that names an item).
_NAMED_LISTS = {
    "variants": ("variant", "id"),
    "passes": ("pass", "id"),
    "intermediates": ("intermediate", "id"),
    "inputs": ("input", "role"),
    "outputs": ("output", "role"),
}


def _named_items(data: Any, where: Sequence[str | int]) -> str:
    """`` (variant 'tiled', pass 'group')``: the named list items a key path passes through."""
    names, node, parent = [], data, None
    for i, step in enumerate(where):
        try:
            node = node[step]
        except (KeyError, IndexError, TypeError):
            break
        if isinstance(step, int) and parent in _NAMED_LISTS and isinstance(node, dict):
            label, key = _NAMED_LISTS[parent]
            name = node.get(key)
            # The item's name is worth saying unless the path ends at that very name.
            if isinstance(name, str) and list(where[i + 1 :]) != [key]:
                names.append(f"{label} {name!r}")
        parent = step
    return f" ({', '.join(names)})" if names else ""
