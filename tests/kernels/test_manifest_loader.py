"""The strict manifest loader: both dialects load; schema errors name file and key path.

The schema is declared in ``kernels/manifest-*.schema.json`` (JSON Schema, draft 2020-12);
the tests below check that the files are valid schemas, that every shipped manifest follows
its dialect's, and that an error names the file, the key path and what is wrong.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
from jsonschema import Draft202012Validator

from onnx_moe_fuse.kernels.manifest import ManifestError, load_manifest, parse_manifest
from onnx_moe_fuse.kernels.manifest_schema import (
    COMMON_SCHEMA,
    DIALECT_SCHEMAS,
    SCHEMA_FOLDER,
    dialect_of,
    dialect_validator,
)
from onnx_moe_fuse.kernels.runtime import package_folders


def _grouped_matmul() -> dict:
    folder = next(f for f in package_folders() if f.name == "grouped_matmul")
    return json.loads((folder / "manifest.json").read_text())


def test_every_package_manifest_loads():
    names = {load_manifest(f / "manifest.json").name for f in package_folders()}
    assert "GroupedMatMul" in names


@pytest.mark.parametrize("name", [COMMON_SCHEMA, *DIALECT_SCHEMAS.values()])
def test_the_schema_files_are_draft_2020_12_schemas(name):
    schema = json.loads((SCHEMA_FOLDER / name).read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == name  # the relative $refs between the files rely on it
    Draft202012Validator.check_schema(schema)


def test_every_package_manifest_follows_its_dialects_schema():
    dialects = set()
    for folder in package_folders():
        data = json.loads((folder / "manifest.json").read_text())
        dialect = dialect_of(data)
        dialects.add(dialect)
        assert list(dialect_validator(dialect).iter_errors(data)) == [], folder.name
    assert dialects == set(DIALECT_SCHEMAS)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(colour="red"), r"colour: unknown key"),
        (lambda m: m["variants"][0].update(speed=1), r"variants\[0\]\.speed: unknown key"),
        (
            lambda m: m["variants"][1]["passes"][0]["dispatch"].update(w=1),
            r"variants\[1\]\.passes\[0\]\.dispatch\.w: unknown key \(variant 'tiled', pass 'group'\)",
        ),
        (lambda m: m["derive"].update(bad="1 +"), r"derive\.bad: '1 \+': cannot parse"),
        (
            lambda m: m["derive"].update(bad="__import__('os')"),
            r"derive\.bad: .*unknown function '__import__'",
        ),
        (lambda m: m["bindingSets"]["decode"][0].update(arg="nopeT"), r"unknown bind key 'nopeT'"),
        (
            lambda m: m["variants"][0]["passes"][0].update(bindings="nope"),
            r"unknown binding set 'nope'",
        ),
        (lambda m: m["typeConstraints"].update(T=["float33"]), r"unknown dtype 'float33'"),
        (lambda m: m["variants"][0].update(id="tiled"), r"duplicate variant id 'tiled'"),
        (
            lambda m: m["variants"][0].update(intermediates=[]),
            r"intermediate 'firstBadIndex' is not declared",
        ),
        (lambda m: m.pop("variants"), r"missing required key 'variants'"),
        (
            lambda m: m["args"].pop("biasT"),
            r"inputs\[3\]: no entry of 'args' binds this tensor \(input 'bias'\)",
        ),
    ],
)
def test_schema_errors_name_file_and_key(tmp_path, edit, message):
    manifest = copy.deepcopy(_grouped_matmul())
    edit(manifest)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=message) as info:
        load_manifest(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda m: m.update(bindings={}),
            r"^bindings: a manifest with list 'inputs' uses 'bindingSets'",
        ),
        (
            lambda m: m["variants"][1]["passes"][0].update(source={"shader": "x"}),
            r"^variants\[1\]\.passes\[0\]: a pass needs exactly one of 'shader' and 'source' "
            r"\(variant 'tiled', pass 'group'\)$",
        ),
        (
            lambda m: m["variants"][0]["passes"][0]["dispatch"].update(x="1"),
            r"^variants\[0\]\.passes\[0\]\.dispatch: expected 'threads'\+'workgroupSize' alone",
        ),
        (
            lambda m: m["bindingSets"]["decode"][6].pop("struct"),
            r"^bindingSets\.decode\[6\]: a uniform binding needs a 'struct'$",
        ),
        (
            lambda m: m["bindingSets"]["decode"][0]["buffer"].update(type="texture"),
            r"^bindingSets\.decode\[0\]\.buffer\.type: unknown buffer type 'texture'$",
        ),
        (
            lambda m: m["variants"][0].update(priority={"a": 1}),
            r"^variants\[0\]\.priority: expected an expression, got an object \(variant 'decode'\)$",
        ),
        (lambda m: m.update(sinceVersion=1.0), r"^sinceVersion: expected an integer, got 1\.0$"),
        (
            lambda m: m["indexChecks"][0].update(flag="nope"),
            r"^indexChecks\[0\]\.flag: variant 'decode' does not declare the flag intermediate",
        ),
    ],
)
def test_schema_errors_are_worded_from_the_schema(edit, message):
    manifest = copy.deepcopy(_grouped_matmul())
    edit(manifest)
    with pytest.raises(ManifestError) as info:
        parse_manifest(manifest, "gm.json")
    text = str(info.value)
    assert text.startswith("gm.json: ")
    assert re.search(message, text.removeprefix("gm.json: ")), text


def test_an_error_inside_a_repeat_group_names_both_passes():
    folder = next(f for f in package_folders() if f.name == "moe")
    manifest = json.loads((folder / "manifest.json").read_text())
    variant = next(v for v in manifest["variants"] if v["id"] == "moe_grouped")
    group = next(p for p in variant["passes"] if "repeat" in p)
    group["passes"][0]["foo"] = 1
    names = r"\(variant 'moe_grouped', pass 'token_chunks', pass 'group_stage'\)"
    with pytest.raises(
        ManifestError, match=r"\.passes\[1\]\.passes\[0\]\.foo: unknown key " + names
    ):
        parse_manifest(manifest)


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text('{\n "name": "X",\n oops\n}')
    with pytest.raises(ManifestError, match=r"invalid JSON at line 3"):
        load_manifest(path)


def _tiny_binding_map() -> dict:
    return copy.deepcopy(
        {
            "name": "Tiny",
            "inputs": {"xT": {"dtype": "T"}},
            "outputs": {"yT": {"dtype": "T", "shape": "shapes.xT"}},
            "typeConstraints": {"T": ["float32"]},
            "derive": {"scalar": '"f32"', "n": "numel(shapes.xT)"},
            "when": ["n > 0"],
            "bindings": {
                "x": {
                    "arg": "xT",
                    "buffer": "read-only-storage",
                    "elementType": "$scalar",
                    "length": "$n",
                },
                "y": {"arg": "yT", "buffer": "storage", "elementType": "f32"},
                "params": {
                    "buffer": "uniform",
                    "struct": [{"name": "n", "type": "u32", "value": "n"}],
                },
            },
            "variants": [
                {
                    "id": "only",
                    "passes": [
                        {
                            "id": "p",
                            "shader": "x.wgsl.jinja",
                            "bindings": ["x", "y", "params"],
                            "dispatch": {"x": "n"},
                        }
                    ],
                }
            ],
        }
    )


def test_binding_map_dialect_loads_with_references():
    manifest = parse_manifest(_tiny_binding_map())
    assert manifest.dialect == "binding-map"
    binding = manifest.variants[0].passes[0].bindings[0]
    assert binding.element_type == "$scalar" and binding.length == "n"
    assert manifest.when == ("n > 0",)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(args={}), r"args: a manifest with map 'inputs' uses 'bindings'"),
        (
            lambda m: m["variants"][0]["passes"][0].update(bindings="x"),
            r"passes\[0\]\.bindings: expected a list of binding names, got 'x'",
        ),
        (
            lambda m: m["variants"][0]["passes"][0].update(bindings=["x", "z"]),
            r"passes\[0\]\.bindings\[1\]: unknown binding 'z'",
        ),
        (
            lambda m: m["outputs"].update(xT={"dtype": "T", "shape": "[1]"}),
            r"outputs\.xT: bind key",
        ),
        (lambda m: m["bindings"]["params"].pop("struct"), r"a uniform binding needs a 'struct'"),
    ],
)
def test_binding_map_errors(edit, message):
    manifest = _tiny_binding_map()
    edit(manifest)
    with pytest.raises(ManifestError, match=message):
        parse_manifest(manifest)
