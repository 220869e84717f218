"""Bad input models are refused with one line (exit 2); odd but valid layouts load as ORT loads.

Re-creates the input failures of issue 9: a model whose truncation dropped ``opset_import``
(fused with an invented opset), an invalid attribute on a DequantizeLinear (fused without
``--verify``), a corrupt file (a bare protobuf ``DecodeError`` from the API), external data
outside the model's folder (a raw onnx ``ValidationError`` traceback), the Hugging Face cache
layout (data not found, though ORT loads it), and ``--verify`` of a 1e8-row input (a 48 GB
allocation).
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from cli_cases import SMALL, SMALL_FLOAT, assert_refused, run_cli, save_sample
from google.protobuf.message import DecodeError
from onnx import helper

from onnx_moe_fuse import fuse
from onnx_moe_fuse.errors import (
    ExternalDataError,
    ModelLoadError,
    ModelValidationError,
    MoEFuseError,
)
from onnx_moe_fuse.samples import get_sample


def _altered(tmp_path: Path, change, name: str = SMALL) -> Path:
    model = onnx.ModelProto()
    model.CopyFrom(get_sample(name).model)
    change(model)
    path = tmp_path / "in.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def _first(model: onnx.ModelProto, op_type: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == op_type)


def test_a_model_without_opset_imports_is_refused(tmp_path):
    src = _altered(tmp_path, lambda m: m.ClearField("opset_import"))
    assert_refused([src, "-o", tmp_path / "o.onnx"], tmp_path, "in.onnx", "opset")
    with pytest.raises(ModelValidationError, match="imports no opset"):
        fuse(src)


@pytest.mark.parametrize(
    ("attribute", "words"),
    [
        (helper.make_attribute("bogus", 3), ["'bogus'", "DequantizeLinear", "axis, block_size"]),
        (helper.make_attribute("axis", 1.5), ["'axis'", "FLOAT", "INT"]),
    ],
    ids=["unknown", "wrong-type"],
)
def test_an_invalid_attribute_of_a_standard_op_is_refused(tmp_path, attribute, words):
    def change(model):
        node = _first(model, "DequantizeLinear")
        kept = [a for a in node.attribute if a.name != attribute.name]
        del node.attribute[:]
        node.attribute.extend([*kept, attribute])

    src = _altered(tmp_path, change)
    assert_refused([src, "-o", tmp_path / "o.onnx"], tmp_path, "in.onnx", *words)
    with pytest.raises(ModelValidationError):
        fuse(onnx.load(src))


def test_the_checker_reason_is_given(tmp_path):
    src = _altered(tmp_path, lambda m: m.graph.node[0].input.append("no_such_value"))
    assert_refused([src, "-o", tmp_path / "o.onnx"], tmp_path, "checker")


def test_a_corrupt_file_raises_our_error_not_protobufs(tmp_path):
    good = save_sample(tmp_path, SMALL).read_bytes()
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(good[: len(good) // 3] + b"\xff\xff\xff\xff" + good[len(good) // 3 :])
    assert_refused([bad, "-o", tmp_path / "o.onnx"], tmp_path, "bad.onnx")
    with pytest.raises(ModelLoadError) as caught:
        fuse(bad)
    assert not isinstance(caught.value, DecodeError) and isinstance(caught.value, ValueError)


def _hf_layout(tmp_path: Path) -> Path:
    """``snapshots/<rev>/model.onnx`` and its data, both links into ``../../blobs/``."""
    root = tmp_path / "models--org--m"
    snap, blobs = root / "snapshots" / "abc123", root / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    save_sample(
        blobs, SMALL_FLOAT, file_name="model.onnx", external=True, location="model.onnx.data"
    )
    os.rename(blobs / "model.onnx", blobs / "9f1e")
    os.rename(blobs / "model.onnx.data", blobs / "c0de")
    os.symlink("../../blobs/9f1e", snap / "model.onnx")
    os.symlink("../../blobs/c0de", snap / "model.onnx.data")
    return snap / "model.onnx"


def test_the_hugging_face_cache_layout_loads_as_in_ort(tmp_path):
    model = _hf_layout(tmp_path)
    ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])  # ORT loads it
    code, _, err = run_cli([model, "-o", tmp_path / "out.onnx"])
    assert code == 0, err
    fused = onnx.load(tmp_path / "out.onnx")
    assert [n.op_type for n in fused.graph.node if n.domain == "com.microsoft"] == ["MoE"]
    assert fuse(model).fused


def test_a_link_inside_the_model_folder_is_followed(tmp_path):
    src = save_sample(
        tmp_path, SMALL_FLOAT, file_name="m.onnx", external=True, location="link.data"
    )
    os.rename(tmp_path / "link.data", tmp_path / "real.data")
    os.symlink("real.data", tmp_path / "link.data")
    code, _, err = run_cli([src, "-o", tmp_path / "out.onnx"])
    assert code == 0, err


def _relocated(tmp_path: Path, how: str) -> Path:
    """A model whose data file lies outside its folder, reached in the way ``how`` names."""
    folder, outside = tmp_path / "model", tmp_path / "elsewhere"
    folder.mkdir()
    outside.mkdir()
    src = save_sample(
        folder, SMALL_FLOAT, file_name="m.onnx", external=True, location="m.onnx.data"
    )
    os.rename(folder / "m.onnx.data", outside / "m.onnx.data")
    model = onnx.load(src, load_external_data=False)
    location = {
        "absolute": str(outside / "m.onnx.data"),
        "dotdot": "../elsewhere/m.onnx.data",
        "symlink": "m.onnx.data",
    }[how]
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    src.write_bytes(model.SerializeToString())
    if how == "symlink":
        os.symlink(outside / "m.onnx.data", folder / "m.onnx.data")
    return src


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_data_outside_the_model_folder_is_refused(tmp_path, how):
    src = _relocated(tmp_path, how)
    err = assert_refused([src, "-o", tmp_path / "o.onnx"], tmp_path, "tensor 'router_weight'")
    assert "m.onnx.data" in err
    with pytest.raises(ExternalDataError) as caught:
        fuse(src)
    assert caught.value.tensor == "router_weight"


@pytest.mark.parametrize("cut", [0, 100, -4])
def test_missing_or_truncated_data_is_refused(tmp_path, cut):
    src = save_sample(tmp_path, SMALL_FLOAT, file_name="m.onnx", external=True)
    data = tmp_path / "m.onnx.data"
    if cut == 0:
        data.unlink()
    else:
        data.write_bytes(data.read_bytes()[:cut])
    assert_refused([src, "-o", tmp_path / "o.onnx"], tmp_path, "m.onnx.data", "tensor")


def test_absurd_dims_are_refused_without_allocating(tmp_path):
    def change(model):
        model.graph.initializer[0].dims[0] = 10**15

    src = _altered(tmp_path, change, SMALL_FLOAT)
    assert_refused([src, "-o", tmp_path / "o.onnx"], tmp_path, "router_weight")


def test_verifying_a_huge_input_is_refused_not_allocated(tmp_path, device):
    def change(model):
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 10**8

    src = _altered(tmp_path, change)
    err = assert_refused([src, "-o", tmp_path / "o.onnx", "--verify"], tmp_path, "x")
    assert "GB" in err


def test_api_errors_are_one_hierarchy(tmp_path):
    with pytest.raises(MoEFuseError) as missing:
        fuse(tmp_path / "nope.onnx")
    assert isinstance(missing.value, FileNotFoundError)
    with pytest.raises(MoEFuseError, match="target"):
        fuse(get_sample(SMALL).model, target="tpu")
    with pytest.raises(MoEFuseError, match="only"):
        fuse(get_sample(SMALL).model, only={"Bogus"})


def test_text_that_is_not_utf8_is_refused(tmp_path):
    """Found by the fuzzer: protobuf hands such a field over as bytes, and the rules crashed."""
    model = onnx.ModelProto()
    model.CopyFrom(get_sample(SMALL).model)
    model.producer_name = "onnx_moe_fuse.samples"
    data = bytearray(model.SerializeToString())
    data[data.find(b"onnx_moe_fuse.samples")] = 0xEF
    src = tmp_path / "in.onnx"
    src.write_bytes(bytes(data))
    assert_refused([src, "-o", tmp_path / "o.onnx"], tmp_path, "producer_name", "UTF-8")
