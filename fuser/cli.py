"""The ``onnx-moe-fuse`` command line.

    onnx-moe-fuse IN.onnx -o OUT.onnx [--verify [--seeds 0,1,2]] [--report REPORT.json]
                  [--only QMoE,MoE] [--target ort-cpu|ort-cuda|ort-webgpu] [--explain | --quiet]
                  [--quantize int4|int8 [--block-size N]] [--accuracy-level N] [--jobs N] [--debug]
    onnx-moe-fuse --demo [-o OUT.onnx] [--report REPORT.json] [--seeds 0,1,2] [--explain]
    onnx-moe-fuse --self-check [--seed N] | --list-adapters | --version

Exit codes (:data:`EXIT_OK` ...): 0 success (also when nothing fused: the report says so);
1 verification or self-check failed (no model written); 2 bad input or options: one line on
stderr naming the file, tensor, attribute or option, and nothing written (a write the file
system refuses, a full disk, is one: :func:`onnx_moe_fuse.errors.user_error_in` finds it under
the pass manager's wrapping); 3 no WebGPU adapter for a command that needs one; 4 an internal
error (a bug of ours: a short message, the traceback only with ``--debug``); 130 Ctrl-C, 143
SIGTERM, 129 SIGHUP: the run unwinds as for an error, removing the files it had begun.

Everything that can be checked before work starts is checked first, in this order: the options
(each single-value option given once, :class:`_Once`; no option that this command would ignore,
:func:`check_combination`; ``--seeds``, ``--only``, ``--target``, ``--quantize``/``--block-size``,
``--accuracy-level``), the output paths (a
folder-like ``-o dir/`` is refused; :func:`onnx_moe_fuse.io.output_paths.check_output_paths`:
none may be the input, its data or another output; their folders must exist and take files),
the input model (:func:`onnx_moe_fuse.io.model_io.load_model` validates it), the WebGPU
adapter. Outputs are written last, each atomically.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from onnx_moe_fuse.cli_options import (
    build_parser,
    check_combination,
    folder_like,
    parse_only,
    parse_seeds,
)
from onnx_moe_fuse.cli_summary import (
    print_fusions,
    print_layers,
    print_near_misses,
    write_json_atomic,
)
from onnx_moe_fuse.cli_verify import LayersFailed, adapter_name, layer_check, per_layer
from onnx_moe_fuse.contract.targets import DEFAULT_TARGET, Target
from onnx_moe_fuse.errors import MoEFuseError, OptionError, user_error_in
from onnx_moe_fuse.io.output_paths import one_line

if TYPE_CHECKING:
    from onnx_moe_fuse.progress import Progress
    from onnx_moe_fuse.rewrites.moe.quantize import Quantization

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_ADAPTER, EXIT_INTERNAL = 0, 1, 2, 3, 4


def _error(message: str, code: int) -> int:
    print(f"onnx-moe-fuse: {message}", file=sys.stderr)
    return code


def _warn_stale_data(output: str, written: list[Path]) -> None:
    """Say so when ``OUT.onnx.data`` of an earlier run sits beside an output written inline."""
    from onnx_moe_fuse.io.model_io import data_file_for

    data = data_file_for(output)
    if data.name not in {p.name for p in written} and (data.exists() or data.is_symlink()):
        print(
            f"onnx-moe-fuse: warning: {str(data)!r} is from an earlier run: {output!r} keeps "
            "its weights inline and does not read it (left as it was; delete it if unused)",
            file=sys.stderr,
        )


# -- commands -------------------------------------------------------------------------------------


def _check_paths(args: argparse.Namespace, input_path: Path | None) -> None:
    from onnx_moe_fuse.errors import OutputPathError
    from onnx_moe_fuse.io.model_io import data_file_for, input_files
    from onnx_moe_fuse.io.output_paths import check_output_paths

    for option, value in (("-o", args.output), ("--report", args.report)):
        if value and (folder_like(value) or os.path.isdir(value)):  # isdir never raises
            raise OptionError(
                f"{option} {value!r} is a folder (or names one); name a file, such as "
                f"{os.path.join(value, 'fused.onnx' if option == '-o' else 'report.json')!r}",
                option=option,
            )
    outputs: dict[str, Path] = {}
    if args.output:
        outputs["-o"] = Path(args.output)
        try:
            outputs["the data file of -o"] = data_file_for(args.output)
        except OutputPathError as exc:
            raise OutputPathError(f"-o: {exc}", path=args.output) from None
    if args.report:
        outputs["--report"] = Path(args.report)
    check_output_paths(outputs, protected=input_files(input_path))


def _needs_adapter() -> int | str:
    """The WebGPU adapter's description, or the exit code when there is none."""
    from onnx_moe_fuse.kernels import NoAdapterError, default_device

    try:
        return default_device().description
    except NoAdapterError as exc:
        return _error(f"--verify needs a WebGPU adapter: {exc}", EXIT_NO_ADAPTER)


