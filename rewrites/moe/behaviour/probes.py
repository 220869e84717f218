"""The probe grid, the tolerance and the comparison the behaviour checks share.

Probe values (:func:`probe_values`) are float32 numbers chosen where spellings of one function
part ways: signed zeros, tiny and subnormal values, a dense grid over [-8, 8], the overflow
edges of ``exp`` (±88, ±89), large magnitudes up to ±1e4, and every constant of the region with
its negation and the float32 numbers one ulp either side (the clamp points of a ``Clip``/``Min``
/``Max``, the offsets of an ``Add``).

The tolerance (:func:`deviation`): a probe agrees when ``|model - candidate| <= rtol * (|candidate|
+ scale) + atol``, ``rtol = 8 * eps`` of the layer's float type (9.5e-7 for float32), ``atol`` the
same 8 ulp at its smallest normal number (subnormal results round by whole ulps), ``scale`` the
magnitude of the operands the candidate multiplies (``|x|``; for SwiGLU ``|g| * (|l| + |beta|)``
of the clamped operands). Why: the region is evaluated in the layer's own float type, op by op,
against the candidate computed in float64; each op rounds by half an ulp and ``exp``/``tanh``/
``erf`` add an ulp or two, so a chain of a few ops is within a few ulp of the result, and a
spelling that cancels (``x * (1 - sigmoid(-x))``, ``0.5 x (1 + tanh(x / 2))`` for x << 0) loses
at most an ulp of the operands' size, which the ``scale`` term allows. A wrong constant, a
swapped operand, a clamp at another point or a missing term is off by orders of magnitude more
at some probe (the near-miss tests show the margins). NaN agrees only with NaN, an infinity
with the same infinity.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Deviation",
    "atol_for",
    "deviation",
    "in_dtype",
    "probe_values",
    "rtol_for",
    "small_values",
]

_F32 = np.float32
_BASE = np.array(
    [0.0, -0.0, 1.4e-45, 1e-38, 1e-30, 1e-20, 1e-10, 1e-7, 1e-4, 1e-2, 0.1, 0.25, 0.5, 1.0,
     1.5, 2.0, 3.0, 5.0, 8.0, 10.0, 12.0, 15.0, 20.0, 30.0, 40.0, 50.0, 80.0, 88.0, 89.0,
     100.0, 1e3, 1e4],
    dtype=_F32,
)  # fmt: skip
_SMALL = np.array([0.0, 1e-30, 1e-4, 0.5, 1.0, 2.0, 4.0, 10.0, 30.0, 88.0, 1e4], dtype=_F32)


def _with_neighbours(values: Iterable[float]) -> np.ndarray:
    out = []
    for c in values:
        c = _F32(c)
        if not np.isfinite(c) or abs(c) > 1e4:
            continue
        for v in (c, -c):
            out += [v, np.nextafter(v, _F32(np.inf)), np.nextafter(v, _F32(-np.inf))]
    return np.array(out, dtype=_F32)


def probe_values(constants: Iterable[float] = ()) -> np.ndarray:
    """The 1-D probe values (float32, both signs), with each constant and its neighbours."""
    dense = np.linspace(-8.0, 8.0, 97, dtype=_F32)
    grid = np.concatenate([_BASE, -_BASE, dense, _with_neighbours(constants)])
    # unique by bit pattern: keeps -0.0 apart from 0.0 (np.unique of floats would merge them)
    return np.unique(grid.view(np.uint32)).view(_F32)


def small_values(constants: Iterable[float] = ()) -> np.ndarray:
    """A short probe list for the second operand of a two-operand grid (plus the clamp points)."""
    return np.unique(
        np.concatenate([_SMALL, -_SMALL, _with_neighbours(constants)]).view(np.uint32)
    ).view(_F32)


def rtol_for(dtype: np.dtype) -> float:
    """8 ulp at 1.0 of the layer's float type (float32: 9.5e-7)."""
    return 8.0 * float(np.finfo(dtype).eps)


def atol_for(dtype: np.dtype) -> float:
    """The same 8 ulp at the smallest normal number (float32: 1.1e-44).

    Below it results round by whole subnormal ulps (``0.5 * 1.4e-45`` is 0 in float32), which
    is rounding, not a different function.
    """
    return rtol_for(dtype) * float(np.finfo(dtype).smallest_normal)


@dataclass(frozen=True)
class Deviation:
    """The largest normalised deviation over the probes (<= 1 agrees) and where it is."""

    worst: float  # |model - candidate| / tolerance at the worst probe (inf: NaN or inf apart)
    at: int  # the flat index of that probe
    model: float
    candidate: float
    failing: float = 0.0  # the fraction of probes that disagree

    @property
    def agrees(self) -> bool:
        return self.worst <= 1.0

    @property
    def rank(self) -> tuple[float, float]:
        """How far off, for naming the closest candidate: fewest disagreeing probes, then worst."""
        return (self.failing, self.worst)


def in_dtype(candidate: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``candidate`` (float64) where it overflows ``dtype``: there the fused op's output is ±inf.

    The fused op computes in float32 (or wider) and rounds its output to the layer's type once,
    so a value past that type's largest finite one (float16: 65504) comes out as an infinity of
    its sign, as the region's does; every other value is kept unrounded (the tolerance covers
    rounding).
    """
    with np.errstate(all="ignore"):
        rounded = candidate.astype(dtype).astype(np.float64)
    return np.where(np.isinf(rounded) & np.isfinite(candidate), rounded, candidate)


def deviation(
    model: np.ndarray,
    candidate: np.ndarray,
    scale: np.ndarray,
    rtol: float,
    atol: float | np.ndarray = 0.0,
) -> Deviation:
    """Compare ``model`` (the region) with ``candidate`` per probe (arrays of one shape).

    ``atol``: the absolute floor (:func:`atol_for`: subnormal results round by whole ulps).
    """
    m = model.astype(np.float64).reshape(-1)
    c = np.broadcast_to(candidate, model.shape).astype(np.float64).reshape(-1)
    s = np.broadcast_to(scale, model.shape).astype(np.float64).reshape(-1)
    a = np.broadcast_to(atol, model.shape).astype(np.float64).reshape(-1)
    with np.errstate(all="ignore"):
        diff = np.abs(m - c)
        tol = rtol * (np.abs(c) + np.abs(s)) + a
        d = np.where(diff == 0, 0.0, diff / np.maximum(tol, 1e-300))
    same = (m == c) | (np.isnan(m) & np.isnan(c))
    d = np.where(same, 0.0, d)
    d = np.where(~same & (~np.isfinite(m) | ~np.isfinite(c)), np.inf, d)
    i = int(np.argmax(d))
    return Deviation(float(d[i]), i, float(m[i]), float(c[i]), float(np.mean(d > 1.0)))
