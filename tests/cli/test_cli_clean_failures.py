"""Clean failures (issue 19, Deliver 5): every failure exits with its documented code, one line.

* a write that the file system refuses (a full disk, a file size limit) exits 2 naming the file
  and the size needed, never 4, and leaves nothing: made real here, a tmpfs of a few pages
  (ENOSPC; skipped where it cannot be mounted) and ``RLIMIT_FSIZE`` in a child (EFBIG), both for
  the scratch weight file (written inside onnx-ir's pass manager, which wraps the error) and
  for the model file itself;
* SIGTERM and SIGHUP mid-write exit 128 + the signal, removing exactly what the run created;
* options that are repeated, name a folder for a file, or have no effect are refused;
* a stale ``OUT.onnx.data`` beside an output written inline is warned of and left alone;
* the advice for too-large verification inputs names options that exist;
* ``--version`` and ``--quiet``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from cli_cases import (
    SMALL,
    SMALL_FLOAT,
    assert_one_line_error,
    assert_refused,
    run_cli,
    save_sample,
    sha256,
    snapshot,
    without_progress,
)

from onnx_moe_fuse.cli import EXIT_USAGE, _bad_input_message
from onnx_moe_fuse.cli_options import build_parser as _parser
from onnx_moe_fuse.streaming_io import TEST_PAUSE_ENV
from onnx_moe_fuse.verify.feeds import FeedTooLargeError, feed_shapes

#: Runs the command in a child whose files may not grow past argv[1] bytes (EFBIG, not SIGXFSZ).
_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from onnx_moe_fuse.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _child(argv: list[str | Path], limit: int | None = None, **kwargs) -> subprocess.Popen:
    head = ["-c", _LIMITED, str(limit)] if limit is not None else ["-m", "onnx_moe_fuse.cli"]
    return subprocess.Popen(
        [sys.executable, *head, *(str(a) for a in argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _finish(child: subprocess.Popen) -> tuple[int, str, str]:
    out, err = child.communicate(timeout=120)
    return child.returncode, out, err


def _old_output(folder: Path) -> Path:
    """An earlier run's output (model and data file) that a failed run must leave as it was."""
    out = folder / "f.onnx"
    out.write_bytes(b"the previous model")
    (folder / "f.onnx.data").write_bytes(b"the previous data")
    return out


# -- a full disk, a file size limit -----------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs of 64 KiB (a really full disk); skipped where mounting is not allowed."""
    mount = tmp_path / "full"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize(
    ("external", "names"),
    [(True, ["scratch weight file", "needed"]), (False, ["f.onnx", "need about"])],
    ids=["scratch-file", "model-file"],
)
def test_a_full_disk_exits_2_naming_the_file(tmp_path, small_tmpfs, external, names):
    name = "m.onnx"
    src = save_sample(tmp_path, SMALL_FLOAT if external else SMALL, file_name=name,
                      external=external)  # fmt: skip
    if not external:  # fill the disk so that the 35 kB model cannot fit
        (small_tmpfs / "filler").write_bytes(b"\0" * 40_000)
    out = _old_output(small_tmpfs)
    before = snapshot(small_tmpfs)
    code, _, err = run_cli([src, "-o", out])
    assert code == EXIT_USAGE, err
    assert_one_line_error(err, *names, "No space left on device", "nothing was written")
    assert snapshot(small_tmpfs) == before


@pytest.mark.parametrize(
    ("external", "names"),
    [(True, ["scratch weight file", "needed"]), (False, ["f.onnx", "need about"])],
    ids=["scratch-file", "model-file"],
)
def test_a_file_size_limit_exits_2_naming_the_file(tmp_path, external, names):
    src = save_sample(tmp_path, SMALL_FLOAT if external else SMALL, file_name="m.onnx",
                      external=external)  # fmt: skip
    folder = tmp_path / "out"
    folder.mkdir()
    out = _old_output(folder)
    before = snapshot(folder)
    code, stdout, err = _finish(_child([src, "-o", out], limit=20_000))
    assert code == EXIT_USAGE, err
    assert_one_line_error(err, *names, str(folder), "nothing was written")
    assert "internal error" not in err and "fused" not in stdout
    assert snapshot(folder) == before


