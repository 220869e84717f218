"""Hand-written MoE layers (``onnx_moe_fuse.samples.handwritten``): ORT numerics, then the fuser.

For every layer:

* ``test_layer_matches_numpy``: ORT CPU on the layer equals an independent numpy computation of
  the same layer written here (weights read from the model's constants, fresh random input);
* ``test_fuser_outcome``: ``fuse`` does what a correct fuser must: emit the expected op with the
  expected attributes, the fused model matching ORT CPU on the original within 1e-5 (relative to
  the output's scale), or refuse, leaving the model byte-identical, with a near miss that names
  the router part and says why.

The fuser is being generalised: the layers it does not handle today are marked
``xfail(strict=True, raises=NotYet)`` with the near miss seen today, so they turn into failures
the moment they fuse as they should (then the mark goes); a marked layer that fuses wrongly, or a
refused one that gets fused or changed, fails at once. Seeds are printed on failure (``TEST_SEED`` replays one).
"""

from __future__ import annotations

import collections
import json
import math

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from meaning_refs import consts, ort_run, rel_err

from onnx_moe_fuse import fuse
from onnx_moe_fuse.samples.handwritten import (
    HANDWRITTEN,
    Fused,
    Qwen3Sizes,
    Refused,
    qwen3_int4,
)
from onnx_moe_fuse.samples.handwritten_routers import (
    DEEPSEEK_SCALING,
    PHIMOE_JITTER,
    SOFTMAX_SCALING,
)

FUSED_RTOL = 1e-5
NUMPY_RTOL = 1e-5
DIMS = {"batch": 2, "seq": 3}
NOT_RECOGNISED = (
    "not recognised: the indices of this TopK select experts, but no MoE layer rule matched the "
    "layer around it"
)
ONE_HOT = "not recognised: the experts are chosen by a one-hot mask of this TopK's indices"

#: Near misses today's fuser gives for the layers it does not handle yet (``None``: no near miss).
NOT_YET: dict[str, str | None] = {}


class NotYet(Exception):
    """The fuser leaves a layer alone that it should fuse, or refuses it without saying why.

    The only failure the ``xfail`` marks accept (``raises=NotYet``): a wrong fusion of a marked
    layer is a plain failure.
    """


def _outcome_params() -> list[object]:
    params = []
    for name in HANDWRITTEN:
        marks = []
        if name in NOT_YET:
            seen = NOT_YET[name] or "no near miss at all"
            marks.append(pytest.mark.xfail(strict=True, raises=NotYet, reason=f"not yet: {seen}"))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


# -- running ---------------------------------------------------------------------------------------


def random_input(model: onnx.ModelProto, rng: np.random.Generator, tokens: int = 7):
    """The one graph input, random N(0, 1); a dim_param takes ``DIMS`` or ``tokens``."""
    (inp,) = model.graph.input
    dims = [
        d.dim_value if d.HasField("dim_value") else DIMS.get(d.dim_param, tokens)
        for d in inp.type.tensor_type.shape.dim
    ]
    return inp.name, rng.standard_normal(dims).astype(np.float32)


# -- numpy building blocks ----------------------------------------------------------------------


def softmax(z: np.ndarray, axis: int = -1) -> np.ndarray:
    z = z - z.max(axis=axis, keepdims=True)
    ez = np.exp(z)
    return ez / ez.sum(axis=axis, keepdims=True)


