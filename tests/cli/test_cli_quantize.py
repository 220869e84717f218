"""The command line's ``--quantize`` / ``--block-size`` / ``--accuracy-level``.

Bad values exit 2 before any work (one line naming the option, nothing written); a quantised
run prints each layer's measured error, and ``--verify`` compares with the float original at the
measured tolerance, which the report's verification notes name.
"""

from __future__ import annotations

import json

import pytest
from cli_cases import assert_refused, run_cli, save_sample


@pytest.mark.parametrize(
    ("options", "names"),
    [
        (["--quantize", "int3"], ["--quantize", "'int3'"]),
        (["--quantize", "int4", "--block-size", "24"], ["--block-size", "24"]),
        (["--quantize", "int4", "--block-size", "x"], ["--block-size"]),
        (["--quantize", "int4", "--block-size", "64"], ["--block-size 64", "I = 32"]),
        (["--quantize", "int8", "--block-size", "32"], ["--block-size", "block-wise 8-bit"]),
        (["--block-size", "32"], ["--block-size", "--quantize"]),
        (["--quantize", "int4", "--only", "MoE"], ["--quantize", "MoE"]),
        (["--accuracy-level", "5"], ["--accuracy-level", "5"]),
        (["--accuracy-level", "4", "--target", "ort-webgpu"], ["--accuracy-level", "ort-webgpu"]),
        (["--quantize", "int4", "--quantize", "int8"], ["--quantize", "twice"]),
    ],
)
@pytest.mark.parametrize("verify", [False, True])
def test_bad_quantisation_options_exit_2_and_write_nothing(tmp_path, options, names, verify):
    src = save_sample(tmp_path, "qwen3_dec_f32")
    extra = ["--verify"] if verify else []
    assert_refused([src, "-o", tmp_path / "o.onnx", *extra, *options], tmp_path, *names)


def test_quantisation_options_have_no_effect_with_self_check(tmp_path):
    code, _, err = run_cli(["--self-check", "--quantize", "int4"])
    assert code == 2 and "--quantize has no effect" in err


def test_the_command_line_verifies_with_the_measured_tolerance(tmp_path):
    src = save_sample(tmp_path, "qwen3_dec_f32")
    out, rep = tmp_path / "o.onnx", tmp_path / "r.json"
    code, stdout, err = run_cli(
        [src, "-o", out, "--quantize", "int4", "--verify", "--seeds", "0", "--report", rep]
    )
    assert code == 0, err
    assert "quantised to int4 (blocks of 32)" in stdout and "not exact" in stdout
    report = json.loads(rep.read_text())
    assert report["quantization"]["quantize"] == "int4"
    assert report["fusions"][0]["quantization"]["max_rel_error"] > 0
    assert report["verification"]["passed"]
    notes = [n for p in report["verification"]["paths"].values() for n in p["tolerance_notes"]]
    assert notes and all("measured errors" in n for n in notes)