def _fuse_command(args: argparse.Namespace) -> int:
    from onnx_moe_fuse import api
    from onnx_moe_fuse.io.model_io import load_model, save_model_atomic
    from onnx_moe_fuse.pipeline.quantized_layers import check_accuracy_level
    from onnx_moe_fuse.progress import Progress

    progress = Progress(quiet=args.quiet)

    seeds = parse_seeds("0,1,2" if args.seeds is None else args.seeds)
    only = parse_only(args.only)
    target = api.check_target(args.target or DEFAULT_TARGET)  # parsed once, handed down as it is
    quantization = api.check_quantization(
        args.quantize,
        args.block_size,
        target,
        None if only is None else frozenset(only),
        option="--quantize",
    )
    check_accuracy_level(args.accuracy_level, target)
    if args.demo:
        input_path = None
    else:
        if not args.input:
            raise OptionError(
                "give a model to fuse (or --demo, --self-check, --list-adapters)", option="input"
            )
        if not args.output:
            raise OptionError("give the output path with -o OUT.onnx", option="-o")
        input_path = Path(args.input)
    _check_paths(args, input_path)
    if not args.demo and (not args.verify or per_layer(args, input_path)):
        # weights stay on disk: docs/architecture.md, "Memory"; --verify then goes layer by layer
        if args.verify:
            adapter = _needs_adapter()
            if isinstance(adapter, int):
                return adapter
        return _fuse_streaming(args, input_path, only, target, progress, quantization, seeds)
    if args.demo:
        from onnx_moe_fuse.samples import default_sample

        sample = default_sample()
        print(f"demo: sample {sample.name}: {sample.description}")
        original = sample.model
    else:
        with progress.stage("load"):
            original = load_model(input_path)
    adapter = None
    if args.verify or args.demo:
        adapter = _needs_adapter()
        if isinstance(adapter, int):
            return adapter

    result = api.fuse(
        original,
        only=only,
        target=target,
        progress=progress,
        quantize=args.quantize,
        block_size=args.block_size,
        accuracy_level=args.accuracy_level,
    )
    report: dict[str, Any] = {
        "input": str(input_path) if input_path else "demo sample",
        "output": args.output,
        "target": target.name,
        **result.report.to_dict(),
    }
    print_fusions(report, target, args.explain)
    if args.explain:
        print_near_misses(report)

    ok = True
    if args.verify or args.demo:
        from onnx_moe_fuse.verify.checker import verify
        from onnx_moe_fuse.verify.quant_error import verify_tolerance

        if result.fused:
            with progress.stage("verify"):
                verification = verify(
                    original,
                    result.model,
                    seeds=seeds,
                    quantization=verify_tolerance(result.report.fusions),
                )
                progress.detail = "passed" if verification.passed else "FAILED"
            report["verification"] = verification.to_dict()
            print(verification.summary())
            ok = verification.passed
        else:
            report["verification"] = {
                "passed": True,
                "note": "nothing fused: the output equals the input",
            }
            print("verification: nothing fused, nothing to verify")
    if not ok:
        if args.report:
            report["run"] = progress.run_section(adapter)
            write_json_atomic(args.report, report)
        return _error("verification FAILED: no model written", EXIT_FAILED)
    if args.output:
        with progress.stage("save"):
            written = save_model_atomic(result.model, args.output, input_path=input_path)
        print("wrote " + ", ".join(str(p) for p in written))
        _warn_stale_data(args.output, written)
    if args.report:
        report["run"] = progress.run_section(adapter)
        write_json_atomic(args.report, report)
        print(f"wrote {args.report}")
    return EXIT_OK