def topk(p: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(p, idx, axis=-1), idx


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def silu(z: np.ndarray) -> np.ndarray:
    return z * sigmoid(z)


def dequant(q: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, axis: int) -> np.ndarray:
    """``(q - zp) * scale`` with ``scale`` blocked along ``axis`` (block = size / scale size)."""
    block = q.shape[axis] // scale.shape[axis]
    s = np.repeat(scale.astype(np.float64), block, axis=axis)
    z = 0.0 if zp is None else np.repeat(zp.astype(np.float64), block, axis=axis)
    return (q.astype(np.float64) - z) * s


def softmax_topk_renorm(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    vals, idx = topk(softmax(logits), k)
    return vals / vals.sum(-1, keepdims=True), idx


def routed(x: np.ndarray, w: np.ndarray, idx: np.ndarray, expert) -> np.ndarray:
    """``y[t] = sum_j w[t, j] * expert(idx[t, j], x[t])``, token by token."""
    y = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            y[t] += w[t, j] * expert(int(idx[t, j]), x[t])
    return y


def swiglu_expert(wg: np.ndarray, wu: np.ndarray, wd: np.ndarray):
    return lambda e, v: (silu(v @ wg[e]) * (v @ wu[e])) @ wd[e]


def dq3(c: dict[str, np.ndarray], name: str, suffixes: tuple[str, str, str | None]):
    q, s, z = suffixes
    return dequant(c[name + q], c[name + s], None if z is None else c[name + z], axis=1)


# -- numpy references, one per layer ----------------------------------------------------------


def ref_grouped_matmul_body(c, x):
    w, idx = softmax_topk_renorm(x @ c["gate.weight"], 2)
    return routed(x, w, idx, swiglu_expert(c["experts.w1"], c["experts.w3"], c["experts.w2"]))


def ref_swish_silu(c, x):
    w, idx = softmax_topk_renorm(x @ c["router"], 2)
    return routed(x, w, idx, lambda e, v: silu(v @ c["fc1"][e]) @ c["fc2"][e])


def ref_swish_swiglu(c, x):
    w, idx = softmax_topk_renorm(x @ c["router_w"], 3)
    return routed(x, w, idx, swiglu_expert(c["gate_proj"], c["up_proj"], c["down_proj"]))


def ref_einsum_experts(c, x):
    w, idx = softmax_topk_renorm(x @ c["wr"], 2)
    return routed(x, w, idx, swiglu_expert(c["w_gate"], c["w_up"], c["w_down"]))


def ref_output_major_transpose(c, x):
    w, idx = softmax_topk_renorm(x @ c["router.weight"], 2)
    wg, wu, wd = (c[f"experts.{n}_proj.weight"].transpose(0, 2, 1) for n in ("gate", "up", "down"))
    return routed(x, w, idx, swiglu_expert(wg, wu, wd))


def ref_dq(c, x):
    w, idx = softmax_topk_renorm(x @ c["router"], 2)
    wg, wu, wd = (dq3(c, n, (".qweight", ".scales", ".qzeros")) for n in ("gate", "up", "down"))
    return routed(x, w, idx, swiglu_expert(wg, wu, wd))


def ref_dq_asymmetric(c, x):
    """The asymmetric layers: a zero-point input may be absent (ONNX: zero point 0)."""
    w, idx = softmax_topk_renorm(x @ c["router"], 2)
    wg, wu, wd = (
        dequant(c[f"{n}.qweight"], c[f"{n}.scales"], c.get(f"{n}.qzeros"), axis=1)
        for n in ("gate", "up", "down")
    )
    return routed(x, w, idx, swiglu_expert(wg, wu, wd))


def ref_static_shapes(c, x):
    tokens = x.reshape(-1, x.shape[-1])
    w, idx = softmax_topk_renorm(tokens @ c["router"], 2)
    y = routed(tokens, w, idx, swiglu_expert(c["w_gate"], c["w_up"], c["w_down"]))
    return y.reshape(x.shape)


def ref_reciprocal_renorm(c, x):
    w, idx = softmax_topk_renorm(x @ c["router"], 3)
    return routed(x, w, idx, lambda e, v: np.maximum(v @ c["w1"][e], 0.0) @ c["w2"][e])


def ref_bmm_combine(c, x):
    w, idx = softmax_topk_renorm(x @ c["router"], 2)
    return routed(x, w, idx, swiglu_expert(c["wg"], c["wu"], c["wd"]))


def ref_qwen3(c, x):
    tokens = x.reshape(-1, x.shape[-1])
    k = int(c["num_experts_per_tok"][0])
    w, idx = softmax_topk_renorm(tokens @ c["mlp.gate.weight"], k)
    gu = dq3(c, "experts.gate_up_proj", (".qweight", ".scales", None))
    down = dq3(c, "experts.down_proj", (".qweight", ".scales", None))
    inter = gu.shape[2] // 2
    y = routed(tokens, w, idx, swiglu_expert(gu[:, :, :inter], gu[:, :, inter:], down))
    return y.reshape(x.shape)


def _stacked(c, name):
    return c[name] if name in c else dq3(c, name, ("_q", "_s", None))


def ref_dense_onehot(c, x):
    w, idx = softmax_topk_renorm(x @ c["router.weight"], 2)
    wg, wu, wd = (_stacked(c, f"experts.{n}") for n in ("gate", "up", "down"))
    return routed(x, w, idx, swiglu_expert(wg, wu, wd))


def ref_dense_equal_loop(c, x):
    w, idx = softmax_topk_renorm(x @ c["gate_w"], 2)
    experts = len([n for n in c if n.endswith("_id")])

    def weight(name):
        return c[name] if name in c else dequant(c[f"{name}.q"], c[f"{name}.s"], None, axis=0)

    wg, wu, wd = (
        np.stack([weight(f"expert{e}.{n}") for e in range(experts)]) for n in ("gate", "up", "down")
    )
    return routed(x, w, idx, swiglu_expert(wg, wu, wd))


def _router_experts(c):
    return swiglu_expert(c["experts.gate"], c["experts.up"], c["experts.down"])


def ref_sigmoid_topk(c, x):
    vals, idx = topk(x @ c["router.weight"], 2)
    return routed(x, sigmoid(vals), idx, _router_experts(c))


def ref_llama4_prescaled(c, x):
    vals, idx = topk(x @ c["router.weight"], 1)
    scores = sigmoid(vals)
    expert = _router_experts(c)
    y = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        y[t] = expert(int(idx[t, 0]), x[t] * scores[t, 0])
    return y


def ref_deepseek_v3(c, x):
    scores = sigmoid(x.astype(np.float64) @ c["gate.weight"])
    choice = scores + c["gate.e_score_correction_bias"]
    t, e = choice.shape
    groups, topk_group, k = 4, 2, 4
    grouped = choice.reshape(t, groups, e // groups)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    _, best_groups = topk(group_scores, topk_group)
    keep = np.zeros((t, groups), bool)
    np.put_along_axis(keep, best_groups, True, axis=1)
    masked = np.where(np.repeat(keep, e // groups, axis=1), choice, 0.0)
    _, idx = topk(masked, k)
    w = np.take_along_axis(scores, idx, axis=1)
    w = w / (w.sum(-1, keepdims=True) + 1e-20) * DEEPSEEK_SCALING
    return routed(x, w, idx, _router_experts(c))


def ref_softmax_scaled(c, x):
    w, idx = softmax_topk_renorm(x @ c["router"], 2)
    return routed(x, w * SOFTMAX_SCALING, idx, _router_experts(c))


def ref_ernie(c, x):
    probs = softmax(x.astype(np.float64) @ c["router.weight"])
    _, idx = topk(probs + c["moe_statics.e_score_correction_bias"], 2)
    w = np.take_along_axis(probs, idx, axis=1)
    return routed(x, w / np.maximum(w.sum(-1, keepdims=True), 1e-12), idx, _router_experts(c))


def ref_switch(c, x):
    vals, idx = topk(softmax(x.astype(np.float64) @ c["router.weight"]), 1)
    return routed(x, vals, idx, _router_experts(c))


def ref_other_experts(c, x):
    scores = sigmoid(x.astype(np.float64) @ c["router.weight"])
    _, idx = topk(scores, 2)
    _, idx2 = topk(sigmoid(x.astype(np.float64) @ c["second.weight"]), 2)
    return routed(x, np.take_along_axis(scores, idx2, axis=1), idx, _router_experts(c))


def ref_other_token(c, x):
    scores = sigmoid(x.astype(np.float64) @ c["router.weight"])
    _, idx = topk(scores, 2)
    w = np.take_along_axis(np.roll(scores, -1, axis=0), idx, axis=1)
    return routed(x, w, idx, _router_experts(c))


def ref_negative(c, x):
    vals, idx = topk(x.astype(np.float64) @ c["router.weight"], 2)
    return routed(x, vals, idx, _router_experts(c))


def ref_capacity(c, x, capacity=1):
    vals, idx = topk(softmax(x.astype(np.float64) @ c["router.weight"]), 2)
    per_expert = np.zeros((x.shape[0], c["router.weight"].shape[1]))
    np.put_along_axis(per_expert, idx, 1.0, axis=1)
    keep = (np.cumsum(per_expert, axis=0) <= capacity).astype(np.float64)
    return routed(x, vals * np.take_along_axis(keep, idx, axis=1), idx, _router_experts(c))


def ref_phimoe(c, x):
    logits = x.astype(np.float64) @ c["gate.weight"]

    def mixer_round(scores):
        choice = scores.argmax(-1)[:, None]
        top = np.take_along_axis(scores, choice, axis=1)
        gap = (top - logits) / np.maximum(np.abs(logits), top)
        gates = softmax(np.where(gap > 2 * PHIMOE_JITTER, -np.inf, scores))
        return np.take_along_axis(gates, choice, axis=1), choice

    w1, c1 = mixer_round(logits)
    second = logits.copy()
    np.put_along_axis(second, c1, -np.inf, axis=1)
    w2, c2 = mixer_round(second)
    w, idx = np.concatenate([w1, w2], 1), np.concatenate([c1, c2], 1)
    return routed(x, w, idx, _router_experts(c))


REFERENCES = {
    "grouped_matmul_body": ref_grouped_matmul_body,
    "swish_silu": ref_swish_silu,
    "swish_swiglu": ref_swish_swiglu,
    "einsum_experts": ref_einsum_experts,
    "output_major_transpose": ref_output_major_transpose,
    "dq_int4_zp0_block32": ref_dq,
    "dq_uint4_zp8_block32": ref_dq,
    "dq_int4_zp0_channel": ref_dq,
    "dq_uint8_zp128_channel": ref_dq,
    "dq_uint4_asym_block32": ref_dq_asymmetric,
    "dq_int4_asym_block16": ref_dq_asymmetric,
    "dq_int4_asym_channel": ref_dq_asymmetric,
    "dq_uint8_asym_channel": ref_dq_asymmetric,
    "dq_int8_asym_block64": ref_dq_asymmetric,
    "dq_uint4_no_zp_block32": ref_dq_asymmetric,
    "static_shapes": ref_static_shapes,
    "reciprocal_renorm": ref_reciprocal_renorm,
    "bmm_combine_squeeze": ref_bmm_combine,
    "bmm_combine_reshape": ref_bmm_combine,
    "qwen3_int4": ref_qwen3,
    "dense_onehot_float": ref_dense_onehot,
    "dense_onehot_int4": ref_dense_onehot,
    "dense_equal_loop_float": ref_dense_equal_loop,
    "dense_equal_loop_int4": ref_dense_equal_loop,
    "router_sigmoid_topk": ref_sigmoid_topk,
    "router_llama4_prescaled": ref_llama4_prescaled,
    "router_deepseek_v3": ref_deepseek_v3,
    "router_softmax_scaled": ref_softmax_scaled,
    "router_phimoe_sparse_mixer": ref_phimoe,
    "router_ernie_clamped": ref_ernie,
    "router_switch_top1": ref_switch,
    "router_switch_argmax": ref_switch,
    "router_switch_argmax_keepdims": ref_switch,
    "router_trap_other_experts": ref_other_experts,
    "router_trap_other_token": ref_other_token,
    "router_trap_negative": ref_negative,
    "router_trap_capacity": ref_capacity,
}


# -- tests --------------------------------------------------------------------------------------------


def test_every_layer_has_a_reference() -> None:
    assert set(REFERENCES) == set(HANDWRITTEN)
    assert set(NOT_YET) <= set(HANDWRITTEN)


@pytest.mark.parametrize("name", list(HANDWRITTEN))
def test_layer_matches_numpy(name: str, rng: np.random.Generator) -> None:
    model, description, _ = HANDWRITTEN[name]()
    assert description
    input_name, x = random_input(model, rng)
    got = ort_run(model, {input_name: x})
    want = REFERENCES[name](consts(model), x.astype(np.float64))
    err = rel_err(got, want)
    assert err <= NUMPY_RTOL, f"{name}: ORT vs numpy rel err {err:.2e}"


@settings(max_examples=6, deadline=None)
@given(
    hidden_blocks=st.integers(1, 4),
    inter_blocks=st.integers(1, 3),
    experts=st.integers(2, 12),
    data=st.data(),
)
def test_qwen3_sizes_are_a_parameter(
    hidden_blocks: int, inter_blocks: int, experts: int, data: st.DataObject
) -> None:
    k = data.draw(st.integers(1, experts), label="k")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    sizes = Qwen3Sizes(hidden=32 * hidden_blocks, inter=32 * inter_blocks, experts=experts, top_k=k)
    model, description, expected = qwen3_int4(sizes, seed=seed)
    h, i = sizes.hidden, sizes.inter
    assert f"H {h}, I {i}, E {experts}, k {k}, block 32" in description
    assert isinstance(expected, Fused)
    assert expected.attributes["k"] == k and expected.attributes["block_size"] == 32
    c = consts(model)
    assert c["experts.gate_up_proj.qweight"].shape == (experts, h, 2 * i)
    assert c["experts.down_proj.qweight"].shape == (experts, i, h)
    input_name, x = random_input(model, np.random.default_rng(seed))
    err = rel_err(ort_run(model, {input_name: x}), ref_qwen3(c, x.astype(np.float64)))
    assert err <= NUMPY_RTOL, f"{sizes}: ORT vs numpy rel err {err:.2e}"


def _assert_attribute(key: str, got: object, want: object) -> None:
    if isinstance(want, float):
        assert isinstance(got, float) and math.isclose(got, want, rel_tol=1e-6), (key, got, want)
    else:
        assert got == want, (key, got, want)


@pytest.mark.parametrize("name", _outcome_params())
def test_fuser_outcome(name: str, rng: np.random.Generator) -> None:
    model, _, expected = HANDWRITTEN[name]()
    before = model.SerializeToString()
    result = fuse(model)
    assert model.SerializeToString() == before, "fuse modified its input"
    misses = result.report.near_misses
    if isinstance(expected, Refused):
        # fusing a layer that must be refused, or touching it, is wrong: never "not yet"
        assert not result.report.fusions, result.report.fusions
        assert result.model.SerializeToString() == before
        naming = [m for m in misses if expected.part in json.dumps(m)]
        if not any(expected.reason in m["reason"].lower() for m in naming):
            raise NotYet(f"no near miss names {expected.part!r} with {expected.reason!r}: {misses}")
        return
    if not result.report.fusions:
        raise NotYet(f"nothing fused: {misses}")
    # once it fuses, it must fuse right: a wrong fusion fails even while the layer is marked
    assert [f["op"] for f in result.report.fusions] == [expected.op], result.report.fusions
    attrs = result.report.fusions[0]["attributes"]
    for key, want in expected.attributes.items():
        _assert_attribute(key, attrs[key], want)
    ops = collections.Counter((n.domain, n.op_type) for n in result.model.graph.node)
    assert ops[("com.microsoft", expected.op)] == 1, ops
    # the fused op's own routing replaces the TopK; a router it does not compute stays
    constructed = "routing" in result.report.fusions[0]
    assert (ops[("", "TopK")] == 0) != constructed, ops
    for _ in range(2):
        input_name, x = random_input(model, rng)
        feeds = {input_name: x}
        err = rel_err(ort_run(result.model, feeds), ort_run(model, feeds).astype(np.float64))
        assert err <= FUSED_RTOL, f"{name}: fused vs original rel err {err:.2e}"
