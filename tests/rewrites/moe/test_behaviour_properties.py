"""Properties: random compositions of equivalent spellings are recognised, perturbed ones refused.

SiLU is drawn as ``x * sigmoid(x)`` (either order) or ``x / (1 + exp(-x))``, the sigmoid in six
spellings (``Sigmoid``, ``1 / (1 + exp(-z))``, ``Reciprocal``, ``1 - sigmoid(-z)``,
``0.5 + 0.5 tanh(z / 2)``, ``0.5 (1 + tanh(z / 2))``), commutative operands in either order.
SwiGLU adds a cut (Slice halves, Split, strided Slice, Gather, or two projections), ``alpha``
(``Mul``, ``Div`` by its inverse), ``beta`` (``Add``, ``Sub`` of its negation) and a limit
(``Clip``, ``Min``/``Max``). Every composition must prove to the drawn activation and parameters;
the same composition scaled by ``1 + 1e-4`` or shifted by ``1e-4`` must be refused.
"""

from __future__ import annotations

import os

import pytest
from activation_layers import prove_standalone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnx_moe_fuse.rewrites.graph.refusals import Refusal

SETTINGS = settings(
    max_examples=int(os.environ.get("BEHAVIOUR_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=False,
)
N = 4  # output columns


def _mul(o, draw, a, b):
    return o.Mul(a, b) if draw(st.booleans()) else o.Mul(b, a)


def _add(o, draw, a, b):
    return o.Add(a, b) if draw(st.booleans()) else o.Add(b, a)


def _sigmoid(o, draw, z):
    form = draw(st.sampled_from(["op", "div", "reciprocal", "one_minus", "tanh_add", "tanh_mul"]))
    if form == "op":
        return o.Sigmoid(z)
    if form == "div":
        return o.Div(o.c(1.0), _add(o, draw, o.c(1.0), o.Exp(o.Neg(z))))
    if form == "reciprocal":
        return o.Reciprocal(_add(o, draw, o.Exp(_mul(o, draw, z, o.c(-1.0))), o.c(1.0)))
    if form == "one_minus":
        return o.Sub(o.c(1.0), o.Sigmoid(o.Neg(z)))
    half = o.Tanh(o.Div(z, o.c(2.0)) if draw(st.booleans()) else o.Mul(z, o.c(0.5)))
    if form == "tanh_add":
        return _add(o, draw, o.c(0.5), _mul(o, draw, o.c(0.5), half))
    return _mul(o, draw, o.c(0.5), _add(o, draw, o.c(1.0), half))


def _silu(o, draw, x, z=None):
    """``x * sigmoid(z)`` (z defaults to x)."""
    z = x if z is None else z
    if z is x and draw(st.booleans()):
        return o.Div(x, _add(o, draw, o.c(1.0), o.Exp(o.Neg(x))))
    return _mul(o, draw, x, _sigmoid(o, draw, z))


def _perturb(o, draw, out):
    how = draw(st.sampled_from(["none", "scale", "shift"]))
    if how == "scale":
        return how, _mul(o, draw, out, o.c(1.0001))
    if how == "shift":
        return how, _add(o, draw, out, o.c(1e-4))
    return how, out


@SETTINGS
@given(st.data())
def test_silu_compositions(data) -> None:
    draw = data.draw
    state = {}

    def write(o, x):
        state["how"], out = _perturb(o, draw, _silu(o, draw, x))
        return out

    _check(write, (N,), state, ("silu", (1.0, 0.0, None)))


def _cut(o, draw, h):
    form = draw(st.sampled_from(["halves", "split", "strided", "gather"]))
    if form == "halves":
        return (o.Slice(h, o.i64(0), o.i64(N), o.i64(-1)),
                o.Slice(h, o.i64(N), o.i64(2 * N), o.i64(-1)))  # fmt: skip
    if form == "split":
        return o.node("Split", h, o.i64(N, N), outputs=2, axis=-1)
    if form == "strided":
        return tuple(o.Slice(h, o.i64(i), o.i64(2**62), o.i64(-1), o.i64(2)) for i in (0, 1))
    return (o.Gather(h, o.i64(*range(0, 2 * N, 2)), axis=1),
            o.Gather(h, o.i64(*range(1, 2 * N, 2)), axis=1))  # fmt: skip


def _swiglu(o, draw, g, u, alpha, beta, limit):
    if limit is not None:
        g = o.Min(g, o.c(limit)) if draw(st.booleans()) else o.Clip(g, o.c(-1e30), o.c(limit))
        u = (
            o.Clip(u, o.c(-limit), o.c(limit))
            if draw(st.booleans())
            else o.Max(o.Min(u, o.c(limit)), o.c(-limit))
        )
    z = g
    if alpha != 1.0:
        z = _mul(o, draw, g, o.c(alpha)) if draw(st.booleans()) else o.Div(g, o.c(1 / alpha))
    lin = u
    if beta:
        lin = _add(o, draw, u, o.c(beta)) if draw(st.booleans()) else o.Sub(u, o.c(-beta))
    return _mul(o, draw, _silu(o, draw, g, z), lin)


@SETTINGS
@given(st.data(), st.sampled_from([(1.0, 0.0, None), (1.702, 1.0, 7.0), (2.0, 0.5, 3.0)]))
def test_swiglu_compositions(data, params) -> None:
    draw = data.draw
    separate = draw(st.booleans())
    state = {}

    def write(o, *sources):
        g, u = sources if separate else _cut(o, draw, sources[0])
        state["how"], out = _perturb(o, draw, _swiglu(o, draw, g, u, *params))
        return out

    _check(write, (N, N) if separate else (2 * N,), state, ("swiglu", params))


def _check(write, widths, state, want) -> None:
    try:
        activation, _, params = prove_standalone(write, widths, N)
    except Refusal as refusal:
        assert state["how"] != "none", refusal.reason
        assert "the closest" in refusal.reason, refusal.reason
        return
    assert state["how"] == "none", f"a perturbed ({state['how']}) spelling was accepted"
    assert activation == want[0]
    assert params[0] == pytest.approx(want[1][0], rel=1e-6)
    assert params[1:] == pytest.approx(want[1][1:]) if want[1][2] else params[1:] == want[1][1:]
