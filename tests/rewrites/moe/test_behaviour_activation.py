"""Activations recognised by behaviour: the spellings accepted, the near misses refused.

Each activation is written by hand (``activation_layers.Ops``) on graph inputs and proved by
:func:`~onnx_moe_fuse.rewrites.moe.behaviour.activation.prove_activation` (the probe check
alone); a few go through the whole pipeline and are compared with ORT CPU on the original.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from activation_layers import BASE, fuse_and_compare, prove_standalone, with_activation
from onnx import numpy_helper

from onnx_moe_fuse.rewrites.graph.refusals import Refusal

INF = float("inf")


# -- single-operand spellings ---------------------------------------------------------------------


def _silu_div(o, x):
    return o.Div(x, o.Add(o.c(1.0), o.Exp(o.Neg(x))))


def _silu_one_minus(o, x):  # x * (1 - sigmoid(-x)): cancels for x << 0
    return o.Mul(x, o.Sub(o.c(1.0), o.Sigmoid(o.Neg(x))))


def _silu_tanh(o, x):  # 0.5 x (1 + tanh(x / 2))
    return o.Mul(o.Mul(o.c(0.5), x), o.Add(o.Tanh(o.Div(x, o.c(2.0))), o.c(1.0)))


def _silu_reciprocal(o, x):
    return o.Mul(o.Reciprocal(o.Add(o.Exp(o.Mul(x, o.c(-1.0))), o.c(1.0))), x)


def _gelu_tanh_written(o, x):
    cube = o.Pow(x, o.c(3.0))
    inner = o.Mul(o.c(0.7978845608), o.Add(x, o.Mul(o.c(0.044715), cube)))
    return o.Mul(o.Mul(x, o.c(0.5)), o.Add(o.c(1.0), o.Tanh(inner)))


def _gelu_sigmoid(o, x):  # 0.5 (1 + tanh z) = sigmoid(2 z)
    inner = o.Mul(o.c(1.5957691216), o.Add(x, o.Mul(o.Mul(o.Mul(x, x), x), o.c(0.044715))))
    return o.Mul(x, o.Sigmoid(inner))


_SINGLE = {
    "silu_div": (_silu_div, "silu"),
    "silu_one_minus": (_silu_one_minus, "silu"),
    "silu_tanh": (_silu_tanh, "silu"),
    "silu_reciprocal": (_silu_reciprocal, "silu"),
    "quick_gelu_alpha_1": (lambda o, x: o.node("QuickGelu", x, domain="com.microsoft", alpha=1.0), "silu"),
    "relu_max": (lambda o, x: o.Max(x, o.c(0.0)), "relu"),
    "relu_where": (lambda o, x: o.Where(o.Greater(x, o.c(0.0)), x, o.c(0.0)), "relu"),
    "relu_clip": (lambda o, x: o.Clip(x, o.c(0.0), o.c(INF)), "relu"),
    "relu_abs": (lambda o, x: o.Mul(o.Add(x, o.Abs(x)), o.c(0.5)), "relu"),
    "relu_mask": (lambda o, x: o.Mul(x, o.Cast(o.Greater(x, o.c(0.0)), to=1)), "relu"),
    "gelu_written": (_gelu_tanh_written, "gelu"),
    "gelu_sigmoid": (_gelu_sigmoid, "gelu"),
    "fast_gelu": (lambda o, x: o.node("FastGelu", x, domain="com.microsoft"), "gelu"),
    "identity_mul_one": (lambda o, x: o.Mul(x, o.c(1.0)), "identity"),
    "identity_neg_neg": (lambda o, x: o.Neg(o.Neg(x)), "identity"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_SINGLE))
def test_single_operand_spellings_are_recognised(name: str) -> None:
    write, kind = _SINGLE[name]
    activation, columns, params = prove_standalone(write, (6,), 6)
    assert activation == kind
    assert columns.tolist() == list(range(6))
    assert params == (1.0, 0.0, None)


def test_a_gathered_column_subset_is_read_back_as_fc1_columns() -> None:
    write = lambda o, x: _silu_div(o, o.Gather(x, o.i64(5, 1, 3), axis=1))  # noqa: E731
    activation, columns, _ = prove_standalone(write, (6,), 3)
    assert activation == "silu" and columns.tolist() == [5, 1, 3]


# -- two-operand spellings (SwiGLU) ---------------------------------------------------------------

LIM = 2**62


def _glu_div(o, g, alpha=None):
    z = g if alpha is None else o.Mul(g, o.c(alpha))
    return o.Div(g, o.Add(o.c(1.0), o.Exp(o.Neg(z))))


def _oss(o, g, u):  # gpt-oss: min(g, 7) sigmoid(1.702 g) (clamp(u, -7, 7) + 1), Min/Max clamps
    g = o.Min(g, o.c(7.0))
    u = o.Max(o.Min(u, o.c(7.0)), o.c(-7.0))
    return o.Mul(_glu_div(o, g, 1.702), o.Add(u, o.c(1.0)))


def _halves(o, h, n=4):
    return o.Slice(h, o.i64(0), o.i64(n), o.i64(-1)), o.Slice(h, o.i64(n), o.i64(2 * n), o.i64(-1))


def _split(o, h, n=4):
    return o.node("Split", h, o.i64(n, n), outputs=2, axis=-1)


def _strided(o, h):
    step = o.i64(2)
    return (
        o.Slice(h, o.i64(0), o.i64(LIM), o.i64(-1), step),
        o.Slice(h, o.i64(1), o.i64(LIM), o.i64(-1), step),
    )


def _gathered(o, h, n=4):
    even = o.i64(*range(0, 2 * n, 2))
    return o.Gather(h, even, axis=-1), o.Gather(h, o.i64(*range(1, 2 * n, 2)), axis=-1)


CONCAT = [0, 4, 1, 5, 2, 6, 3, 7]  # fused order: gate j, linear j
INTERLEAVED = list(range(8))

_PAIRS = {
    "halves_div": (lambda o, h: (lambda g, u: o.Mul(_glu_div(o, g), u))(*_halves(o, h)), (1, 0, None), CONCAT),
    "split_sigmoid": (lambda o, h: (lambda g, u: o.Mul(u, o.Mul(o.Sigmoid(g), g)))(*_split(o, h)), (1, 0, None), CONCAT),
    "split_linear_gated": (lambda o, h: (lambda u, g: o.Mul(u, o.Mul(o.Sigmoid(g), g)))(*_split(o, h)), (1, 0, None), [4, 0, 5, 1, 6, 2, 7, 3]),
    "strided_oss": (lambda o, h: _oss(o, *_strided(o, h)), (1.702, 1.0, 7.0), INTERLEAVED),
    "gathered_oss": (lambda o, h: _oss(o, *_gathered(o, h)), (1.702, 1.0, 7.0), INTERLEAVED),
    "halves_sub_beta": (lambda o, h: (lambda g, u: o.Mul(o.Sub(u, o.c(-1.0)), _glu_div(o, g, 2.0)))(*_halves(o, h)), (2.0, 1.0, None), CONCAT),
    "halves_div_alpha": (lambda o, h: (lambda g, u: o.Mul(o.Mul(g, o.Sigmoid(o.Div(g, o.c(0.5)))), u))(*_halves(o, h)), (2.0, 0.0, None), CONCAT),
    "clip_limit": (lambda o, h: (lambda g, u: o.Mul(_glu_div(o, o.Clip(g, o.c(-INF), o.c(3.0))), o.Clip(u, o.c(-3.0), o.c(3.0))))(*_halves(o, h)), (1, 0, 3.0), CONCAT),
    "swish_gate": (lambda o, h: (lambda g, u: o.Mul(o.Swish(g), u))(*_halves(o, h)), (1, 0, None), CONCAT),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_PAIRS))
def test_swiglu_spellings_are_recognised_with_their_parameters(name: str) -> None:
    write, params, columns = _PAIRS[name]
    activation, got_columns, got = prove_standalone(write, (8,), 4)
    assert activation == "swiglu"
    assert got_columns.tolist() == columns
    assert got[0] == pytest.approx(params[0], rel=1e-7) and got[1:] == params[1:]


def _f16_tensor(value: float) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, dtype=np.float16))


def test_float16_swiglu_overflowing_where_the_fused_output_does_too_is_recognised() -> None:
    # gate / (1 + exp(-gate)) * up in float16: at gate 6.7, up 1e4 the product passes 65504 and
    # the region gives inf; the fused op rounds its float32 result to float16 once, also inf
    def write(o, h):
        g, u = _halves(o, h)
        glu = o.Div(g, o.Add(o.node("Constant", value=_f16_tensor(1.0)), o.Exp(o.Neg(g))))
        return o.Mul(glu, u)

    activation, columns, params = prove_standalone(write, (8,), 4, dtype=np.float16)
    assert activation == "swiglu" and columns.tolist() == CONCAT and params == (1.0, 0.0, None)


def test_float16_swiglu_overflowing_where_the_fused_output_does_not_is_refused() -> None:
    # (gate * up) * sigmoid(gate): at gate -10, up 1e4 the float16 product is -inf before the
    # sigmoid's 4.5e-5 would bring it back to -4.5: not the fused op in float16
    def write(o, h):
        g, u = _halves(o, h)
        return o.Mul(o.Mul(g, u), o.Sigmoid(g))

    with pytest.raises(Refusal, match="swiglu"):
        prove_standalone(write, (8,), 4, dtype=np.float16)


def test_two_projections_gate_and_up_in_either_role() -> None:
    up_gated = lambda o, g, u: o.Mul(g, o.Div(u, o.Add(o.c(1.0), o.Exp(o.Neg(u)))))  # noqa: E731
    activation, columns, _ = prove_standalone(up_gated, (4, 4), 4)
    assert activation == "swiglu" and columns.tolist() == [4, 0, 5, 1, 6, 2, 7, 3]


# -- near misses ---------------------------------------------------------------------------------


def _refusal(write, widths=(6,), inter=6) -> str:
    with pytest.raises(Refusal) as info:
        prove_standalone(write, widths, inter)
    return info.value.reason


@pytest.mark.parametrize(
    ("name", "write", "closest"),
    [
        ("silu off by a constant", lambda o, x: o.Div(x, o.Add(o.c(1.001), o.Exp(o.Neg(x)))), "silu"),
        ("relu at another threshold", lambda o, x: o.Where(o.Greater(x, o.c(1e-3)), x, o.c(0.0)), "relu"),
        ("hard-sigmoid silu", lambda o, x: o.Mul(x, o.HardSigmoid(x, alpha=1 / 6, beta=0.5)), "relu"),
        ("exp overflow", lambda o, x: o.Div(o.Mul(x, o.Exp(x)), o.Add(o.c(1.0), o.Exp(x))), "silu"),
        ("gelu with 0.0447", lambda o, x: o.Mul(x, o.Sigmoid(o.Mul(o.c(1.5957691216), o.Add(x, o.Mul(o.Pow(x, o.c(3.0)), o.c(0.0447)))))), "gelu"),
        ("a constant offset", lambda o, x: o.Add(o.Max(x, o.c(0.0)), o.c(1e-6)), "relu"),
    ],
)  # fmt: skip
def test_single_operand_near_misses_name_the_closest(name: str, write, closest: str) -> None:
    reason = _refusal(write)
    assert f"the closest, {closest}" in reason or f"the closest, {closest} " in reason, reason
    assert " off (" in reason and " at x = " in reason


def test_exact_gelu_written_otherwise_is_refused_naming_the_erf() -> None:
    reason = _refusal(
        lambda o, x: o.Mul(x, o.Add(o.c(0.5), o.Mul(o.c(0.5), o.Erf(o.Mul(x, o.c(0.70710678))))))
    )
    assert "the closest, gelu" in reason and "Erf" in reason


def _oss_swapped(o, h):  # the sigmoid reads the clamped linear operand: not SwiGLU in any role
    g, u = _strided(o, h)
    gc, uc = o.Min(g, o.c(7.0)), o.Clip(u, o.c(-7.0), o.c(7.0))
    return o.Mul(o.Mul(gc, o.Sigmoid(o.Mul(uc, o.c(1.702)))), o.Add(uc, o.c(1.0)))


def _oss_limits(o, h):  # linear clamped at 6, gate at 7
    g, u = _strided(o, h)
    return o.Mul(
        _glu_div(o, o.Min(g, o.c(7.0)), 1.702), o.Add(o.Clip(u, o.c(-6.0), o.c(6.0)), o.c(1.0))
    )


@pytest.mark.parametrize(
    "write",
    [
        _oss_swapped,
        _oss_limits,
        lambda o, h: (lambda g, u: o.Mul(o.Div(g, o.Add(o.c(1.0001), o.Exp(o.Neg(g)))), u))(*_halves(o, h)),
        lambda o, h: (lambda g, u: o.Mul(_glu_div(o, o.Min(g, o.c(7.0)), 1.702), o.Add(u, o.c(1.0))))(*_strided(o, h)),  # one clamp
    ],
    ids=["swapped gate/linear", "clamp at another limit", "off by a constant", "linear unclamped"],
)  # fmt: skip
def test_swiglu_near_misses_name_the_closest(write) -> None:
    reason = _refusal(write, (8,), 4)
    assert "the closest, swiglu(" in reason and "gate = " in reason, reason


@pytest.mark.parametrize(
    ("write", "inter", "words"),
    [
        (lambda o, x: o.Mul(x, o.c([1.0, 1.0, 1.0, 2.0, 1.0, 1.0])), 6, "varies along the features"),
        (lambda o, x: (lambda a, b, c: o.Mul(o.Mul(a, b), c))(*o.node("Split", x, o.i64(2, 2, 2), outputs=3, axis=1)), 2, "more than two FC1 columns"),
        (lambda o, x: o.Slice(x, o.i64(0), o.i64(1), o.i64(0)), 6, "does not cut the feature"),
        (lambda o, x: o.Mul(o.Sigmoid(o.Slice(x, o.i64(0), o.i64(3), o.i64(1))), o.Slice(x, o.i64(2), o.i64(5), o.i64(1))), 3, "reads one FC1 column in two roles"),
    ],
    ids=["per-column constant", "three columns", "slice of the token axis", "shared column"],
)  # fmt: skip
def test_regions_no_fused_activation_can_be_are_refused_by_name(write, inter, words) -> None:
    with pytest.raises(Refusal) as info:
        prove_standalone(write, (6,), inter)
    assert words in info.value.reason


# -- through the pipeline ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "write", "attrs", "changes"),
    [
        ("relu", _silu_one_minus, {"activation_type": "silu"}, {}),
        ("relu", _gelu_tanh_written, {"activation_type": "gelu"}, {"experts": "rows_gathernd"}),
        ("swiglu_separate", lambda o, g, u: o.Mul(o.Div(g, o.Add(o.c(1.0), o.Exp(o.Neg(g)))), u), {"activation_type": "swiglu", "swiglu_fusion": 1}, {}),
        ("swiglu_oss", lambda o, h: _oss(o, *_strided(o, h)), {"activation_type": "swiglu", "activation_beta": 1.0, "swiglu_limit": 7.0}, {}),
        ("swiglu_oss", lambda o, h: _oss(o, *_gathered(o, h, BASE.inter)), {"activation_type": "swiglu", "swiglu_limit": 7.0}, {"rank": 3, "token_dims": (2, 3)}),
    ],
    ids=["silu 1-sigmoid(-x)", "gelu written, rows", "swiglu two projections", "gpt-oss Min/Max", "gpt-oss gathered, rank 3"],
)  # fmt: skip
def test_hand_written_activations_fuse_and_match_ort(base, write, attrs, changes) -> None:
    model = with_activation(write, base, **changes)
    got = fuse_and_compare(model, scale=3.0)
    assert got.ops == ["MoE"], got.reasons
    for key, value in attrs.items():
        assert got.attributes[key] == pytest.approx(value), (key, got.attributes)
    assert got.error < 1e-5, got.error


def test_swish_gate_times_fc3_with_grouped_matmul_fuses() -> None:
    """Issue 18's case: GroupedMatMul experts, ``Swish(gate) * up`` (SwiGLU with FC3)."""
    swish = lambda o, g, u: o.Mul(o.Swish(g, alpha=1.0), u)  # noqa: E731
    model = with_activation(swish, "swiglu_separate", opset=24, experts="grouped_matmul")
    got = fuse_and_compare(model, scale=3.0)
    assert got.ops == ["MoE"] and got.attributes["activation_type"] == "swiglu", got.reasons
    assert got.error < 1e-5


def test_a_near_miss_leaves_the_model_unchanged_and_names_the_activation() -> None:
    got = fuse_and_compare(with_activation(_oss_limits, "swiglu_oss"))
    assert got.ops == [] and got.unchanged
    assert any(r.startswith("activation") or "the closest, swiglu" in r for r in got.reasons), (
        got.reasons
    )
    assert any("the closest, swiglu" in r for r in got.reasons), got.reasons


def test_probe_values_hold_signed_zeros_large_magnitudes_and_clamp_neighbours() -> None:
    from onnx_moe_fuse.rewrites.moe.behaviour.probes import probe_values

    v = probe_values([7.0])
    bits = set(v.view(np.uint32).tolist())
    assert np.float32(0.0).view(np.uint32) in bits and np.float32(-0.0).view(np.uint32) in bits
    for x in (1e4, -1e4, 88.0, -88.0, 30.0, 1.4e-45, 7.0, -7.0):
        assert np.float32(x) in v
    assert np.nextafter(np.float32(7.0), np.float32(8)) in v
    assert np.nextafter(np.float32(7.0), np.float32(6)) in v
