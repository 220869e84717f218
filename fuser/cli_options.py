"""The command line's options: the parser, and the checks that run before any work.

Each single-value option may be given once (:class:`_Once`); :func:`check_combination` refuses an
option the command would ignore; :func:`parse_seeds` and :func:`parse_only` read ``--seeds`` and
``--only``. Every refusal is an :class:`~onnx_moe_fuse.errors.OptionError` naming the option,
which the command line (:mod:`onnx_moe_fuse.cli`) turns into exit 2.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from onnx_moe_fuse.contract.targets import DEFAULT_TARGET, TARGETS
from onnx_moe_fuse.errors import OptionError

_SEED_LIMIT = 2**63  # numpy's generators take any non-negative integer; keep it to int64


class _Once(argparse.Action):
    """Store an option's value, refusing a second one (``-o a -o b`` would drop ``a``)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        """Set the value, or raise :class:`OptionError` when the option was given already."""
        seen = namespace.__dict__.setdefault("_given", set())
        if self.dest in seen:
            raise OptionError(
                f"{'/'.join(self.option_strings)} is given twice ({getattr(namespace, self.dest)!r} "
                f"and {values!r}); give it once",
                option=option_string,
            )
        seen.add(self.dest)
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`OptionError` instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        """Turn argparse's complaint into an :class:`OptionError` (exit code 2)."""
        raise OptionError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="onnx-moe-fuse",
        description="Fuse mixture-of-experts layers of ONNX models into ONNX Runtime's "
        "QMoE / MoE / MatMulNBitsQkv nodes, and prove each rewrite on WebGPU.",
        epilog="Exit codes: 0 success, 1 verification or self-check failed (no output "
        "written), 2 bad input or options (nothing written), 3 no WebGPU adapter, "
        "4 internal error (--debug shows the traceback).",
    )
    parser.add_argument("input", nargs="?", help="the model to fuse (.onnx)")
    parser.add_argument(
        "-o", "--output", action=_Once, help="where to write the fused model (atomically)"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="run original and fused model on random inputs and compare "
        "(reference path vs WebGPU kernels and ONNX Runtime); a failure "
        "exits 1 and writes no model",
    )
    parser.add_argument(
        "--per-layer",
        action="store_true",
        help="with --verify: compare each fused layer with the region it replaced, one layer "
        "in memory at a time (the default for models with more than 256 MiB of external "
        "weights; smaller ones are verified whole)",
    )
    parser.add_argument(
        "--report", action=_Once, help="write a JSON report: fusions, near misses, verification"
    )
    parser.add_argument(
        "--only",
        action=_Once,
        help="comma-separated ops that may be emitted (MoE, QMoE, MatMulNBitsQkv; default all)",
    )
    parser.add_argument(
        "--target",
        action=_Once,
        choices=TARGETS,
        help="the ONNX Runtime package the fused nodes are written for: only ops it has "
        f"kernels for, with the attributes it accepts (default {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--quantize",
        action=_Once,
        metavar="int4|int8",
        help="opt-in, not exact: write float MoE layers as QMoE of their weights quantised "
        "(symmetric, round to nearest, scale max|w|/qmax per block); the report gives each "
        "layer's measured error and --verify compares with the float original at that tolerance",
    )
    parser.add_argument(
        "--block-size",
        action=_Once,
        type=int,
        metavar="N",
        help="--quantize's block along K: a power of two >= 16 dividing every layer's H and I, "
        "or 0 for per-channel scales (default 32 for int4, 0 for int8)",
    )
    parser.add_argument(
        "--accuracy-level",
        action=_Once,
        type=int,
        metavar="N",
        help="QMoE's accuracy_level (0-4) on every QMoE node, for targets that take it "
        "(ort-cpu); 4 computes with int8 activations (not exact)",
    )
    parser.add_argument(
        "--jobs",
        action=_Once,
        type=int,
        metavar="N",
        help="worker processes repacking the fused layers' weights, each one expert at a time, "
        "and layers verified at once by per-layer --verify (default: the CPUs this process "
        "may use for repacking, one layer at a time for verifying; 1 repacks in the main "
        "process)",
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="list near misses: layers that looked like MoE and why they did not fuse",
    )
    parser.add_argument(
        "--seeds", action=_Once, help="verification seeds (default 0,1,2; only with --verify)"
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        help="fuse and verify the embedded default sample (a Mixtral-like int4 layer)",
    )
    parser.add_argument(
        "--self-check",
        action="store_true",
        help="run every kernel package's test cases on this machine's WebGPU "
        "adapter against the numpy oracles",
    )
    parser.add_argument(
        "--list-adapters",
        action="store_true",
        help="list the WebGPU adapters wgpu finds, best first",
    )
    parser.add_argument(
        "--seed", action=_Once, type=int, help="random seed for --self-check (only with it)"
    )
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="print nothing but errors and warnings (no summary; not with --explain)",
    )
    parser.add_argument(
        "--debug", action="store_true", help="print the traceback of an internal error"
    )
    parser.add_argument("--version", action="version", version=f"onnx-moe-fuse {version_text()}")
    return parser


