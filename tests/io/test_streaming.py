"""Streaming fusion: weights stay on disk, the output equals the in-memory path's, memory is flat.

* the scratch-file weight sink returns tensors byte-identical to the in-memory sink's, and its
  file is gone after use, also after an error;
* a stacked multi-layer model fused through the command line's streaming path
  (:func:`onnx_moe_fuse.streaming_io.fuse_file`) equals the in-memory fuse (``fuse`` +
  ``save_model_atomic``) node by node and tensor by tensor, and both run alike in ONNX Runtime
  on random inputs;
* no scratch or temporary file is left, after success or an injected error, and a data file
  already in place is restored when the save fails late;
* a subprocess fuse of a 4-layer model peaks at about the memory of the 1-layer one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnx_moe_fuse import streaming_io
from onnx_moe_fuse.api import fuse
from onnx_moe_fuse.cli import main as cli_main
from onnx_moe_fuse.io import sink_save
from onnx_moe_fuse.io.model_io import ModelLoadError, load_model, save_model_atomic
from onnx_moe_fuse.io.weight_sink import ScratchFileSink, in_memory
from onnx_moe_fuse.samples.stacked import stacked_moe_model

#: Small layers for the equality tests (fast), larger ones for the memory test (a layer's data
#: must stand well above the noise of a process's peak memory: ~4 MB a layer).
SMALL = {"hidden": 64, "inter": 32, "experts": 4}
MEMORY = {"hidden": 512, "inter": 256, "experts": 16}


def _save_external(model: onnx.ModelProto, folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    onnx.save(model, path, save_as_external_data=True, location=name + ".data", size_threshold=0)
    return path


@pytest.fixture(scope="module")
def stacked(tmp_path_factory) -> Path:
    """A 3-layer int4 model with external data, in a folder of its own."""
    folder = tmp_path_factory.mktemp("stacked")
    return _save_external(stacked_moe_model(3, **SMALL, seed_key="streaming"), folder, "m.onnx")


# -- the sink ------------------------------------------------------------------------------


def _arrays(rng: np.random.Generator) -> list[np.ndarray]:
    return [
        rng.integers(0, 256, size=(3, 5, 7), dtype=np.uint8),
        rng.standard_normal((4, 9)).astype(np.float32),
        rng.standard_normal((2, 3, 6)).astype(np.float16),
        rng.integers(-(2**40), 2**40, size=(11,), dtype=np.int64),
        np.asfortranarray(rng.standard_normal((5, 3)).astype(np.float32)),  # not C-contiguous
        rng.standard_normal((1,)).astype(np.float32),
    ]


def test_spilled_tensors_equal_in_memory_ones_byte_for_byte(tmp_path, rng):
    arrays = _arrays(rng)
    with ScratchFileSink(tmp_path) as sink:
        spilled = [sink(a, f"t{i}") for i, a in enumerate(arrays)]
        assert sink.path.parent == tmp_path.resolve() and sink.path.stat().st_size > 0
        for i, (array, tensor) in enumerate(zip(arrays, spilled, strict=True)):
            kept = in_memory(array, f"t{i}")
            assert isinstance(tensor, ir.ExternalTensor) and tensor.offset % 64 == 0
            assert tensor.name == kept.name == f"t{i}"
            assert tensor.dtype == kept.dtype and tensor.shape == kept.shape
            assert tensor.tobytes() == kept.tobytes() == np.ascontiguousarray(array).tobytes()
            np.testing.assert_array_equal(tensor.numpy(), array)
            tensor.release()
        scratch = sink.path
    assert not scratch.exists()


def test_scratch_file_is_removed_after_an_error(tmp_path, rng):
    with pytest.raises(RuntimeError, match="injected"):
        with ScratchFileSink(tmp_path) as sink:
            sink(rng.standard_normal((8, 8)).astype(np.float32), "w")
            raise RuntimeError("injected")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="closed"):
        sink(np.zeros(1, np.float32), "late")


# -- streamed output equals the in-memory path's --------------------------------------------


def _tensors(model: onnx.ModelProto) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    out = {}
    for t in model.graph.initializer:
        array = numpy_helper.to_array(t)
        out[t.name] = (str(array.dtype), array.shape, np.ascontiguousarray(array).tobytes())
    return out


def _nodes(model: onnx.ModelProto) -> list[tuple]:
    return [
        (n.op_type, n.domain, n.name, tuple(n.input), tuple(n.output),
         tuple(a.SerializeToString() for a in n.attribute))
        for n in model.graph.node
    ]  # fmt: skip


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_streaming_cli_output_equals_the_in_memory_fuse(stacked, tmp_path, rng, capsys):
    streamed = tmp_path / "streamed.onnx"
    assert cli_main([str(stacked), "-o", str(streamed)]) == 0
    assert "wrote" in capsys.readouterr().out
    reference = tmp_path / "memory.onnx"
    result = fuse(load_model(stacked))
    save_model_atomic(result.model, reference, input_path=stacked)
    assert [f["op"] for f in result.report.fusions] == ["QMoE"] * 3

    got, want = onnx.load(streamed), onnx.load(reference)  # with their data files
    assert _nodes(got) == _nodes(want)
    assert _tensors(got) == _tensors(want)
    assert [i.name for i in got.graph.input] == [i.name for i in want.graph.input]
    assert [o.name for o in got.graph.output] == [o.name for o in want.graph.output]
    assert {(o.domain, o.version) for o in got.opset_import} == {
        (o.domain, o.version) for o in want.opset_import
    }
    x = rng.standard_normal((5, SMALL["hidden"])).astype(np.float32)
    np.testing.assert_array_equal(_run(streamed, x), _run(reference, x))
    original = _run(stacked, x)
    np.testing.assert_allclose(_run(streamed, x), original, rtol=1e-4, atol=1e-4)


def test_nothing_to_fuse_streams_the_model_through_unchanged(stacked, tmp_path):
    out = tmp_path / "same.onnx"
    done = streaming_io.fuse_file(stacked, out, only={"MatMulNBitsQkv"})
    assert not done.fused and done.written == [tmp_path / "same.onnx.data", out]
    got, want = onnx.load(out), onnx.load(stacked)
    assert _nodes(got) == _nodes(want) and _tensors(got) == _tensors(want)


def test_embedded_data_input_is_saved_as_one_file(tmp_path):
    model = stacked_moe_model(1, **SMALL, seed_key="embedded")
    src = tmp_path / "embedded.onnx"
    onnx.save(model, src)
    out = tmp_path / "out.onnx"
    done = streaming_io.fuse_file(src, out)
    assert done.fused and done.written == [out]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["embedded.onnx", "out.onnx"]
    want = fuse(load_model(src)).model
    assert _tensors(onnx.load(out)) == _tensors(want)


# -- nothing left behind ----------------------------------------------------------------------


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _copy_input(stacked: Path, folder: Path) -> Path:
    folder.mkdir()
    for p in (stacked, stacked.with_name(stacked.name + ".data")):
        (folder / p.name).write_bytes(p.read_bytes())
    return folder / stacked.name


def test_no_scratch_or_temporary_file_is_left(stacked, tmp_path):
    src = _copy_input(stacked, tmp_path / "work")
    streaming_io.fuse_file(src, src.with_name("out.onnx"))
    assert _names(src.parent) == ["m.onnx", "m.onnx.data", "out.onnx", "out.onnx.data"]


def test_an_error_while_fusing_leaves_nothing(stacked, tmp_path, monkeypatch):
    src = _copy_input(stacked, tmp_path / "work")
    real = streaming_io.fusion_pipeline

    def failing(report, only, weight_sink=None, **target):
        def run(model):
            real(report, only, weight_sink=weight_sink, **target)(model)
            assert weight_sink is not None and weight_sink.tensors_written > 0
            raise RuntimeError("injected after fusing")

        return run

    monkeypatch.setattr(streaming_io, "fusion_pipeline", failing)
    with pytest.raises(RuntimeError, match="injected"):
        streaming_io.fuse_file(src, src.with_name("out.onnx"))
    assert _names(src.parent) == ["m.onnx", "m.onnx.data"]


def test_an_error_while_saving_leaves_nothing(stacked, tmp_path, monkeypatch):
    src = _copy_input(stacked, tmp_path / "work")

    def failing_save(model, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device (injected)")

    # the model file is written last, after the scratch file became the data file
    monkeypatch.setattr(sink_save.onnx, "save_model", failing_save)
    with pytest.raises(OSError, match="injected"):
        streaming_io.fuse_file(src, src.with_name("out.onnx"))
    assert _names(src.parent) == ["m.onnx", "m.onnx.data"]


def test_a_late_failure_restores_the_previous_data_file(stacked, tmp_path, monkeypatch):
    src = _copy_input(stacked, tmp_path / "work")
    out = src.with_name("out.onnx")
    out.write_bytes(b"old model")
    out.with_name("out.onnx.data").write_bytes(b"old data")
    real_replace = os.replace

    def replace(a, b, **kwargs):
        if Path(b) == out:
            raise OSError(5, "I/O error (injected)")
        return real_replace(a, b, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="injected"):
        streaming_io.fuse_file(src, out)
    assert out.read_bytes() == b"old model"
    assert out.with_name("out.onnx.data").read_bytes() == b"old data"
    assert _names(src.parent) == ["m.onnx", "m.onnx.data", "out.onnx", "out.onnx.data"]


def test_refusals_come_before_any_work(stacked, tmp_path, capsys):
    data = stacked.with_name(stacked.name + ".data")
    with pytest.raises(ModelLoadError):
        streaming_io.fuse_file(data, tmp_path / "o.onnx")  # not a model
    assert cli_main([str(stacked), "-o", str(stacked)]) == 2
    assert cli_main([str(stacked), "-o", str(tmp_path / "missing" / "o.onnx")]) == 2
    short = _copy_input(stacked, tmp_path / "short")
    with open(short.with_name("m.onnx.data"), "r+b") as f:
        f.truncate(100)
    assert cli_main([str(short), "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert "it is the input model" in err and "truncated" in err
    assert len(err.splitlines()) == 3 and "Traceback" not in err
    assert _names(tmp_path) == ["short"]  # no output, no scratch file, no temporary folder


def test_data_outside_the_model_folder_is_refused_up_front(stacked, tmp_path, capsys):
    inside, outside = tmp_path / "model", tmp_path / "blobs"
    src = _copy_input(stacked, outside)
    inside.mkdir()
    (inside / "m.onnx").write_bytes(src.read_bytes())
    (inside / "m.onnx.data").symlink_to(outside / "m.onnx.data")
    assert cli_main([str(inside / "m.onnx"), "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert "outside the model's folder" in err and "Traceback" not in err
    assert _names(tmp_path) == ["blobs", "model"]


def test_a_hugging_face_cache_layout_streams(stacked, tmp_path):
    """Model and data linked into ``blobs/``: the data lies beside the resolved model (ORT)."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    _copy_input(stacked, blobs)
    snapshot.mkdir(parents=True)
    for name in ("m.onnx", "m.onnx.data"):
        (snapshot / name).symlink_to(blobs / name)
    done = streaming_io.fuse_file(snapshot / "m.onnx", tmp_path / "o.onnx")
    assert len(done.report.fusions) == 3
    want = fuse(load_model(blobs / "m.onnx")).model
    assert _tensors(onnx.load(tmp_path / "o.onnx")) == _tensors(want)


