"""Tests of model loading and atomic saving (``onnx_moe_fuse.io.model_io``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir
import pytest
from onnx import helper, numpy_helper

from onnx_moe_fuse.io import model_io
from onnx_moe_fuse.io.model_io import (
    InputOverwriteError,
    ModelLoadError,
    data_file_for,
    load_model,
    save_model_atomic,
    uses_external_data,
)


def _model(rng: np.random.Generator) -> onnx.ModelProto:
    """``y = x @ w + b``: one large initializer (external when saved so) and one small one."""
    w = rng.standard_normal((64, 32)).astype(np.float32)  # 8 KiB
    b = rng.standard_normal(32).astype(np.float32)  # 128 B: stays inline
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["T", 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["T", 32])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _save_external(model: onnx.ModelProto, path: Path, location: str | None = None) -> None:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(
        copy,
        path,
        save_as_external_data=True,
        location=location or f"{path.name}.data",
        size_threshold=1024,
    )


def _arrays(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_external_data_round_trip(tmp_path: Path, rng) -> None:
    original = _model(rng)
    src = tmp_path / "in.onnx"
    _save_external(original, src)
    assert uses_external_data(src)

    loaded = load_model(src)
    assert not uses_external_data(loaded)
    for name, arr in _arrays(original).items():
        np.testing.assert_array_equal(_arrays(loaded)[name], arr)

    out = tmp_path / "out.onnx"
    written = save_model_atomic(loaded, out, input_path=src)
    assert written == [tmp_path / "out.onnx.data", out] and data_file_for(out) == written[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in.onnx",
        "in.onnx.data",
        "out.onnx",
        "out.onnx.data",
    ]
    header = onnx.load_model(str(out), load_external_data=False)
    w = next(t for t in header.graph.initializer if t.name == "w")
    assert w.data_location == onnx.TensorProto.EXTERNAL
    assert {e.key: e.value for e in w.external_data}["location"] == "out.onnx.data"
    again = load_model(out)
    for name, arr in _arrays(original).items():
        np.testing.assert_array_equal(_arrays(again)[name], arr)
    assert not uses_external_data(loaded), "saving must not rewrite the caller's model"
    # The output no longer depends on the input's data file.
    (tmp_path / "in.onnx.data").unlink()
    np.testing.assert_array_equal(_arrays(load_model(out))["w"], _arrays(original)["w"])


def test_single_file_unless_input_used_external_data(tmp_path: Path, rng) -> None:
    model = _model(rng)
    src = tmp_path / "in.onnx"
    onnx.save_model(model, src)
    written = save_model_atomic(model, tmp_path / "out.onnx", input_path=src)
    assert written == [tmp_path / "out.onnx"] and not data_file_for(written[0]).exists()
    assert load_model(written[0]).SerializeToString() == model.SerializeToString()
    forced = save_model_atomic(model, tmp_path / "ext.onnx", external_data=True)
    assert forced == [tmp_path / "ext.onnx.data", tmp_path / "ext.onnx"]


def test_onnx_ir_model_is_loaded_without_being_changed(tmp_path: Path, rng) -> None:
    original = _model(rng)
    src = tmp_path / "in.onnx"
    _save_external(original, src)
    ir_model = onnx_ir.load(src)
    assert isinstance(ir_model.graph.initializers["w"].const_value, onnx_ir.ExternalTensor)
    proto = load_model(ir_model)
    np.testing.assert_array_equal(_arrays(proto)["w"], _arrays(original)["w"])
    assert not uses_external_data(proto)
    assert isinstance(ir_model.graph.initializers["w"].const_value, onnx_ir.ExternalTensor)
    written = save_model_atomic(ir_model, tmp_path / "out.onnx", input_path=src)
    assert written[-1] == tmp_path / "out.onnx" and len(written) == 2


def test_refuses_to_overwrite_the_input(tmp_path: Path, rng) -> None:
    model = _model(rng)
    src = tmp_path / "in.onnx"
    _save_external(model, src, location="shared.data")
    before = _listing(tmp_path)
    (tmp_path / "sub").mkdir()
    os.symlink(src, tmp_path / "link.onnx")
    os.link(src, tmp_path / "hard.onnx")
    for target in (src, tmp_path / "sub" / ".." / "in.onnx", tmp_path / "link.onnx"):
        with pytest.raises(InputOverwriteError, match="input model"):
            save_model_atomic(model, target, input_path=src)
    with pytest.raises(InputOverwriteError, match="input model"):
        save_model_atomic(model, tmp_path / "hard.onnx", input_path=src)
    # Writing over a data file the input reads is refused too ("shared" -> "shared.data").
    with pytest.raises(InputOverwriteError, match="external data of the input"):
        save_model_atomic(model, tmp_path / "shared", input_path=src)
    os.unlink(tmp_path / "link.onnx")
    os.unlink(tmp_path / "hard.onnx")
    (tmp_path / "sub").rmdir()
    assert _listing(tmp_path) == before


def test_no_files_left_when_writing_fails(tmp_path: Path, rng, monkeypatch) -> None:
    model = _model(rng)
    real_save = onnx.save_model

    def broken_save(proto, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(model_io.onnx, "save_model", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_model_atomic(model, tmp_path / "out.onnx", external_data=True)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(model_io.onnx, "save_model", real_save)

    # An earlier output stays as it was when the final move of the model file fails.
    save_model_atomic(model, tmp_path / "out.onnx", external_data=True)
    before = _listing(tmp_path)
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst).name == "out.onnx":
            raise OSError("cannot rename")
        return real_replace(src, dst)

    monkeypatch.setattr(model_io.os, "replace", failing_replace)
    changed = _model(np.random.default_rng(1))
    with pytest.raises(OSError, match="cannot rename"):
        save_model_atomic(changed, tmp_path / "out.onnx", external_data=True)
    monkeypatch.setattr(model_io.os, "replace", real_replace)
    assert _listing(tmp_path) == before


def test_load_errors_name_the_file(tmp_path: Path, rng) -> None:
    missing = tmp_path / "nope.onnx"
    with pytest.raises(FileNotFoundError, match=r"model file not found: .*nope\.onnx"):
        load_model(missing)
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\xff\xfe this is not a protobuf \x00\x01" * 10)
    with pytest.raises(ModelLoadError, match=r"corrupt\.onnx is not a valid ONNX model"):
        load_model(corrupt)
    with pytest.raises(ModelLoadError, match="is a folder"):
        load_model(tmp_path)

    src = tmp_path / "m.onnx"
    _save_external(_model(rng), src)
    data = tmp_path / "m.onnx.data"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match=r"m\.onnx\.data"):
        load_model(src)
    data.unlink()
    with pytest.raises(ModelLoadError, match=r"m\.onnx\.data.*does not exist"):
        load_model(src)


def test_unloaded_proto_needs_its_folder(tmp_path: Path, rng) -> None:
    src = tmp_path / "m.onnx"
    _save_external(_model(rng), src)
    header = onnx.load_model(str(src), load_external_data=False)
    with pytest.raises(ModelLoadError, match="base_dir"):
        load_model(header)
    full = load_model(header, base_dir=tmp_path)
    assert not uses_external_data(full) and uses_external_data(header)
    # save_model_atomic reads it from next to input_path.
    written = save_model_atomic(header, tmp_path / "out.onnx", input_path=src)
    assert [p.name for p in written] == ["out.onnx.data", "out.onnx"]


def test_errors_are_typed_and_keep_their_old_names(tmp_path: Path, rng) -> None:
    from onnx_moe_fuse import errors

    assert model_io.ModelLoadError is errors.ModelLoadError
    assert model_io.InputOverwriteError is errors.InputOverwriteError
    assert issubclass(errors.InputOverwriteError, (OSError, ValueError, errors.MoEFuseError))
    assert issubclass(errors.ModelNotFoundError, FileNotFoundError)
    src = tmp_path / "m.onnx"
    onnx.save_model(_model(rng), src)
    with pytest.raises(errors.OutputPathError, match="does not exist"):
        save_model_atomic(_model(rng), tmp_path / "nope" / "o.onnx")
    with pytest.raises(errors.OutputPathError, match="is a folder"):
        save_model_atomic(_model(rng), tmp_path)
    assert list(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_external_data_is_found_as_ort_finds_it(tmp_path: Path, rng) -> None:
    original = _model(rng)
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "r1"
    blobs.mkdir()
    snap.mkdir(parents=True)
    _save_external(original, blobs / "model.onnx", location="model.onnx.data")
    os.rename(blobs / "model.onnx", blobs / "aa")
    os.rename(blobs / "model.onnx.data", blobs / "bb")
    os.symlink("../../blobs/aa", snap / "model.onnx")
    os.symlink("../../blobs/bb", snap / "model.onnx.data")
    loaded = load_model(snap / "model.onnx")  # onnx.load refuses these links
    np.testing.assert_array_equal(_arrays(loaded)["w"], _arrays(original)["w"])
    assert model_io.external_data_files(snap / "model.onnx") == [blobs / "bb"]
    header = model_io.check_model_file(snap / "model.onnx")
    assert uses_external_data(header)

    # A link inside the folder that leads out of it is refused, naming tensor and location.
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = tmp_path / "model"
    folder.mkdir()
    _save_external(original, folder / "m.onnx", location="m.data")
    os.rename(folder / "m.data", outside / "m.data")
    os.symlink(outside / "m.data", folder / "m.data")
    with pytest.raises(model_io.ExternalDataError, match=r"tensor 'w'.*'m\.data'.*outside"):
        load_model(folder / "m.onnx")


def test_sizes_are_checked_before_reading(tmp_path: Path, rng) -> None:
    src = tmp_path / "m.onnx"
    _save_external(_model(rng), src)
    header = onnx.load_model(str(src), load_external_data=False)
    w = next(t for t in header.graph.initializer if t.name == "w")
    w.dims[0] = 10**12  # absurd: the file holds 8 KiB
    for entry in w.external_data:
        if entry.key == "length":
            w.external_data.remove(entry)
            break
    src.write_bytes(header.SerializeToString())
    with pytest.raises(model_io.ExternalDataError, match=r"tensor 'w'.*file holds 8192 bytes"):
        load_model(src)


def test_written_files_get_the_umask_mode(tmp_path: Path, rng) -> None:
    old = os.umask(0o027)
    try:
        written = save_model_atomic(_model(rng), tmp_path / "o.onnx", external_data=True)
    finally:
        os.umask(old)
    assert [os.stat(p).st_mode & 0o777 for p in written] == [0o640, 0o640]
