"""The activation between FC1 (+FC3) and FC2 proved by behaviour: probed, compared, fitted.

:func:`prove_activation` takes the element-wise region FC2 reads (:mod:`.region`) and the FC1
sources' widths and returns what the fused node must compute: ``(activation_type, columns,
(alpha, beta, limit))``, ``columns`` FC1's columns in the fused node's order (for SwiGLU, row
``2j`` the gate and ``2j + 1`` the linear operand of output column ``j``). Steps:

1. columns, symbolically (:func:`.columns.column_sources`): which FC1 columns each output column
   reads; one each is an element-wise activation, two each a gated one (a third is refused);
2. the region's scalar constants give the candidates' parameters: SwiGLU's ``alpha`` from
   ``{1, ±c, ±1/c}`` of the factors (``Mul``/``Div``), ``beta`` from ``{0, c, -c}`` of the
   addends (``Add``/``Sub``), ``swiglu_limit`` from ``{none, |c|}`` of the clamp bounds
   (``Clip``/``Min``/``Max``); a constant read by any other op may be any of the three;
3. the region is evaluated per op in the layer's float type on the probe grid
   (:mod:`.probes`), spread over the output columns (every column computes the same function,
   step 1 proved it), the two operands of a gated activation on a two-axis grid, so gate and
   linear are probed independently and both role assignments are tried;
4. each activation the fused ops offer (ORT's formulas: relu ``max(x, 0)``, gelu the tanh form
   ``0.5 x (1 + tanh(0.7978845608 (x + 0.044715 x^3)))``, silu ``x / (1 + exp(-x))``, identity,
   swiglu ``min(g, L) sigmoid(alpha min(g, L)) (clamp(l, -L, L) + beta)``) is computed in float64
   at the same probes; the first that agrees at every probe within :func:`.probes.deviation`'s
   tolerance is the answer, else the refusal names the closest candidate, its largest deviation
   and the probe where it is.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import value_label
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.moe.behaviour.columns import column_sources
from onnx_moe_fuse.rewrites.moe.behaviour.interpret import COLUMN_OPS, Unsupported, evaluate
from onnx_moe_fuse.rewrites.moe.behaviour.probes import (
    Deviation,
    atol_for,
    deviation,
    in_dtype,
    probe_values,
    rtol_for,
    small_values,
)
from onnx_moe_fuse.rewrites.moe.behaviour.region import Region

__all__ = ["ELEMENTWISE", "prove_activation", "region_constants", "single_candidate", "swiglu"]

WHAT = "the activation"
_SCREEN = 256  # probes a SwiGLU parameter combination is screened on before the full grid
_KEEP = 4  # combinations evaluated on the full grid after the screen


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


#: ORT's element-wise MoE activations (contrib_ops/cpu/moe/moe_utils.cc ApplyActivation).
ELEMENTWISE = {
    "identity": lambda x: x,
    "relu": lambda x: np.maximum(x, 0.0),
    "gelu": lambda x: 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x * x * x))),
    "silu": lambda x: x * _sigmoid(x),
}


def single_candidate(kind: str, x: np.ndarray) -> np.ndarray:
    """ORT's ``kind`` at float64 ``x``."""
    with np.errstate(all="ignore"):
        return ELEMENTWISE[kind](x.astype(np.float64))