def version_text() -> str:
    """The installed package's version (the source tree's when not installed)."""
    from importlib import metadata

    try:
        return metadata.version("onnx-moe-fuse")
    except metadata.PackageNotFoundError:
        from onnx_moe_fuse import __version__

        return __version__


# -- options --------------------------------------------------------------------------------------


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``; :class:`OptionError` naming ``--seeds`` otherwise."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise OptionError(
            f"--seeds must be integers separated by commas, such as 0,1,2: got {text!r}",
            option="--seeds",
        )
    seeds = []
    for part in parts:
        if not part.isdecimal() or not part.isascii():
            raise OptionError(
                f"--seeds: {part!r} is not a non-negative integer (seeds are 0 or more)",
                option="--seeds",
            )
        seed = int(part)
        if seed >= _SEED_LIMIT:
            raise OptionError(f"--seeds: {part} is too large (under 2**63)", option="--seeds")
        seeds.append(seed)
    return seeds


def parse_only(text: str | None) -> set[str] | None:
    """``"QMoE,MoE"`` -> ``{"QMoE", "MoE"}``; unknown or no op: :class:`OptionError`."""
    from onnx_moe_fuse.pipeline import ALL_FUSED_OPS

    if text is None:
        return None
    ops = {op.strip() for op in text.split(",") if op.strip()}
    unknown = sorted(ops - ALL_FUSED_OPS)
    if not ops or unknown:
        what = f"unknown ops {unknown}" if unknown else "no op named"
        raise OptionError(
            f"--only: {what}; choose among {', '.join(sorted(ALL_FUSED_OPS))}", option="--only"
        )
    return ops


def _no_effect(option: str, why: str) -> OptionError:
    return OptionError(f"{option} has no effect {why}; drop it", option=option)


def check_combination(args: argparse.Namespace) -> None:
    """Refuse options that would be ignored (or contradict each other) in this command.

    An ignored option is a mistake the user would not see: ``--seeds`` without ``--verify``
    verifies nothing, a second ``-o`` would drop the first (:class:`_Once`).
    """
    if args.list_adapters and args.self_check:
        raise OptionError(
            "--list-adapters and --self-check: give one of them", option="--self-check"
        )
    fuse_options = {
        "input": args.input,
        "-o": args.output,
        "--report": args.report,
        "--only": args.only,
        "--target": args.target,
        "--quantize": args.quantize,
        "--block-size": args.block_size,
        "--accuracy-level": args.accuracy_level,
        "--jobs": args.jobs,
        "--per-layer": args.per_layer,
        "--seeds": args.seeds,
        "--verify": args.verify,
        "--explain": args.explain,
        "--demo": args.demo,
    }
    for command, on in (("--list-adapters", args.list_adapters), ("--self-check", args.self_check)):
        if on:
            for option, value in fuse_options.items():
                if value not in (None, False):
                    shown = f"the model {value!r}" if option == "input" else option
                    raise _no_effect(shown, f"with {command}")
    if args.seed is not None and not args.self_check:
        raise _no_effect("--seed", "without --self-check (--seeds sets verification seeds)")
    if args.jobs is not None and args.jobs < 1:
        raise OptionError(f"--jobs must be 1 or more, got {args.jobs}", option="--jobs")
    if args.per_layer and not args.verify:
        raise _no_effect("--per-layer", "without --verify")
    if args.seeds is not None and not (args.verify or args.demo):
        raise _no_effect("--seeds", "without --verify")
    if args.demo and args.input:
        raise OptionError(
            f"--demo fuses the embedded sample: the model {args.input!r} would be ignored; "
            "give one of them",
            option="--demo",
        )
    if args.quiet and args.explain:
        raise OptionError("--quiet and --explain contradict each other; drop one", option="--quiet")
    if args.quiet and args.list_adapters:
        raise _no_effect("--quiet", "with --list-adapters (listing is all it does)")


def folder_like(path: str) -> bool:
    """``out/`` or ``out/.``: a name the user meant as a folder (``Path`` would drop the ``/``)."""
    seps = tuple(sep for sep in (os.sep, os.altsep) if sep)
    return path.endswith(seps) or Path(path).name in ("", ".", "..")
