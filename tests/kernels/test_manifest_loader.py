"""The strict manifest loader: both dialects load; schema errors name file and key path."""

from __future__ import annotations

import copy
import json

import pytest

from onnx_moe_fuse.kernels.manifest import ManifestError, load_manifest, parse_manifest
from onnx_moe_fuse.kernels.runtime import package_folders


def _grouped_matmul() -> dict:
    folder = next(f for f in package_folders() if f.name == "grouped_matmul")
    return json.loads((folder / "manifest.json").read_text())


def test_every_package_manifest_loads():
    names = {load_manifest(f / "manifest.json").name for f in package_folders()}
    assert "GroupedMatMul" in names


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(colour="red"), r"colour: unknown key"),
        (lambda m: m["variants"][0].update(speed=1), r"variants\[0\]\.speed: unknown key"),
        (
            lambda m: m["variants"][1]["passes"][0]["dispatch"].update(w=1),
            r"variants\.tiled\.passes\.group\.dispatch\.w: unknown key",
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
        (lambda m: m["args"].pop("biasT"), r"inputs\.bias: no entry of 'args' binds"),
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


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text('{\n "name": "X",\n oops\n}')
    with pytest.raises(ManifestError, match=r"invalid JSON at line 3"):
        load_manifest(path)


def test_binding_map_dialect_loads_with_references():
    manifest = parse_manifest(
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
    assert manifest.dialect == "binding-map"
    binding = manifest.variants[0].passes[0].bindings[0]
    assert binding.element_type == "$scalar" and binding.length == "n"
    assert manifest.when == ("n > 0",)
