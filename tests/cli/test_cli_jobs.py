"""``--jobs``: the worker processes that write repacked weights change no byte of the output."""

from __future__ import annotations

from cli_cases import SMALL, run_cli, save_sample, sha256

from onnx_moe_fuse.cli import EXIT_OK, EXIT_USAGE


def test_any_number_of_jobs_writes_the_same_files(tmp_path):
    src = save_sample(tmp_path, SMALL, file_name="m.onnx", external=True)
    outs = []
    for jobs in ("1", "2", "3"):
        folder = tmp_path / f"j{jobs}"
        folder.mkdir()
        code, _, err = run_cli([src, "-o", folder / "o.onnx", "--jobs", jobs])
        assert code == EXIT_OK, err
        outs.append([sha256(folder / n) for n in ("o.onnx", "o.onnx.data")])
    assert outs[0] == outs[1] == outs[2]


def test_jobs_below_one_is_refused(tmp_path):
    src = save_sample(tmp_path, SMALL, file_name="m.onnx", external=True)
    code, _, err = run_cli([src, "-o", tmp_path / "o.onnx", "--jobs", "0"])
    assert code == EXIT_USAGE and "--jobs" in err
    assert not (tmp_path / "o.onnx").exists()
