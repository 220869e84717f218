"""Comparing a path's outputs with the reference: errors, tolerances by dtype and path.

The measure and the defaults are the checker's (:mod:`onnx_moe_fuse.verify.checker` explains
them): ``max_abs = max|fused - reference|``, ``max_rel = max_abs / max|reference|``; an output
passes when ``max_abs <= max(rtol * max|reference|, atol)``, with ``(rtol, atol)`` from
:data:`DEFAULT_TOLERANCES` by the reference's dtype, loosened on the ORT path to
:data:`ORT_INT8_ACTIVATION_RTOL` where ORT quantises activations to int8.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np

from onnx_moe_fuse.verify.quant_error import QuantizedTolerance
from onnx_moe_fuse.verify.report import OutputResult, PathResult, SeedError

__all__ = ["DEFAULT_TOLERANCES", "ORT_INT8_ACTIVATION_RTOL", "compare_outputs"]

#: ``(rtol, atol)`` by the reference output's dtype name; see the checker's docstring.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-4, 1e-6),
    "float32": (1e-4, 1e-6),
    "float16": (1e-2, 1e-3),
    "bfloat16": (5e-2, 1e-2),
}
#: rtol on the ORT path where ORT quantises activations to int8 (measured error 1-2%).
ORT_INT8_ACTIVATION_RTOL = 5e-2
_FLOAT_DTYPES = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)}
_FLOAT_DTYPES.add(np.dtype(ml_dtypes.bfloat16))


def _errors(actual: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """``(max_abs, max_rel)`` with max_rel relative to ``max|expected|``; non-finite aware."""
    if actual.size == 0:
        return 0.0, 0.0
    if actual.dtype == np.bool_ or expected.dtype == np.bool_:
        diff = float(np.count_nonzero(actual != expected))
        return diff, diff
    a = actual.astype(np.float64)
    b = expected.astype(np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    diff = np.where(same, 0.0, np.abs(a - b))
    diff = np.where(np.isnan(diff), np.inf, diff)
    max_abs = float(diff.max())
    finite = np.abs(b[np.isfinite(b)])
    scale = float(finite.max()) if finite.size else 0.0
    if max_abs == 0.0:
        return 0.0, 0.0
    return max_abs, (max_abs / scale if scale > 0 else math.inf)


def _tolerance(
    dtype: np.dtype,
    path: str,
    rtol: float | None,
    atol: float | None,
    inexact: Sequence[str],
    quantized: QuantizedTolerance | None = None,
) -> tuple[float, float, str | None]:
    """``(rtol, atol, note)`` for one output on one path.

    ``quantized``: the model has layers quantised on request; their tolerance replaces the
    exact default, and ORT's int8 activations (``inexact``) add theirs on the ORT path.
    """
    if dtype not in _FLOAT_DTYPES:
        return 0.0, 0.0, None  # integers and booleans: exact
    d_rtol, d_atol = DEFAULT_TOLERANCES.get(dtype.name, DEFAULT_TOLERANCES["float32"])
    note = None
    if dtype.name in ("float16", "bfloat16"):
        note = (
            f"{dtype.name} output: rtol {d_rtol:g}, atol {d_atol:g} (the reference rounds once "
            "from float64; runtimes round intermediates to the narrow type)"
        )
    if quantized is not None:
        d_rtol = max(d_rtol, quantized.rtol)
        note = quantized.note
        if path == "ort" and inexact:  # int8 activations on top of the quantised weights
            d_rtol += ORT_INT8_ACTIVATION_RTOL
            note += (
                f"; plus {ORT_INT8_ACTIVATION_RTOL:g} on the ORT path (rtol {d_rtol:.3g}): "
                + "; ".join(inexact)
            )
    elif path == "ort" and inexact and d_rtol < ORT_INT8_ACTIVATION_RTOL:
        d_rtol = ORT_INT8_ACTIVATION_RTOL
        note = f"rtol loosened to {d_rtol:g} on the ORT path: " + "; ".join(inexact)
    if rtol is not None or atol is not None:
        r = d_rtol if rtol is None else float(rtol)
        a = d_atol if atol is None else float(atol)
        given = f"rtol {r:g}, atol {a:g} given by the caller"
        return r, a, given if note is None else f"{given} (default here: {note})"
    return d_rtol, d_atol, note


def compare_outputs(
    result: PathResult,
    seed: int,
    reference: Mapping[str, np.ndarray],
    got: Mapping[str, np.ndarray],
    rtol: float | None,
    atol: float | None,
    inexact: Sequence[str],
    messages: list[str],
    quantized: QuantizedTolerance | None = None,
) -> None:
    """Compare one seed's outputs ``got`` of a path with the ``reference``; record in ``result``.

    A failure adds a message naming the path, output, seed and error to ``messages``.
    """
    for name, expected in reference.items():
        expected = np.asarray(expected)
        out = result.outputs.get(name)
        if out is None:
            r, a, note = _tolerance(expected.dtype, result.path, rtol, atol, inexact, quantized)
            out = result.outputs[name] = OutputResult(name, expected.dtype.name, r, a)
            if note and note not in result.tolerance_notes:
                result.tolerance_notes.append(note)
        where = f"{result.path}: output {name!r}, seed {seed}"
        if name not in got or got[name] is None:
            out.problem = "the fused model does not produce this output"
            messages.append(f"FAILED {where}: the fused model does not produce it")
            continue
        actual = np.asarray(got[name])
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            out.problem = (
                f"fused gives {actual.dtype}{list(actual.shape)}, "
                f"reference {expected.dtype}{list(expected.shape)}"
            )
            out.per_seed.append(SeedError(seed, math.inf, math.inf, False))
            messages.append(f"FAILED {where}: {out.problem}")
            continue
        max_abs, max_rel = _errors(actual, expected)
        finite = np.abs(expected[np.isfinite(expected)]) if expected.size else expected
        scale = float(finite.max()) if finite.size else 0.0
        ok = max_abs <= max(out.rtol * scale, out.atol)
        out.per_seed.append(SeedError(seed, max_abs, max_rel, ok))
        if not ok:
            messages.append(
                f"FAILED {where}: max abs error {max_abs:.3e}, max rel error {max_rel:.3e} "
                f"(relative to max|reference| = {scale:.3e}) exceeds rtol {out.rtol:g} / "
                f"atol {out.atol:g}"
            )