# -- signals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_mid_write_removes_what_the_run_created(tmp_path, signum):
    src = save_sample(tmp_path, SMALL_FLOAT, file_name="m.onnx", external=True)
    folder = tmp_path / "out"
    folder.mkdir()
    out = _old_output(folder)
    before = snapshot(folder)
    marker = tmp_path / "paused"
    child = _child([src, "-o", out], env={**os.environ, TEST_PAUSE_ENV: str(marker)})
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the run never reached its write"
        time.sleep(0.05)
    mid_write = {p.name for p in folder.iterdir()} - {"f.onnx", "f.onnx.data"}
    temps = [n for n in mid_write if n.startswith(".f.onnx.tmp-")]
    assert temps, mid_write  # the temp folder, holding the scratch file as the new data file
    assert (folder / temps[0] / "f.onnx.data").is_file(), list((folder / temps[0]).iterdir())
    child.send_signal(signum)
    code, _, err = _finish(child)
    assert code == 128 + signum, err
    assert_one_line_error(err, signum.name, "removed")
    assert snapshot(folder) == before  # the old output byte-identical, nothing new beside it


# -- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "names"),
    [
        (["-o", "{out}/new/dir/"], ["-o", "folder", "new/dir/fused.onnx"]),
        (["-o", "{out}/"], ["-o", "folder"]),
        (["-o", "{out}"], ["-o", "folder"]),
        (["-o", "{out}/o.onnx", "--report", "{out}/rdir/"], ["--report", "folder"]),
        (["-o", "{out}/a.onnx", "-o", "{out}/b.onnx"], ["-o", "twice", "a.onnx", "b.onnx"]),
        (["-o", "{out}/a.onnx", "--output", "{out}/b.onnx"], ["--output", "twice"]),
        (["-o", "{out}/o.onnx", "--target", "ort-cpu", "--target", "ort-cuda"], ["--target"]),
        (["-o", "{out}/o.onnx", "--only", "MoE", "--only", "QMoE"], ["--only", "twice"]),
        (["-o", "{out}/o.onnx", "--report", "{out}/a", "--report", "{out}/b"], ["--report"]),
        (["-o", "{out}/o.onnx", "--seeds", "1"], ["--seeds", "no effect without --verify"]),
        (["-o", "{out}/o.onnx", "--seed", "1"], ["--seed", "no effect without --self-check"]),
        (["-o", "{out}/o.onnx", "--demo"], ["--demo", "m.onnx"]),
        (["-o", "{out}/o.onnx", "--quiet", "--explain"], ["--quiet", "--explain"]),
        (["-o", "{out}/o.onnx", "--self-check"], ["no effect with --self-check"]),
        (["-o", "{out}/o.onnx", "--list-adapters"], ["no effect with --list-adapters"]),
    ],
)
def test_options_that_would_be_ignored_are_refused(tmp_path, options, names):
    src = save_sample(tmp_path, SMALL, file_name="m.onnx")
    folder = tmp_path / "out"
    folder.mkdir()
    argv = [a.replace("{out}", str(folder)) for a in options]
    assert_refused([src, *argv], tmp_path, *names)


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--self-check", "--only", "QMoE"], ["--only", "with --self-check"]),
        (["--self-check", "--seeds", "1"], ["--seeds", "with --self-check"]),
        (["--list-adapters", "--explain"], ["--explain", "with --list-adapters"]),
        (["--list-adapters", "--self-check"], ["--list-adapters", "--self-check"]),
        (["--list-adapters", "--quiet"], ["--quiet"]),
        (["--demo", "--seed", "2"], ["--seed"]),
    ],
)
def test_commands_without_a_model_refuse_fuse_options(tmp_path, argv, names):
    assert_refused(argv, tmp_path, *names)


