"""No data loss: outputs never overwrite the input, its data, or each other; writes are atomic.

Each case re-creates a failure found by a QA pass (issue 9): ``--report`` naming the input, its
external data file or the ``-o`` path; links and other spellings of the input; missing or
unusable output folders found only after fusing; write-time failures (permission, a folder in
the way, a full disk) ending in tracebacks or partial files; a report written 0600.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import onnx
import pytest
from cli_cases import SMALL, SMALL_FLOAT, assert_refused, run_cli, save_sample, snapshot

from onnx_moe_fuse import streaming_io
from onnx_moe_fuse.io import model_io, output_paths


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """A small model with external data: ``m.onnx`` + ``m.onnx.data``."""
    return save_sample(tmp_path, SMALL_FLOAT, file_name="m.onnx", external=True)


def test_report_naming_the_input_or_its_data_is_refused(tmp_path, src):
    out = tmp_path / "out.onnx"
    assert_refused([src, "-o", out, "--report", src], tmp_path, "--report", "input model")
    data = tmp_path / "m.onnx.data"
    assert_refused([src, "-o", out, "--report", data], tmp_path, "--report", "external data")


def test_report_naming_an_output_is_refused(tmp_path, src):
    out = tmp_path / "out.onnx"
    assert_refused([src, "-o", out, "--report", out], tmp_path, "--report", "-o")
    assert_refused(
        [src, "-o", out, "--report", tmp_path / "out.onnx.data"], tmp_path, "--report", "data file"
    )


def test_output_naming_the_input_in_any_spelling_is_refused(tmp_path, src):
    (tmp_path / "sub").mkdir()
    os.symlink(src, tmp_path / "link.onnx")
    os.link(src, tmp_path / "hard.onnx")
    for target in (
        src,
        tmp_path / "sub" / ".." / "m.onnx",
        tmp_path / "link.onnx",
        tmp_path / "hard.onnx",
    ):
        assert_refused([src, "-o", target], tmp_path, "-o", "input model")
    # -o "m.onnx.data" is the input's data; -o "m.onnx" + ".data" would be too.
    assert_refused([src, "-o", tmp_path / "m.onnx.data"], tmp_path, "external data")
    other = save_sample(tmp_path, SMALL, file_name="q.onnx", external=True, location="shared.data")
    assert_refused([other, "-o", tmp_path / "shared"], tmp_path, "data file of -o", "shared.data")


def test_output_folders_are_checked_before_any_work(tmp_path, src):
    err = assert_refused([src, "-o", tmp_path / "nope" / "out.onnx"], tmp_path, "-o", "nope")
    assert "does not exist" in err
    (tmp_path / "adir").mkdir()
    assert_refused([src, "-o", tmp_path / "adir"], tmp_path, "-o", "is a folder")
    assert_refused(
        [src, "-o", tmp_path / "o.onnx", "--report", tmp_path / "nope" / "r.json"],
        tmp_path,
        "--report",
        "does not exist",
    )
    os.mkfifo(tmp_path / "pipe")
    assert_refused([src, "-o", tmp_path / "pipe"], tmp_path, "-o", "not a regular file")
    code, out, _ = run_cli([src, "-o", tmp_path / "nope" / "out.onnx", "--verify"])
    assert code == 2 and "fused" not in out  # refused before fusing or verifying


def _deny_in(monkeypatch, module, folder: Path, error: OSError) -> None:
    """``os.open`` of a new file in ``folder`` fails with ``error`` (we run as root here)."""
    real_open = os.open

    def guarded(path, flags, *args, **kwargs):
        if Path(path).parent == folder and flags & os.O_CREAT:
            raise error
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(module.os, "open", guarded)


def test_unwritable_folders_are_refused_up_front(tmp_path, src, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    _deny_in(monkeypatch, output_paths, ro, PermissionError(errno.EACCES, "Permission denied"))
    assert_refused([src, "-o", ro / "out.onnx"], tmp_path, "-o", "Permission denied")
    assert_refused(
        [src, "-o", tmp_path / "o.onnx", "--report", ro / "r.json"], tmp_path, "--report", "ro"
    )


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        PermissionError(errno.EACCES, "Permission denied"),
        IsADirectoryError(errno.EISDIR, "Is a directory"),
    ],
    ids=["ENOSPC", "EACCES", "EISDIR"],
)
def test_write_time_failures_exit_2_and_leave_nothing(tmp_path, src, monkeypatch, error):
    def failing_save(proto, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise error

    monkeypatch.setattr(model_io.onnx, "save_model", failing_save)
    monkeypatch.setattr(streaming_io.ir, "save", failing_save)  # the path without --verify
    assert_refused([src, "-o", tmp_path / "out.onnx"], tmp_path, "out.onnx", error.strerror)


def test_report_write_failure_keeps_the_previous_report(tmp_path, src, monkeypatch):
    report = tmp_path / "r.json"
    report.write_text("{}\n")

    real_fsync = os.fsync

    def full_disk(fd):  # the disk fills up while the report is written
        if ".r.json." in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(output_paths.os, "fsync", full_disk)
    code, _, err = run_cli([src, "-o", tmp_path / "out.onnx", "--report", report])
    assert code == 2 and "r.json" in err and "No space" in err
    assert report.read_text() == "{}\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert (tmp_path / "out.onnx").is_file()  # the model, written before, is complete


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_get_the_mode_of_any_new_file(tmp_path, src, umask):
    old = os.umask(umask)
    try:
        code, _, err = run_cli([src, "-o", tmp_path / "out.onnx", "--report", tmp_path / "r.json"])
    finally:
        os.umask(old)
    assert code == 0, err
    for name in ("out.onnx", "out.onnx.data", "r.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name
    assert json.loads((tmp_path / "r.json").read_text())["target"] == "ort-cpu"
    assert onnx.load(tmp_path / "out.onnx").graph.node


def test_success_leaves_the_input_and_no_temporaries(tmp_path, src):
    before = snapshot(tmp_path)
    code, _, err = run_cli([src, "-o", tmp_path / "out.onnx", "--report", tmp_path / "r.json"])
    assert code == 0, err
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert sorted(set(after) - set(before)) == ["out.onnx", "out.onnx.data", "r.json"]
