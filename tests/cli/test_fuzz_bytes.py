"""Fuzzing the bytes of a model and of its external data: never a traceback, nothing lost.

The model is a small sample saved with its tensors in ``m.onnx.data``, so ``m.onnx`` holds the
graph alone and almost every change to its bytes hits structure (names, attributes, types,
opsets, external data entries) rather than weights. Cases: bytes flipped, inserted, deleted or
cut; random bytes; the data file cut, padded, moved or renamed; offsets and lengths rewritten.
Properties (:func:`cli_cases.check_properties`): exit 0 or 2, one line on refusal, the input
folder byte-identical, nothing written on refusal, a written model that loads and validates.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import onnx
from cli_cases import SMALL, case_folders, check_properties, fuzz_settings, save_sample
from hypothesis import event, given
from hypothesis import strategies as st


@functools.cache
def _original() -> tuple[bytes, bytes]:
    """``(m.onnx bytes, m.onnx.data bytes)`` of the small sample with external data."""
    folder = Path(__import__("tempfile").mkdtemp(prefix="fuzz-src-"))
    try:
        path = save_sample(folder, SMALL, file_name="m.onnx", external=True)
        return path.read_bytes(), (folder / "m.onnx.data").read_bytes()
    finally:
        shutil.rmtree(folder)


@st.composite
def _corrupted(draw) -> bytes:
    data = bytearray(_original()[0])
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "cut", "random"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif kind == "cut":
            del data[at:]
        else:
            data = bytearray(draw(st.binary(max_size=64)))
    return bytes(data)


def _run(inputs: Path, outputs: Path, model: bytes, data: bytes | None) -> int:
    (inputs / "m.onnx").write_bytes(model)
    if data is not None:
        (inputs / "m.onnx.data").write_bytes(data)
    argv = [inputs / "m.onnx", "-o", outputs / "o.onnx", "--report", outputs / "r.json"]
    code = check_properties([str(a) for a in argv], inputs, outputs)[0]
    event(f"exit {code}")
    return code


@fuzz_settings(260)
@given(model=_corrupted())
def test_corrupt_model_bytes(model):
    with case_folders() as (inputs, outputs):
        _run(inputs, outputs, model, _original()[1])


@st.composite
def _damaged_data(draw) -> bytes | None:
    data = bytearray(_original()[1])
    kind = draw(st.sampled_from(["cut", "pad", "gone", "flip", "empty"]))
    if kind == "cut":
        del data[draw(st.integers(0, len(data) - 1)) :]
    elif kind == "pad":
        data += draw(st.binary(min_size=1, max_size=64))
    elif kind == "gone":
        return None
    elif kind == "flip":
        data[draw(st.integers(0, len(data) - 1))] ^= 0xFF
    else:
        data = bytearray()
    return bytes(data)


@fuzz_settings(40)
@given(data=_damaged_data())
def test_truncated_or_damaged_external_data(data):
    with case_folders() as (inputs, outputs):
        _run(inputs, outputs, _original()[0], data)


_LOCATIONS = st.sampled_from(
    [
        "../m.onnx.data",
        "/etc/passwd",
        "sub/../../m.onnx.data",
        "",
        "nope.data",
        ".",
        "m.onnx",
        "m.onnx.data\x00x",
        "C:\\m.onnx.data",
        "//m.onnx.data",
        "m.onnx.data/",
    ]
)


@st.composite
def _relocated(draw) -> bytes:
    model = onnx.load_model_from_string(_original()[0])
    tensors = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    tensor = tensors[draw(st.integers(0, len(tensors) - 1))]
    entries = {e.key: e for e in tensor.external_data}
    key = draw(st.sampled_from(["location", "offset", "length", "extra"]))
    if key == "location":
        entries["location"].value = draw(_LOCATIONS)
    elif key == "extra":
        tensor.external_data.add(key=draw(st.text(max_size=8)), value=draw(st.text(max_size=8)))
    else:
        value = draw(st.one_of(st.integers(-(2**40), 2**40).map(str), st.text(max_size=6)))
        if key in entries:
            entries[key].value = value
        else:
            tensor.external_data.add(key=key, value=value)
    return model.SerializeToString()


@fuzz_settings(40)
@given(model=_relocated())
def test_relocated_external_data(model):
    with case_folders() as (inputs, outputs):
        (inputs / "sub").mkdir()
        _run(inputs, outputs, model, _original()[1])
