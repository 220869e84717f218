"""Progress on stderr (bars on a terminal, one line per stage otherwise, nothing when quiet).

Also the report's ``run`` section, and that progress changes no byte of the fused model.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from cli_cases import PROGRESS_LINE, SMALL, SMALL_FLOAT, run_cli, save_sample, sha256

from onnx_moe_fuse import api
from onnx_moe_fuse.cli import EXIT_OK, main
from onnx_moe_fuse.progress import Progress, run_section
from onnx_moe_fuse.samples import get_sample

#: The command line of the main branch, to compare output bytes against (where it is).
MAIN_CLI = Path("/work/main/.venv/bin/onnx-moe-fuse")


class FakeTerminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _stage_lines(err: str) -> list[str]:
    lines = [line for line in err.splitlines() if line.strip()]
    assert all(PROGRESS_LINE.fullmatch(line) for line in lines), lines
    return lines


def test_not_a_terminal_prints_one_line_per_stage(tmp_path):
    src = save_sample(tmp_path, SMALL, file_name="m.onnx", external=True)
    code, out, err = run_cli([src, "-o", tmp_path / "o.onnx"])
    assert code == EXIT_OK, err
    lines = _stage_lines(err)
    assert [line.split(":")[0] for line in lines] == ["load", "fuse", "save"]
    assert re.fullmatch(r"fuse: 1 layer fused in \d+\.\d s", lines[1]), lines
    assert "\r" not in err and "|" not in err  # no bar
    assert "fused QMoE" in out  # the summary stays on stdout


def test_a_subprocess_with_piped_stderr_prints_stage_lines(tmp_path):
    src = save_sample(tmp_path, SMALL_FLOAT, file_name="m.onnx", external=True)
    done = subprocess.run(
        [sys.executable, "-m", "onnx_moe_fuse.cli", str(src), "-o", str(tmp_path / "o.onnx")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == EXIT_OK, done.stderr
    lines = _stage_lines(done.stderr)
    assert [line.split(":")[0] for line in lines] == ["load", "fuse", "save"]
    assert lines[1].startswith("fuse: 1 layer fused in ")


def test_a_nothing_fused_run_says_so(tmp_path):
    src = save_sample(tmp_path, "nearmiss_erf_gelu_dec_f32", file_name="m.onnx")
    code, _, err = run_cli([src, "-o", tmp_path / "o.onnx"])
    assert code == EXIT_OK
    assert any(line.startswith("fuse: 0 layers fused in ") for line in _stage_lines(err))


def test_a_terminal_gets_tqdm_bars(tmp_path, monkeypatch, capsys):
    src = save_sample(tmp_path, SMALL, file_name="m.onnx", external=True)
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main([str(src), "-o", str(tmp_path / "o.onnx")]) == EXIT_OK
    shown = terminal.getvalue()
    for bar in ("load: ", "fuse: ", "save: ", "layers: 100%", "1/1", "repack: "):
        assert bar in shown, (bar, shown)
    assert "\r" in shown  # tqdm redraws in place
    assert not PROGRESS_LINE.search(shown.replace("\r", "\n"))  # no plain stage lines
    assert "fused QMoE" in capsys.readouterr().out


def test_the_bytes_bar_counts_the_repacked_weights():
    terminal = FakeTerminal()
    progress = Progress(quiet=False, stream=terminal)
    result = api.fuse(get_sample(SMALL).model, progress=progress)
    assert result.fused
    shown = terminal.getvalue()
    assert "repack: " in shown and "B [" in shown, shown


@pytest.mark.parametrize("terminal", [False, True])
def test_quiet_prints_nothing_on_success(tmp_path, monkeypatch, capsys, terminal):
    src = save_sample(tmp_path, SMALL, file_name="m.onnx", external=True)
    if terminal:
        monkeypatch.setattr(sys, "stderr", FakeTerminal())
    assert main([str(src), "-o", str(tmp_path / "o.onnx"), "-q"]) == EXIT_OK
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (sys.stderr.getvalue() if terminal else captured.err) == ""


def test_a_failing_stage_prints_no_stage_line(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    code, _, err = run_cli([bad, "-o", tmp_path / "o.onnx"])
    assert code == 2
    assert not any(PROGRESS_LINE.fullmatch(line) for line in err.splitlines()), err


def _check_run(run: dict, stages: list[str], adapter: bool) -> None:
    assert set(run) == {"tool", "versions", "adapter", "stages", "peak_rss_mib"}
    assert run["tool"] == metadata.version("onnx-moe-fuse")
    versions = run["versions"]
    assert set(versions) >= {"onnx", "onnx-ir", "onnxscript", "onnxruntime", "wgpu"}
    for name in ("onnx", "onnx-ir", "onnxscript", "wgpu"):
        assert versions[name] == metadata.version(name)
    assert list(run["stages"]) == stages
    assert all(isinstance(t, float) and 0 <= t < 600 for t in run["stages"].values())
    assert isinstance(run["peak_rss_mib"], float) and 10 < run["peak_rss_mib"] < 1e6
    if adapter:
        assert isinstance(run["adapter"], str) and run["adapter"]
    else:
        assert run["adapter"] is None


def test_the_report_has_a_run_section(tmp_path):
    src = save_sample(tmp_path, SMALL, file_name="m.onnx", external=True)
    report = tmp_path / "r.json"
    code, _, err = run_cli([src, "-o", tmp_path / "o.onnx", "--report", report, "-q"])
    assert code == EXIT_OK, err
    data = json.loads(report.read_text())
    _check_run(data["run"], ["load", "fuse", "save"], adapter=False)
    # the rest of the report is as it was
    assert {"input", "output", "target", "fusions", "near_misses", "canonicalisation"} <= set(data)
    assert [f["op"] for f in data["fusions"]] == ["QMoE"]


def test_the_verified_report_names_the_adapter(device, tmp_path):
    src = save_sample(tmp_path, SMALL, file_name="m.onnx")
    report = tmp_path / "r.json"
    code, _, err = run_cli(
        [src, "-o", tmp_path / "o.onnx", "--verify", "--seeds", "0", "--report", report]
    )
    assert code == EXIT_OK, err
    data = json.loads(report.read_text())
    _check_run(data["run"], ["load", "fuse", "verify", "save"], adapter=True)
    assert data["run"]["adapter"] == device.description
    assert any(line.startswith("verify: passed in ") for line in _stage_lines(err))


def test_the_api_report_carries_the_pipeline_stage():
    result = api.fuse(get_sample(SMALL).model)
    _check_run(result.report.run, ["fuse"], adapter=False)
    assert result.report.to_dict()["run"] == result.report.run


def test_run_section_without_stages():
    run = run_section({})
    assert run["stages"] == {} and run["adapter"] is None


@pytest.mark.parametrize("external", [False, True])
def test_progress_changes_no_byte_of_the_output(tmp_path, monkeypatch, external):
    src = save_sample(tmp_path, SMALL, file_name="m.onnx", external=external)
    quiet, shown = tmp_path / "quiet", tmp_path / "shown"
    quiet.mkdir()
    shown.mkdir()
    assert main([str(src), "-o", str(quiet / "o.onnx"), "-q"]) == EXIT_OK
    monkeypatch.setattr(sys, "stderr", FakeTerminal())
    assert main([str(src), "-o", str(shown / "o.onnx")]) == EXIT_OK
    names = sorted(p.name for p in quiet.iterdir())
    assert names == sorted(p.name for p in shown.iterdir())
    for name in names:
        assert sha256(quiet / name) == sha256(shown / name), name


@pytest.mark.skipif(not MAIN_CLI.exists(), reason="the main branch's command line is not here")
@pytest.mark.parametrize(
    ("name", "external", "options"),
    [
        (SMALL, True, []),
        (SMALL, False, []),
        (SMALL_FLOAT, True, []),
        (SMALL, True, ["--verify", "--seeds", "0"]),  # the in-memory path
    ],
)
def test_the_output_is_byte_for_byte_mains(request, tmp_path, name, external, options):
    if options:
        request.getfixturevalue("device")  # skips without a WebGPU adapter
    src = save_sample(tmp_path, name, file_name="m.onnx", external=external)
    ours, theirs = tmp_path / "ours", tmp_path / "main"
    ours.mkdir()
    theirs.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(MAIN_CLI), str(src), "-o", str(theirs / "o.onnx"), "-q", *options],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    if done.returncode != EXIT_OK:
        pytest.skip(f"the main branch's command line did not run here: {done.stderr[-300:]}")
    code, _, err = run_cli([src, "-o", ours / "o.onnx", *options])
    assert code == EXIT_OK, err
    names = sorted(p.name for p in theirs.iterdir())
    assert names == sorted(p.name for p in ours.iterdir())
    if external and not options and "o.onnx.data" in names:
        # the streaming path writes the fused weights once, where its scratch file put them
        # (docs/architecture.md, "Memory"): the same tensors, laid out in another order
        assert _tensors_and_graph(ours / "o.onnx") == _tensors_and_graph(theirs / "o.onnx")
        return
    for file in names:
        assert sha256(ours / file) == sha256(theirs / file), file
    shutil.rmtree(theirs)


def _tensors_and_graph(path: Path) -> tuple[bytes, dict[str, bytes]]:
    """The model proto without external-data places, and every tensor's bytes by name."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    data = (path.parent / (path.name + ".data")).read_bytes()
    tensors = {}
    for t in proto.graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        if info:
            start = int(info.get("offset", 0))
            tensors[t.name] = data[start : start + int(info["length"])]
            del t.external_data[:]
        else:
            tensors[t.name] = t.SerializeToString()
    return proto.SerializeToString(deterministic=True), tensors
