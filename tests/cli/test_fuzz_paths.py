"""Fuzzing paths and options: hostile names never crash, never write outside, never lose data.

Cases: input, ``-o`` and ``--report`` drawn from names that must be refused (a device, a
folder, ``/proc`` files, the empty name, the input itself or its data, a name too long, a NUL
byte) and from random names inside the output folder (unicode, spaces, newlines, dots), and
random text for ``--seeds``, ``--only`` and ``--target``. Properties: exit 0 or 2, one line on
refusal, the input folder byte-identical, nothing written on refusal; a refused name stays
refused (exit 2) whatever else the command line holds.
"""

from __future__ import annotations

import functools
from pathlib import Path

from cli_cases import SMALL, case_folders, check_properties, fuzz_settings, save_sample
from hypothesis import event, given
from hypothesis import strategies as st

_NAME_CHARS = st.characters(codec="utf-8", exclude_characters="/\x00", exclude_categories=["Cs"])
_NAMES = st.text(_NAME_CHARS, min_size=1, max_size=24).filter(lambda n: n not in (".", ".."))


@functools.cache
def _model_bytes() -> tuple[bytes, bytes]:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = save_sample(Path(folder), SMALL, file_name="m.onnx", external=True)
        return path.read_bytes(), (Path(folder) / "m.onnx.data").read_bytes()


def _refused_paths(inputs: Path, outputs: Path) -> list[str]:
    return [
        "/dev/null",
        "/dev/zero",
        "/",
        "/proc/self/status",
        "",
        str(outputs),
        str(inputs),
        str(inputs / "m.onnx"),
        str(inputs / "m.onnx.data"),
        str(outputs / ("x" * 300)),
        str(outputs / "no" / "such" / "folder.onnx"),
        str(outputs / "nul\x00.onnx"),
    ]


@st.composite
def _command(draw) -> tuple[str, str, str | None, list[str], bool]:
    """``(input, -o, --report, options, must_refuse)`` with ``{in}``/``{out}`` placeholders."""
    refuse = False

    def path(kind: str) -> str:
        nonlocal refuse
        if draw(st.integers(0, 2)) == 0:
            refuse = True
            return f"{{refused:{draw(st.integers(0, 11))}}}"
        return f"{{{kind}}}/{draw(_NAMES)}"

    # as the input, the input model itself ({refused:7}) is of course accepted
    source = "{in}/m.onnx" if draw(st.booleans()) else path("in")
    if source == "{refused:7}":
        refuse = False

    output = path("out")
    report = path("out") if draw(st.booleans()) else None
    options: list[str] = []
    for flag, values in (
        ("--seeds", st.one_of(st.just("0"), st.text(max_size=6))),
        ("--only", st.one_of(st.just("QMoE"), st.text(max_size=8))),
        ("--target", st.one_of(st.just("ort-cpu"), st.text(max_size=8))),
    ):
        if draw(st.integers(0, 3)) == 0:
            options += [flag, draw(values)]
    return source, output, report, options, refuse


def _fill(template: str, inputs: Path, outputs: Path) -> str:
    if template.startswith("{refused:"):
        return _refused_paths(inputs, outputs)[int(template[9:-1])]
    return template.replace("{in}", str(inputs)).replace("{out}", str(outputs))


@fuzz_settings(90)
@given(command=_command())
def test_hostile_paths_and_options(command):
    source, output, report, options, must_refuse = command
    with case_folders() as (inputs, outputs):
        model, data = _model_bytes()
        (inputs / "m.onnx").write_bytes(model)
        (inputs / "m.onnx.data").write_bytes(data)
        argv = [_fill(source, inputs, outputs), "-o", _fill(output, inputs, outputs)]
        if report is not None:
            argv += ["--report", _fill(report, inputs, outputs)]
        code = check_properties([*argv, *options], inputs, outputs)[0]
        if must_refuse:
            assert code == 2, argv
    event(f"exit {code}")
