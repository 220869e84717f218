"""Kernel self-check: run every kernel package's test.json cases on this machine's adapter.

Each case runs with every variant whose conditions hold, outputs poisoned first, and is
compared with the package's numpy oracle (and with the literal expectation where the case
gives one). ``onnx-moe-fuse --self-check`` prints the table and exits non-zero on a failure.
"""

from __future__ import annotations

import re
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

Oracle = Callable[[dict[str, Any], dict[str, Any]], dict[str, np.ndarray]]


def _grouped_matmul(inputs: dict[str, Any], attrs: dict[str, Any]) -> dict[str, np.ndarray]:
    from .oracles.grouped_matmul import grouped_matmul

    return {
        "outputT": grouped_matmul(
            inputs["inputT"], inputs["weightsT"], inputs["groupIndicesT"], inputs.get("biasT")
        )
    }


#: Kernel name -> oracle taking the case's inputs (by bind key) and attributes.
ORACLES: dict[str, Oracle] = {"GroupedMatMul": _grouped_matmul}


@dataclass
class CheckResult:
    """The outcome of one case on one variant."""

    kernel: str
    case: str
    variant: str
    ok: bool
    detail: str


def _compare(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float) -> str | None:
    if actual.shape != expected.shape:
        return f"shape {actual.shape} != {expected.shape}"
    if actual.size and np.isnan(actual).any():
        return "unwritten (poisoned) elements"
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    if not np.allclose(a, e, rtol=rtol, atol=atol):
        return f"max abs error {np.abs(a - e).max():.3g}"
    return None


def run_self_check(seed: int | None = None) -> list[CheckResult]:
    """Run every test.json case of every kernel package that has an oracle."""
    from onnx_moe_fuse.kernels.cases import load_cases
    from onnx_moe_fuse.kernels.manifest import load_manifest
    from onnx_moe_fuse.kernels.runtime import get_kernel, package_folders

    seed = secrets.randbits(32) if seed is None else seed
    rng = np.random.default_rng(seed)
    results: list[CheckResult] = []
    for folder in package_folders():
        name = load_manifest(folder / "manifest.json").name
        oracle = ORACLES.get(name)
        if oracle is None or not (folder / "test.json").is_file():
            continue
        kernel = get_kernel(name)
        for case in load_cases(folder / "test.json"):
            inputs = case.materialize(rng)
            for variant in case.variants or kernel.variants:
                try:
                    kernel.plan(
                        **inputs,
                        attrs=case.attrs,
                        tunables=case.tunables,
                        device_limits=case.device_limits,
                        variant=variant,
                    )
                except ValueError as exc:
                    if case.error is not None and case.error in str(exc):
                        results.append(CheckResult(name, case.name, variant, True, "refused"))
                    elif case.error is None and "cannot run this call" in str(exc):
                        results.append(CheckResult(name, case.name, variant, True, "n/a"))
                    else:
                        results.append(CheckResult(name, case.name, variant, False, str(exc)))
                    continue
                try:
                    out = kernel(
                        **inputs,
                        attrs=case.attrs,
                        tunables=case.tunables,
                        device_limits=case.device_limits,
                        variant=variant,
                        poison_outputs=True,
                    )
                except ValueError as exc:
                    ok = case.error is not None and re.search(re.escape(case.error), str(exc))
                    results.append(
                        CheckResult(
                            name, case.name, variant, bool(ok), "refused" if ok else str(exc)
                        )
                    )
                    continue
                if case.error is not None:
                    results.append(
                        CheckResult(
                            name, case.name, variant, False, f"expected an error: {case.error}"
                        )
                    )
                    continue
                problems = []
                references = [("oracle", oracle(inputs, case.attrs))]
                if case.expected_arrays():
                    references.append(("test.json", case.expected_arrays()))
                for label, ref in references:
                    for key, value in ref.items():
                        problem = _compare(out[key], value, case.rtol, case.atol)
                        if problem:
                            problems.append(f"{key} vs {label}: {problem}")
                results.append(
                    CheckResult(name, case.name, variant, not problems, "; ".join(problems) or "ok")
                )
    return results


def print_self_check(results: list[CheckResult], device: str, out: TextIO = sys.stdout) -> bool:
    """Print a table of results; return whether every case passed."""
    print(f"kernel self-check on {device}", file=out)
    width = max((len(r.case) for r in results), default=10)
    for r in results:
        mark = "ok  " if r.ok else "FAIL"
        print(f"  {mark} {r.kernel:<16} {r.case:<{width}} {r.variant:<10} {r.detail}", file=out)
    failed = sum(not r.ok for r in results)
    print(f"{len(results) - failed} passed, {failed} failed", file=out)
    return failed == 0