# -- memory ------------------------------------------------------------------------------------


#: Run argv[1:] and print its peak RSS (KiB). A small wrapper process forks the command: a child
#: forked straight from the test process would count the test process's pages as its own.
_PEAK_OF = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)
"""


def _peak_mib(argv: list[str]) -> float:
    """The peak resident memory of one child process running ``argv`` (MiB)."""
    proc = subprocess.run([sys.executable, "-c", _PEAK_OF, *argv], capture_output=True, text=True)
    peak_kib, code = proc.stdout.split()
    assert code == "0", proc.stderr
    return int(peak_kib) / 1024


@pytest.mark.parametrize("weights", ["int4b32", "f32"])
def test_peak_memory_does_not_grow_with_the_layers(weights, tmp_path):
    """int4 layers and float layers (MoE: the weights moved expert by expert, issue 19)."""
    data_mib = {}
    peaks = {}
    for n in (1, 4):
        model = stacked_moe_model(n, **MEMORY, weights=weights)
        src = _save_external(model, tmp_path, f"m{n}.onnx")
        data_mib[n] = src.with_name(src.name + ".data").stat().st_size / 2**20
        cli = [sys.executable, "-m", "onnx_moe_fuse.cli", str(src), "-o", str(tmp_path / "o.onnx")]
        peaks[n] = _peak_mib(cli)
    extra = data_mib[4] - data_mib[1]
    # holding the model grows the peak by ~2.5x the extra data (unpacked codes, repacked
    # weights, mapped files); streaming by almost nothing
    print(f"peak MiB {peaks}, data MiB {data_mib}")
    assert peaks[4] - peaks[1] < 0.5 * extra, (peaks, data_mib)


def test_a_float_layer_is_moved_expert_by_expert(tmp_path):
    """One float layer's peak memory does not grow with its experts (issue 19, Deliver 1).

    16 and 64 experts of the same size: a layer joined in memory (the fused weights made
    whole) grows the peak by about the extra weights or more; moved one expert at a time from
    the source file to the output's, by a small fraction of them.
    """
    data_mib = {}
    peaks = {}
    for experts in (16, 64):
        model = stacked_moe_model(1, hidden=512, inter=256, experts=experts, weights="f32")
        src = _save_external(model, tmp_path, f"e{experts}.onnx")
        data_mib[experts] = src.with_name(src.name + ".data").stat().st_size / 2**20
        out = tmp_path / f"o{experts}.onnx"
        peaks[experts] = _peak_mib(
            [sys.executable, "-m", "onnx_moe_fuse.cli", str(src), "-o", str(out)]
        )
        assert out.exists()
    extra = data_mib[64] - data_mib[16]
    print(f"peak MiB {peaks}, data MiB {data_mib}")
    assert peaks[64] - peaks[16] < 0.3 * extra, (peaks, data_mib)


@pytest.mark.parametrize(
    ("name", "target"), [("qkv_rms23_dq_uint4_f16", "ort-webgpu"), ("mixtral_dec_f32", "ort-cpu")]
)
def test_every_rule_spills_the_same_weights(name, target, tmp_path):
    """The MatMulNBitsQkv rule and a float MoE layer: spilled tensors equal in-memory ones."""
    from onnx_moe_fuse.pipeline import FusionReport, fusion_pipeline
    from onnx_moe_fuse.samples import get_sample

    sample = get_sample(name)
    kept, spilled = (ir.serde.deserialize_model(sample.model) for _ in range(2))
    fusion_pipeline(FusionReport(), target=target)(kept)
    with ScratchFileSink(tmp_path) as sink:
        report = FusionReport()
        fusion_pipeline(report, target=target, weight_sink=sink)(spilled)
        assert report.fusions and sink.tensors_written > 0
        want = {n: v.const_value.tobytes() for n, v in kept.graph.initializers.items()}
        got = {n: v.const_value.tobytes() for n, v in spilled.graph.initializers.items()}
        assert got == want
        values = spilled.graph.initializers.values()
        assert any(isinstance(v.const_value, ir.ExternalTensor) for v in values)
        assert _nodes(ir.to_proto(spilled)) == _nodes(ir.to_proto(kept))


def test_a_full_scratch_file_raises_output_write_error_not_pass_error(tmp_path):
    """The sink's OSError inside onnx-ir's pass manager reaches the caller as ours (issue 19)."""
    from onnx_moe_fuse.errors import OutputWriteError

    full = tmp_path / "full"
    full.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(full)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        src = tmp_path / "m.onnx"
        model = stacked_moe_model(2, 64, 128, 4)
        onnx.save_model(
            model, src, save_as_external_data=True, location="m.onnx.data", size_threshold=256
        )
        with pytest.raises(OutputWriteError, match="scratch weight file.*No space left") as e:
            streaming_io.fuse_file(src, full / "o.onnx")
        assert isinstance(e.value.__cause__, OSError)
        assert list(full.iterdir()) == []
    finally:
        subprocess.run(["umount", str(full)], check=False)