def test_seeds_are_taken_with_verify_or_demo():
    args = _parser().parse_args(["m.onnx", "-o", "o.onnx", "--verify", "--seeds", "4"])
    assert args.seeds == "4"
    from onnx_moe_fuse.cli import check_combination

    check_combination(args)  # no refusal
    check_combination(_parser().parse_args(["--demo", "--seeds", "4"]))


# -- a stale data file --------------------------------------------------------------------------


def test_a_stale_data_file_beside_an_inline_output_is_warned_of(tmp_path):
    src = save_sample(tmp_path, SMALL, file_name="m.onnx")
    clean, stale = tmp_path / "clean", tmp_path / "stale"
    clean.mkdir()
    stale.mkdir()
    code, _, err = run_cli([src, "-o", clean / "o.onnx"])
    assert code == 0 and without_progress(err) == "", err
    (stale / "o.onnx.data").write_bytes(b"an earlier run's weights")
    code, _, err = run_cli([src, "-o", stale / "o.onnx"])
    assert code == 0, err
    lines = without_progress(err).splitlines()
    assert len(lines) == 1 and "warning" in lines[0] and str(stale / "o.onnx.data") in lines[0]
    assert (stale / "o.onnx.data").read_bytes() == b"an earlier run's weights"  # not deleted
    assert sha256(stale / "o.onnx") == sha256(clean / "o.onnx")  # the output as without it


def test_no_warning_when_the_data_file_is_this_runs(tmp_path):
    src = save_sample(tmp_path, SMALL_FLOAT, file_name="m.onnx", external=True)
    (tmp_path / "o.onnx.data").write_bytes(b"old")
    code, _, err = run_cli([src, "-o", tmp_path / "o.onnx"])
    assert code == 0 and "warning" not in err, err
    assert (tmp_path / "o.onnx.data").read_bytes() != b"old"  # replaced by this run's


# -- advice -------------------------------------------------------------------------------------


def test_too_large_verification_inputs_advise_real_options():
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["tokens"], ["y"])],
        "g",
        [helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [100_000_000, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [100_000_000, 64])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    with pytest.raises(FeedTooLargeError) as caught:
        feed_shapes(model)
    assert "dim_values" in str(caught.value)  # the API's parameter, for API callers
    message = _bad_input_message(caught.value)
    assert "'tokens'" in message and "25.6 GB" in message and "\n" not in message
    known = {s for action in _parser()._actions for s in action.option_strings}
    named = set(re.findall(r"--[a-z][a-z-]*", message))
    assert named and named <= known, named - known
    assert "dim_values" not in message  # the command line has no such option


# -- --version, --quiet -------------------------------------------------------------------------


def test_version_prints_the_package_version():
    code, out, err = run_cli(["--version"])
    assert code == 0 and err == ""
    assert out == f"onnx-moe-fuse {metadata.version('onnx-moe-fuse')}\n"


def test_quiet_prints_only_errors_and_writes_the_same_model(tmp_path):
    src = save_sample(tmp_path, SMALL, file_name="m.onnx")
    code, out, _ = run_cli([src, "-o", tmp_path / "loud.onnx", "--report", tmp_path / "r.json"])
    assert code == 0 and "fused" in out
    code, out, err = run_cli([src, "-o", tmp_path / "quiet.onnx", "-q"])
    assert code == 0 and out == "" and err == ""
    assert sha256(tmp_path / "quiet.onnx") == sha256(tmp_path / "loud.onnx")
    code, out, err = run_cli([src, "-o", tmp_path / "nope" / "o.onnx", "--quiet"])
    assert code == EXIT_USAGE and out == ""
    assert_one_line_error(err, "does not exist")
