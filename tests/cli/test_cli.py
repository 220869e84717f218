"""The ``onnx-moe-fuse`` command: fusing, verifying, reporting, refusing, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnx_moe_fuse import api
from onnx_moe_fuse.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from onnx_moe_fuse.samples import get_sample


def _save(tmp_path: Path, name: str, external: bool = False) -> Path:
    path = tmp_path / f"{name}.onnx"
    onnx.save_model(
        get_sample(name).model,
        path,
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location=f"{name}.onnx.data",
        size_threshold=256,
    )
    return path


def test_fuses_verifies_and_reports(device, tmp_path, capsys):
    src = _save(tmp_path, "qwen3_dec_int4b32")
    out, report = tmp_path / "fused.onnx", tmp_path / "report.json"
    code = main([str(src), "-o", str(out), "--verify", "--report", str(report), "--seeds", "3,4"])
    assert code == EXIT_OK, capsys.readouterr()
    fused = onnx.load(out)
    assert [n.op_type for n in fused.graph.node if n.domain == "com.microsoft"] == ["QMoE"]
    data = json.loads(report.read_text())
    assert [f["op"] for f in data["fusions"]] == ["QMoE"]
    assert data["fusions"][0]["attributes"]["k"] == 8
    assert data["verification"]["passed"] is True
    assert set(data["verification"]["paths"]) == {"wgpu", "ort"}
    assert "verification PASSED" in capsys.readouterr().out


def test_explain_lists_near_misses_and_leaves_the_model_unchanged(tmp_path, capsys):
    src = _save(tmp_path, "nearmiss_erf_gelu_dec_f32")
    out = tmp_path / "out.onnx"
    assert main([str(src), "-o", str(out), "--explain"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "nothing fused" in text and "gelu" in text.lower()
    assert onnx.load(out).graph == onnx.load(src).graph


def test_only_restricts_the_emitted_ops(tmp_path, capsys):
    src = _save(tmp_path, "mixtral_dec_int4b32")
    out = tmp_path / "out.onnx"
    assert main([str(src), "-o", str(out), "--only", "MoE"]) == EXIT_OK
    assert "nothing fused" in capsys.readouterr().out
    assert main([str(src), "-o", str(out), "--only", "Bogus"]) == EXIT_USAGE
    assert "Bogus" in capsys.readouterr().err


def test_external_data_in_external_data_out(tmp_path):
    src = _save(tmp_path, "mixtral_dec_f32", external=True)
    out = tmp_path / "sub" / "fused.onnx"
    out.parent.mkdir()
    assert main([str(src), "-o", str(out)]) == EXIT_OK
    assert (out.parent / "fused.onnx.data").is_file()
    fused = onnx.load(out)  # reads the data file beside it
    assert any(n.op_type == "MoE" for n in fused.graph.node)


def test_refuses_to_overwrite_the_input(tmp_path, capsys):
    src = _save(tmp_path, "mixtral_dec_f32")
    before = src.read_bytes()
    assert main([str(src), "-o", str(src)]) == EXIT_USAGE
    assert "overwrite" in capsys.readouterr().err
    assert src.read_bytes() == before


@pytest.mark.parametrize(
    "args", [["missing.onnx", "-o", "x.onnx"], ["bad.onnx", "-o", "x.onnx"], ["model.onnx"], []]
)
def test_bad_usage_and_bad_files_exit_2(tmp_path, monkeypatch, capsys, args):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    _save(tmp_path, "mixtral_dec_f32").rename(tmp_path / "model.onnx")
    assert main(args) == EXIT_USAGE
    assert not (tmp_path / "x.onnx").exists()


def test_failed_verification_exits_1_and_writes_nothing(device, tmp_path, monkeypatch, capsys):
    real_fuse = api.fuse

    def wrong_fuse(model, **kwargs):
        result = real_fuse(model, **kwargs)
        broken = onnx.ModelProto()
        broken.CopyFrom(result.model)
        for init in broken.graph.initializer:  # nudge one float weight of the fused node
            if init.data_type == onnx.TensorProto.FLOAT and init.dims and init.dims[0] > 1:
                array = numpy_helper.to_array(init).copy()
                array.flat[0] += 1.0
                init.CopyFrom(numpy_helper.from_array(array, init.name))
                break
        return replace(result, model=broken)

    monkeypatch.setattr(api, "fuse", wrong_fuse)
    src = _save(tmp_path, "mixtral_dec_f32")
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    assert main([str(src), "-o", str(out), "--verify", "--report", str(report)]) == EXIT_FAILED
    assert not out.exists()
    assert json.loads(report.read_text())["verification"]["passed"] is False
    assert "verification FAILED" in capsys.readouterr().err


def test_console_script_demo(device, tmp_path):
    out = tmp_path / "demo.onnx"
    done = subprocess.run(
        [sys.executable, "-m", "onnx_moe_fuse.cli", "--demo", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verification PASSED" in done.stdout
    assert np.any([n.op_type == "QMoE" for n in onnx.load(out).graph.node])


def test_explain_says_which_routing_construction_feeds_the_node(tmp_path, capsys):
    src = _save(tmp_path, "sigmoid_dec_int4b32")
    out = tmp_path / "out.onnx"
    report = tmp_path / "r.json"
    assert main([str(src), "-o", str(out), "--explain", "--report", str(report)]) == EXIT_OK
    text = capsys.readouterr().out
    assert "routing: router_weights construction, the output rescaled per token" in text
    assert "stays in the graph" in text
    (fusion,) = json.loads(report.read_text())["fusions"]
    assert fusion["routing"]["construction"] == "router_weights"
    assert fusion["routing"]["router"] == "sigmoid_topk"
