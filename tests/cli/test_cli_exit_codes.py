"""Exit codes that mean what they say: 0, 1 failed verify, 2 bad input/options, 3, 4 our bug.

Re-creates the option failures of issue 9 (``--seeds ""`` and ``--seeds -1`` ended in
tracebacks with exit 1, the code for a failed verification), and pins the new contract:
argparse's complaints are one line with exit 2; an internal error is one short line with exit 4
and the traceback only with ``--debug``; ``--target`` is offered with the runtimes of
``ort_contract.TARGETS`` and the summary names the target (and says when it is the default).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_cases import (
    SMALL,
    SMALL_FLOAT,
    assert_one_line_error,
    assert_refused,
    run_cli,
    save_sample,
)

from onnx_moe_fuse import api, kernels, streaming_io
from onnx_moe_fuse.cli import EXIT_INTERNAL, EXIT_NO_ADAPTER, EXIT_USAGE, parse_seeds
from onnx_moe_fuse.contract import targets as ort_contract
from onnx_moe_fuse.errors import OptionError
from onnx_moe_fuse.kernels import device as device_module


@pytest.mark.parametrize(
    ("options", "names"),
    [
        (["--seeds", ""], ["--seeds"]),
        (["--seeds", "-1"], ["--seeds", "-1"]),
        (["--seeds", "1,,2"], ["--seeds"]),
        (["--seeds", "x"], ["--seeds", "'x'"]),
        (["--seeds", "99999999999999999999"], ["--seeds"]),
        (["--only", ""], ["--only"]),
        (["--only", "Bogus"], ["--only", "Bogus"]),
        (["--target", "tpu"], ["--target", "tpu"]),
        (["--no-such-flag"], ["--no-such-flag"]),
    ],
)
def test_bad_options_exit_2_before_any_work(tmp_path, options, names):
    src = save_sample(tmp_path, SMALL)
    assert_refused([src, "-o", tmp_path / "o.onnx", "--verify", *options], tmp_path, *names)


def test_seeds_parse_as_non_negative_integers():
    assert parse_seeds(" 3, 4,5 ") == [3, 4, 5]
    for bad in ("", "-1", "1.5", "٣", "1,"):
        with pytest.raises(OptionError, match="--seeds"):
            parse_seeds(bad)


def test_missing_arguments_exit_2(tmp_path):
    src = save_sample(tmp_path, SMALL)
    assert_refused([src], tmp_path, "-o")
    assert_refused(["-o", tmp_path / "o.onnx"], tmp_path, "model")


def test_an_internal_error_is_one_line_with_exit_4(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the rule engine\nbroke")

    monkeypatch.setattr(api, "fuse", broken)
    monkeypatch.setattr(streaming_io, "fuse_file", broken)  # the path without --verify
    src = save_sample(tmp_path, SMALL)
    err = assert_refused(
        [src, "-o", tmp_path / "o.onnx"],
        tmp_path,
        "internal error",
        "RuntimeError",
        "--debug",
        code=EXIT_INTERNAL,
    )
    assert "the rule engine broke" in err
    code, _, err = run_cli([src, "-o", tmp_path / "o.onnx", "--debug"])
    assert code == EXIT_INTERNAL and "Traceback" in err and "broke" in err


def test_no_adapter_exits_3_after_the_input_checks(tmp_path, monkeypatch):
    def no_adapter():
        raise device_module.NoAdapterError("no adapter here")

    # the CLI reads the kernels' public face; the device module too, for a caller of it directly
    monkeypatch.setattr(kernels, "default_device", no_adapter)
    monkeypatch.setattr(device_module, "default_device", no_adapter)
    src = save_sample(tmp_path, SMALL)
    assert_refused(
        [src, "-o", tmp_path / "o.onnx", "--verify"], tmp_path, "WebGPU", code=EXIT_NO_ADAPTER
    )
    assert_refused(
        [src, "-o", tmp_path / "o.onnx", "--verify", "--seeds", ""],
        tmp_path,
        "--seeds",
        code=EXIT_USAGE,
    )


def test_target_is_offered_used_and_stated(tmp_path):
    code, out, _ = run_cli(["--help"])
    assert code == 0 and all(t in out for t in ort_contract.TARGETS)
    src = save_sample(tmp_path, SMALL)
    code, out, err = run_cli([src, "-o", tmp_path / "o.onnx", "--report", tmp_path / "r.json"])
    assert code == 0, err
    assert f"target {ort_contract.DEFAULT_TARGET} (the default" in out
    for target in ort_contract.TARGETS:
        code, out, err = run_cli(
            [src, "-o", tmp_path / "o.onnx", "--target", target, "--report", tmp_path / "r.json"]
        )
        assert code == 0, err
        assert f"target {target}" in out
        assert json.loads((tmp_path / "r.json").read_text())["target"] == target


def test_subprocess_runs_give_one_line_and_the_right_code(tmp_path):
    """The console entry point as a user runs it: no traceback reaches the terminal."""
    src = save_sample(tmp_path, SMALL_FLOAT, file_name="m.onnx", external=True)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07\x12\xff\xff not a model")
    cases = [
        ([str(src), "-o", str(tmp_path / "o.onnx"), "--report", str(src)], "input model"),
        ([str(bad), "-o", str(tmp_path / "o.onnx"), "--seeds", "-1"], "--seeds"),
    ]
    for argv, name in cases:
        done = subprocess.run(
            [sys.executable, "-m", "onnx_moe_fuse.cli", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == EXIT_USAGE, done.stderr
        assert_one_line_error(done.stderr, name)
