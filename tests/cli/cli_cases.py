"""Shared pieces of the command-line tests: small models on disk, folder snapshots, one run.

Imported as ``cli_cases`` (pytest puts this folder on ``sys.path``). :func:`run_cli` calls
``onnx_moe_fuse.cli.main`` in-process (fast) and returns the exit code with stdout and stderr;
:func:`assert_refused` states what every refusal must look like: exit code 2, one line on
stderr that names what is at fault, no traceback, and the folder exactly as it was (input bytes
unchanged, nothing written, no temporary left behind).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import onnx
from hypothesis import HealthCheck, Phase, settings

from onnx_moe_fuse.cli import main
from onnx_moe_fuse.io.model_io import load_model
from onnx_moe_fuse.samples import get_sample

#: A small quantized sample that fuses (QMoE) in about 0.15 s.
SMALL = "mixtral_dec_int4b32"
#: A small float sample (MoE); its tensors are large enough to go to external data.
SMALL_FLOAT = "mixtral_dec_f32"


def save_sample(
    folder: Path,
    name: str = SMALL,
    *,
    file_name: str | None = None,
    external: bool = False,
    location: str | None = None,
) -> Path:
    """Save sample ``name`` into ``folder`` (with external data in ``location`` if asked)."""
    path = folder / (file_name or f"{name}.onnx")
    model = onnx.ModelProto()
    model.CopyFrom(get_sample(name).model)
    onnx.save_model(
        model,
        path,
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location=location or f"{path.name}.data",
        size_threshold=256,
    )
    return path


def sha256(path: Path) -> str:
    """The sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and link under ``folder`` (relative name -> sha256 or link target)."""
    found: dict[str, str] = {}
    for p in sorted(folder.rglob("*")):
        name = str(p.relative_to(folder))
        if p.is_symlink():
            found[name] = "-> " + str(p.readlink())
        elif p.is_file():
            found[name] = sha256(p)
        else:
            found[name] = "folder"
    return found


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """Run the command in-process; return ``(exit code, stdout, stderr)``."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


#: A progress line of a stage that ended (stderr not a terminal: ``onnx_moe_fuse.progress``).
PROGRESS_LINE = re.compile(r"(load|fuse|verify|save): (\S.* in )?\d+\.\d s")


def without_progress(err: str) -> str:
    """``err`` less the progress lines of the stages that ended before (docs/cli.md)."""
    return "".join(
        line for line in err.splitlines(keepends=True) if not PROGRESS_LINE.fullmatch(line.strip())
    )


def assert_one_line_error(err: str, *names: str) -> None:
    """stderr holds one line, no traceback, and names each of ``names``.

    The progress lines of stages that ended before the error (``load: 0.1 s``) are not counted.
    """
    assert "Traceback" not in err, err
    lines = [line for line in without_progress(err).splitlines() if line.strip()]
    assert len(lines) == 1, err
    for name in names:
        assert name in lines[0], (name, lines[0])


def assert_refused(argv: list[str], folder: Path, *names: str, code: int = 2) -> str:
    """Running ``argv`` exits ``code`` with one line naming ``names``; ``folder`` unchanged."""
    before = snapshot(folder)
    got, _, err = run_cli(argv)
    assert got == code, (got, err)
    assert_one_line_error(err, *names)
    assert snapshot(folder) == before
    return err


# -- fuzzing --------------------------------------------------------------------------------------

#: The settings every fuzzer derives from: the same cases on every run (``derandomize``), no
#: example database, no deadline (the machine is shared). ``FUZZ_SCALE=10`` runs ten times as many.
FUZZ_SCALE = max(1, int(os.environ.get("FUZZ_SCALE", "1")))
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],  # "explain" reruns cases for minutes
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def fuzz_settings(examples: int) -> settings:
    """:data:`FUZZ` with ``examples`` cases (times ``FUZZ_SCALE``)."""
    return settings(FUZZ, max_examples=examples * FUZZ_SCALE)


@contextmanager
def case_folders() -> Iterator[tuple[Path, Path]]:
    """A fresh ``(inputs, outputs)`` pair of folders for one fuzz case."""
    with tempfile.TemporaryDirectory(prefix="fuzz-") as root:
        inputs, outputs = Path(root) / "in", Path(root) / "out"
        inputs.mkdir()
        outputs.mkdir()
        yield inputs, outputs


def check_properties(
    argv: list[str], inputs: Path, outputs: Path, allowed: tuple[int, ...] = (0, 2)
) -> tuple[int, str, str]:
    """Run ``argv`` and check what must hold whatever the input.

    The exit code is one of ``allowed``; no traceback; the input folder is byte-identical
    afterwards; a refusal (2) prints one line and writes nothing; a failed verification (1)
    writes at most the report; a success writes a model that loads and validates.
    """
    before = snapshot(inputs)
    code, out, err = run_cli(argv)
    assert code in allowed, (code, err)
    assert "Traceback" not in err + out, err
    assert snapshot(inputs) == before, "the input changed"
    written = snapshot(outputs)
    if code == 2:
        assert_one_line_error(err)
        assert written == {}, written
    elif code == 1:
        assert set(written) <= {"r.json"}, written
    elif code == 0 and "-o" in argv:
        out_path = Path(argv[argv.index("-o") + 1])
        if out_path.parent == outputs:
            load_model(out_path)
    return code, out, err