def swiglu(
    g: np.ndarray, u: np.ndarray, alpha: float, beta: float, limit: float | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ORT's SwiGLU at float64 ``(g, l)``, the scale of its operands and the gate's multiplier.

    The last two are the tolerance's: a rounding of ``g * sigmoid(g)`` is multiplied by
    ``l + beta``.
    """
    g, u = g.astype(np.float64), u.astype(np.float64)
    if limit is not None:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    with np.errstate(all="ignore"):
        lin = u + beta
        return g * _sigmoid(alpha * g) * lin, np.abs(g) * (np.abs(u) + abs(beta)), np.abs(lin)


#: Which SwiGLU parameter a constant read by each op may be (others: any of them).
_ROLES = {
    "Clip": ("limit",), "Min": ("limit",), "Max": ("limit",),
    "Add": ("beta",), "Sub": ("beta",), "Sum": ("beta",),
    "Mul": ("alpha",), "Div": ("alpha",),
}  # fmt: skip
_ALL_ROLES = ("alpha", "beta", "limit")


def region_constants(region: Region) -> dict[str, list[float]]:
    """The distinct finite scalar float constants of the region's arithmetic, by parameter.

    By the SwiGLU parameter each may be (a clamp bound a limit, an addend a beta, a factor an
    alpha); the column indices of Slice/Split/Gather are not arithmetic. Key ``all``: every one.
    """
    found: dict[str, list[float]] = {"alpha": [], "beta": [], "limit": [], "all": []}

    def add(c: float, roles: tuple[str, ...]) -> None:
        if not np.isfinite(c):
            return
        for role in (*roles, "all"):
            if c not in found[role]:
                found[role].append(c)

    for node in region.nodes:
        if node.op_type in COLUMN_OPS:
            continue
        roles = _ROLES.get(node.op_type, _ALL_ROLES)
        for v in node.inputs:
            arr = region.constants.get(v) if v is not None else None
            if arr is None or arr.size == 0 or arr.dtype.kind != "f":
                continue
            add(float(arr.reshape(-1)[0]), roles)
        for name in ("alpha", "beta", "min", "max"):
            attr = node.attributes.get(name)
            if attr is not None and attr.type == ir.AttributeType.FLOAT:
                add(float(attr.value), _ALL_ROLES)
    return found


class _Probe:
    """The region evaluated at a probe layout: per output element, its operands and its value."""

    def __init__(
        self, region: Region, deps: np.ndarray, widths: Sequence[int], rank: int,
        dtype: np.dtype, first: np.ndarray, second: np.ndarray | None,
    ) -> None:  # fmt: skip
        width = int(sum(widths)) + 1
        codes = deps[:, 0] * width + (deps[:, 1] + 1)  # one int per distinct column pair
        ordered = np.sort(codes)  # (np.unique hashes: 30x slower on a few thousand ints)
        unique = ordered[np.concatenate([[True], ordered[1:] != ordered[:-1]])]
        inverse = np.searchsorted(unique, codes)
        keys = np.stack([unique // width, unique % width - 1], axis=1)
        used = keys[keys >= 0]
        used = np.sort(used)
        if (used[1:] == used[:-1]).any():
            raise Refusal(
                f"{WHAT} '{value_label(region.output)}' reads one FC1 column in two roles or "
                "for two different output columns",
                region.output,
            )
        first, second = first.astype(dtype), None if second is None else second.astype(dtype)
        n = len(first)
        rows = -(-n // len(keys))
        q = (np.arange(rows)[:, None] * len(keys) + np.arange(len(keys))[None, :]) % n
        x = np.zeros((rows, int(sum(widths))), dtype=dtype)
        x[:, keys[:, 0]] = first[q]
        if second is not None:
            x[:, keys[:, 1]] = second[q]
        lead = (rows,) + (1,) * (rank - 2)
        feeds, start = {}, 0
        for src, w in zip(region.sources, widths, strict=True):
            feeds[src] = x[:, start : start + w].reshape(*lead, w)
            start += w
        try:
            out = evaluate(region.nodes, feeds, region.constants)[region.output]
        except (Unsupported, ValueError, IndexError, TypeError) as error:
            node = getattr(error, "node", None)
            raise Refusal(
                f"{WHAT} '{value_label(region.output)}' cannot be evaluated: {error}",
                node if node is not None else region.output,
            ) from None
        want = (*lead, deps.shape[0])
        if out.shape != want:
            raise Refusal(
                f"{WHAT} '{value_label(region.output)}' has shape {list(out.shape)} on probes "
                f"of shape {[*lead, int(sum(widths))]} (expected {list(want)}): not element-wise",
                region.output,
            )
        self.model = out.reshape(rows, -1)
        point = q[:, inverse.reshape(-1)]
        self.first = first[point]
        self.second = None if second is None else second[point]


def _where(probe: _Probe, d: Deviation, swapped: bool = False) -> str:
    f = float(probe.first.reshape(-1)[d.at])
    if probe.second is None:
        return f"x = {f:.9g}"
    s = float(probe.second.reshape(-1)[d.at])
    g, u = (s, f) if swapped else (f, s)
    return f"gate = {g:.9g}, linear = {u:.9g}"


def _params(consts: dict[str, list[float]]) -> tuple[np.ndarray, np.ndarray, list[float | None]]:
    def f32(role: str) -> list[float]:
        return [float(np.float32(c)) for c in consts[role]]

    inv = [float(np.float32(1 / c)) for c in f32("alpha") if c]
    alphas = list(dict.fromkeys([1.0, *f32("alpha"), *inv, *(-c for c in (*f32("alpha"), *inv))]))
    betas = list(dict.fromkeys([0.0, *f32("beta"), *(-c for c in f32("beta"))]))
    limits: list[float | None] = [None, *dict.fromkeys(abs(c) for c in f32("limit") if c)]
    return np.array(alphas), np.array(betas), limits


def _screen(model, g, u, alphas, betas, limits, rtol, atol, dtype) -> np.ndarray:
    """Per (limit, alpha, beta), how far off on the probes given (vectorised).

    The fraction of disagreeing probes, then (squashed below one probe's share) the worst
    deviation: :attr:`.probes.Deviation.rank` in one number.
    """
    worst = np.empty((len(limits), len(alphas), len(betas)))
    with np.errstate(all="ignore"):
        for i, limit in enumerate(limits):
            gc = g if limit is None else np.minimum(g, limit)
            lc = u if limit is None else np.clip(u, -limit, limit)
            glu = gc[None, :] * _sigmoid(alphas[:, None] * gc[None, :])  # [A, S]
            lin = lc[None, :] + betas[:, None]  # [B, S]
            c = in_dtype(glu[:, None, :] * lin[None, :, :], dtype)  # [A, B, S]
            scale = np.abs(gc) * (np.abs(lc)[None, :] + np.abs(betas)[:, None])  # [B, S]
            tol = rtol * (np.abs(c) + scale[None]) + atol * (1 + np.abs(lin))[None]
            diff = np.abs(model[None, None, :] - c)
            d = np.where(diff == 0, 0.0, diff / np.maximum(tol, 1e-300))
            d = np.where(np.isnan(d) | np.isinf(diff), np.inf, d)
            d = np.where(model[None, None, :] == c, 0.0, d)  # equal infinities agree
            worst[i] = np.mean(d > 1.0, axis=2) + np.arctan(d.max(axis=2)) / np.pi * 1e-3
    return worst


def _fit_swiglu(probe: _Probe, consts: dict[str, list[float]], rtol: float, atol: float):
    """The best (deviation, alpha, beta, limit, swapped) over the parameter candidates."""
    alphas, betas, limits = _params(consts)
    dtype = probe.model.dtype
    model = probe.model.reshape(-1).astype(np.float64)
    first = probe.first.reshape(-1).astype(np.float64)
    second = probe.second.reshape(-1).astype(np.float64)  # type: ignore[union-attr]
    sample = np.unique(np.linspace(0, model.size - 1, min(_SCREEN, model.size)).astype(int))
    scored = []
    for swapped in (False, True):
        g, u = (second, first) if swapped else (first, second)
        worst = _screen(
            model[sample], g[sample], u[sample], alphas, betas, limits, rtol, atol, dtype
        )
        for i, a, b in zip(
            *np.unravel_index(np.argsort(worst, axis=None)[:_KEEP], worst.shape), strict=True
        ):
            scored.append((worst[i, a, b], float(alphas[a]), float(betas[b]), limits[i], swapped))
    scored.sort(key=lambda t: t[0])
    best = None
    for _, alpha, beta, limit, swapped in scored[:_KEEP]:
        g, u = (second, first) if swapped else (first, second)
        c, s, m = swiglu(g, u, alpha, beta, limit)
        d = deviation(model, in_dtype(c, dtype), s, rtol, atol * (1 + m))
        if best is None or d.rank < best[0].rank:
            best = (d, alpha, beta, limit, swapped)
        if d.agrees:
            break
    return best


def _describe(kind: str, params: tuple[float, float, float | None] | None) -> str:
    if params is None:
        return "gelu (tanh form)" if kind == "gelu" else kind
    alpha, beta, limit = params
    return (
        f"swiglu(alpha={alpha:g}, beta={beta:g}, limit={'none' if limit is None else f'{limit:g}'})"
    )


def prove_activation(
    region: Region,
    widths: Sequence[int],
    rank: int,
    dtype: np.dtype,
    inter: int,
    offered: Collection[str],
) -> tuple[str, np.ndarray, tuple[float, float, float | None]]:
    """What the fused node computes for ``region`` (see the module docstring), or a Refusal."""
    deps = column_sources(region, widths, rank, WHAT)
    act = region.output
    if deps.shape[0] != inter:
        raise Refusal(
            f"{WHAT} '{value_label(act)}' has {deps.shape[0]} columns but FC2 reads {inter}", act
        )
    pairs = deps[:, 1] >= 0
    if pairs.any() and not pairs.all():
        j = int(np.argmin(pairs))
        raise Refusal(
            f"{WHAT} '{value_label(act)}': output column {j} reads one FC1 column, column "
            f"{int(np.argmax(pairs))} two; a fused activation is one or the other",
            act,
        )
    consts = region_constants(region)
    rtol, atol = rtol_for(dtype), atol_for(dtype)
    values = probe_values(consts["all"])
    if not pairs.any():
        probe = _Probe(region, deps, widths, rank, dtype, values, None)
        tried = []
        for kind in (k for k in ("identity", "relu", "silu", "gelu") if k in offered):
            x = probe.first
            want = in_dtype(single_candidate(kind, x), probe.model.dtype)
            d = deviation(probe.model, want, np.abs(x.astype(np.float64)), rtol, atol)
            if d.agrees:
                return kind, deps[:, 0].copy(), (1.0, 0.0, None)
            tried.append((d, kind, None, False))
    else:
        small = small_values(consts["all"])
        g = np.concatenate([np.repeat(values, len(small)), np.tile(small, len(values))])
        u = np.concatenate([np.tile(small, len(values)), np.repeat(values, len(small))])
        probe = _Probe(region, deps, widths, rank, dtype, g, u)
        tried = []
        if "swiglu" in offered:
            d, alpha, beta, limit, swapped = _fit_swiglu(probe, consts, rtol, atol)
            gate, lin = (deps[:, 1], deps[:, 0]) if swapped else (deps[:, 0], deps[:, 1])
            if d.agrees:
                return "swiglu", np.stack([gate, lin], 1).reshape(-1), (alpha, beta, limit)
            tried.append((d, "swiglu", (alpha, beta, limit), swapped))
    if not tried:
        raise Refusal(
            f"{WHAT} '{value_label(act)}': the fused op offers no activation of this kind", act
        )
    d, kind, params, swapped = min(tried, key=lambda t: t[0].rank)
    diff = abs(d.model - d.candidate) if np.isfinite(d.worst) else float("inf")
    erf = any(n.op_type == "Erf" for n in region.nodes) and kind == "gelu"
    raise Refusal(
        f"{WHAT} '{value_label(act)}' computes none of the fused activations "
        f"({', '.join(sorted(offered))}) within float rounding: the closest, "
        f"{_describe(kind, params)}{' with gate and linear swapped' if swapped else ''}, is "
        f"{diff:.3g} off ({d.worst:.3g} times the tolerance; {d.failing:.0%} of the probes "
        f"disagree) at {_where(probe, d, swapped)}, where the "
        f"region gives {d.model:.9g} and {kind} {d.candidate:.9g}"
        + (" (an Erf: exact GELU, while ORT's gelu is the tanh form)" if erf else ""),
        act,
    )
