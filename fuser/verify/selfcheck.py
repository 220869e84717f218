"""Kernel self-check: run every kernel package's test.json cases on this machine's adapter.

Each case runs with every variant it names (every variant of the package when it names none),
forced, outputs poisoned first, and is compared with the package's numpy oracle
(:data:`onnx_moe_fuse.verify.oracles.kernel_calls.KERNEL_ORACLES`) and with the literal expectation
where the case gives one. A variant whose conditions do not hold for the call counts as "n/a"
(an optional output such as MatMulNBitsQkv's ``residualT`` is asked for where the variant needs
it); a case that expects an error passes when the call raises it. ``onnx-moe-fuse --self-check``
prints the table and exits non-zero on a failure.
"""

from __future__ import annotations

import secrets
import sys
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from onnx_moe_fuse.verify.oracles.kernel_calls import KERNEL_ORACLES, KernelOracle

#: Kernel name -> oracle taking the case's inputs (by bind key) and attributes.
ORACLES: dict[str, KernelOracle] = KERNEL_ORACLES

#: How the planner words a forced variant whose conditions fail.
_NOT_APPLICABLE = "cannot run this call"


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


def _plan(kernel: Any, inputs: dict, case: Any, variant: str) -> Any:
    """Plan the call; a variant that needs the optional outputs is retried asking for them."""
    settings = dict(attrs=case.attrs, tunables=case.tunables, device_limits=case.device_limits)
    optional = [t.bind_key for t in kernel.manifest.outputs if t.optional]
    try:
        return kernel.plan(**inputs, **settings, variant=variant)
    except ValueError as exc:
        if not optional or _NOT_APPLICABLE not in str(exc):
            raise
        try:
            return kernel.plan(**inputs, **settings, variant=variant, optional_outputs=optional)
        except ValueError:
            raise exc from None


def _check_case(
    kernel: Any, oracle: KernelOracle, case: Any, inputs: dict, variant: str
) -> tuple[bool, str]:
    """``(ok, detail)`` of one case on one variant."""
    try:
        out = kernel.run(_plan(kernel, inputs, case, variant), poison_outputs=True)
    except ValueError as exc:
        if case.error is not None and case.error in str(exc):
            return True, "refused"
        if case.error is None and _NOT_APPLICABLE in str(exc):
            return True, "n/a"
        return False, str(exc)
    if case.error is not None:
        return False, f"expected an error: {case.error}"
    optional = {t.bind_key for t in kernel.manifest.outputs if t.optional}
    problems = []
    references = [("oracle", oracle(inputs, case.attrs))]
    if case.expected_arrays():
        references.append(("test.json", case.expected_arrays()))
    for label, ref in references:
        for key, value in ref.items():
            if key not in out:
                if key not in optional:  # else: an optional output this variant leaves out
                    problems.append(f"{key} vs {label}: not produced")
                continue
            problem = _compare(out[key], value, case.rtol, case.atol)
            if problem:
                problems.append(f"{key} vs {label}: {problem}")
    return not problems, "; ".join(problems) or "ok"


def run_self_check(seed: int | None = None) -> list[CheckResult]:
    """Run every test.json case of every kernel package that has an oracle."""
    from onnx_moe_fuse.kernels import get_kernel, load_cases, load_manifest, package_folders

    seed = secrets.randbits(32) if seed is None else seed
    rng = np.random.default_rng(seed)
    results: list[CheckResult] = []
    for folder in package_folders():
        manifest = load_manifest(folder / "manifest.json")
        oracle = ORACLES.get(manifest.name)
        if oracle is None or not (folder / "test.json").is_file():
            continue
        kernel = get_kernel(manifest.qualified_name, manifest.version)
        for case in load_cases(folder / "test.json"):
            inputs = case.materialize(rng)
            for variant in case.variants or kernel.variants:
                ok, detail = _check_case(kernel, oracle, case, inputs, variant)
                results.append(CheckResult(manifest.name, case.name, variant, ok, detail))
    return results


def print_self_check(results: list[CheckResult], device: str, out: TextIO = sys.stdout) -> bool:
    """Print a table of results; return whether every case passed."""
    print(f"kernel self-check on {device}", file=out)
    width = max((len(r.case) for r in results), default=10)
    vwidth = max((len(r.variant) for r in results), default=10)
    for r in results:
        mark = "ok  " if r.ok else "FAIL"
        print(
            f"  {mark} {r.kernel:<16} {r.case:<{width}} {r.variant:<{vwidth}} {r.detail}", file=out
        )
    failed = sum(not r.ok for r in results)
    print(f"{len(results) - failed} passed, {failed} failed", file=out)
    return failed == 0