def _fuse_streaming(
    args: argparse.Namespace,
    input_path: Path,
    only: set[str] | None,
    target: Target,
    progress: Progress,
    quantization: Quantization | None = None,
    seeds: list[int] | None = None,
) -> int:
    """Fuse a model file streaming (:func:`onnx_moe_fuse.streaming_io.fuse_file`).

    With ``--verify`` each fused layer is verified against its original region before the
    output is moved into place (:func:`onnx_moe_fuse.verify.layers.verify_layers`); a failure
    exits 1 and leaves no model.
    """
    from onnx_moe_fuse.streaming_io import fuse_file

    verification: dict[str, Any] = {}
    check = layer_check(args, input_path, seeds or [0], progress, verification)
    try:
        result = fuse_file(
            input_path,
            args.output,
            only=only,
            target=target,
            progress=progress,
            quantize=quantization,
            accuracy_level=args.accuracy_level,
            jobs=args.jobs,
            check=check,
        )
    except LayersFailed as failed:
        print_layers(verification)
        if args.report:
            failed.report["verification"] = verification
            failed.report["run"] = progress.run_section(adapter_name())
            write_json_atomic(args.report, failed.report)
        return _error("verification FAILED: no model written", EXIT_FAILED)
    report: dict[str, Any] = {
        "input": str(input_path),
        "output": args.output,
        "target": target.name,
        **result.report.to_dict(),
    }
    print_fusions(report, target, args.explain)
    if args.explain:
        print_near_misses(report)
    if args.verify:
        report["verification"] = verification or {
            "passed": True,
            "note": "nothing fused: the output equals the input",
        }
        report["run"] = progress.run_section(adapter_name())
        print_layers(verification)
    print("wrote " + ", ".join(str(p) for p in result.written))
    _warn_stale_data(args.output, result.written)
    if args.report:
        write_json_atomic(args.report, report)
        print(f"wrote {args.report}")
    return EXIT_OK


def _self_check(args: argparse.Namespace) -> int:
    from onnx_moe_fuse.kernels import NoAdapterError, default_device
    from onnx_moe_fuse.verify.selfcheck import print_self_check, run_self_check

    try:
        device = default_device()
    except NoAdapterError as exc:
        return _error(str(exc), EXIT_NO_ADAPTER)
    ok = print_self_check(run_self_check(args.seed), device.description)
    return EXIT_OK if ok else EXIT_FAILED


def _run(args: argparse.Namespace) -> int:
    check_combination(args)
    if not args.quiet:
        return _dispatch(args)
    with open(os.devnull, "w", encoding="utf-8") as nowhere, contextlib.redirect_stdout(nowhere):
        return _dispatch(args)


def _dispatch(args: argparse.Namespace) -> int:
    if args.list_adapters:
        from onnx_moe_fuse.kernels import list_adapters

        for kind, description in list_adapters():
            print(f"{kind:<11} {description}")
        return EXIT_OK
    if args.self_check:
        return _self_check(args)
    if args.demo or args.input or args.output:
        return _fuse_command(args)
    build_parser().print_help()
    return EXIT_USAGE


def _bad_input_message(exc: MoEFuseError) -> str:
    """The one line for a user's error; advice the command line can follow where it differs."""
    from onnx_moe_fuse.verify.feeds import FeedTooLargeError

    if isinstance(exc, FeedTooLargeError):  # its own advice names the API's dim_values
        return (
            f"--verify: {' '.join(exc.detail.split())}: fuse without --verify (the model is "
            "then written unverified), or verify a model whose inputs have smaller fixed dims"
        )
    return one_line(exc)


class _Signalled(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C, so every ``finally`` cleans up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


#: The signals that stop a run cleanly (exit 128 + the signal's number), as Ctrl-C does.
_STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


def _stop(signum: int, frame: object) -> NoReturn:
    for other in _STOP_SIGNALS:  # a second signal must not interrupt the cleanup
        signal.signal(other, signal.SIG_IGN)
    raise _Signalled(signum)


@contextlib.contextmanager
def _stop_signals_unwind() -> Iterator[None]:
    """SIGTERM/SIGHUP raise :class:`_Signalled` while the command runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _stop) for signum in _STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script: returns the exit code (see the module docstring)."""
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        with _stop_signals_unwind():
            args = build_parser().parse_args(argv)
            return _run(args)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    except KeyboardInterrupt:
        return _error("interrupted; the files this run had begun are removed", 130)
    except _Signalled as exc:
        name = signal.Signals(exc.signum).name
        return _error(
            f"stopped by {name}; the files this run had begun are removed", 128 + exc.signum
        )
    except Exception as exc:  # every error leaves through here: one line, a code that means it
        found = user_error_in(exc)  # a pass manager may wrap ours (a full disk while fusing)
        if found is not None:
            return _error(_bad_input_message(found), EXIT_USAGE)
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (rerun with --debug for the traceback)"
        return _error(
            f"internal error: {type(exc).__name__}: {one_line(exc)}{hint}; nothing written; "
            "please report it",
            EXIT_INTERNAL,
        )


if __name__ == "__main__":
    sys.exit(main())
