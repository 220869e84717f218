"""The QMoE oracle against ONNX Runtime's CPU ``com.microsoft.QMoE``, plus the facts it pins.

Each case builds one QMoE node at ORT's input positions (0 input, 1 router_probs, 2 fc1 weights,
3 fc1 scales, 4 fc1 bias, 5 fc2 weights, 6 fc2 scales, 7 fc2 bias; ``""`` for an absent
optional), writes every attribute explicitly, stores the weights and scales as constant
initializers (as a fused model does), and runs with graph optimisations off.

Error measure: ``max|ort - oracle| / max|oracle|``. ORT is exact (to float32 rounding, ~1e-7)
on every path except block-wise 8-bit with constant weights, where ORT CPU quantises the
activations to int8 per block before both GEMMs (about 1-2 %): those cases use a loose bound.

Random inputs are fresh each run (seed in the messages; ``TEST_SEED`` replays one).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import pytest
from helpers import altered, rel_err, seeded_rng

from onnx_moe_fuse.verify.oracles import moe as moe_oracle
from onnx_moe_fuse.verify.oracles.moe import qmoe
from onnx_moe_fuse.verify.oracles.quant import dequantize_qmoe, pack_qmoe, quantize_symmetric
from onnx_moe_fuse.verify.ort_nodes import run_node

ort = pytest.importorskip("onnxruntime")

EXACT = 1e-4
# Block-wise 8-bit with constant weights: ORT CPU's MLAS path quantises activations to int8.
BLOCKWISE_8BIT_CONST = 6e-2


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QCase:
    """One QMoE configuration; the data is random per run."""

    bits: int
    block: int | None
    act: str  # relu, gelu, silu, identity, swiglu
    k: int
    rank: int = 2
    bias: bool = False
    alpha: float = 1.0
    beta: float = 0.0
    limit: float | None = None
    experts: int = 4
    hidden: int = 64
    inter: int = 32
    tokens: int = 6
    x_scale: float = 1.0

    @property
    def id(self) -> str:
        """Readable test id."""
        parts = [f"{self.bits}b", "col" if self.block is None else f"blk{self.block}", self.act]
        if self.act == "swiglu" and (self.alpha, self.beta, self.limit) != (1.0, 0.0, None):
            parts.append(f"a{self.alpha}-b{self.beta}-lim{self.limit}")
        parts += [f"k{self.k}of{self.experts}", f"rank{self.rank}", f"T{self.tokens}"]
        if self.bias:
            parts.append("bias")
        return "-".join(parts)


_ACT_VARIANTS = [
    {"act": "relu"},
    {"act": "swiglu"},
    # gpt-oss constants; inputs scaled so the limit clamps a good share of the values.
    {"act": "swiglu", "alpha": 1.702, "beta": 1.0, "limit": 7.0, "x_scale": 3.0},
]


def _cases() -> list[QCase]:
    cases = []
    i = 0
    for bits in (4, 8):
        for block in (None, 32):
            for variant in _ACT_VARIANTS:
                for rank in (2, 3):
                    cases.append(
                        QCase(
                            bits, block, k=1 + i % 4, rank=rank, bias=bool((i // 2) % 2), **variant
                        )
                    )
                    i += 1
    cases += [
        QCase(4, None, "gelu", k=2, bias=True),
        QCase(8, None, "silu", k=3, rank=3),
        QCase(4, 32, "identity", k=2),
        QCase(8, 64, "gelu", k=1, inter=64, bias=True),
        QCase(4, 16, "silu", k=4, bias=True),
        QCase(8, None, "identity", k=1, rank=3),
        QCase(4, None, "swiglu", k=2, limit=1.5),
        QCase(4, 16, "swiglu", k=3, alpha=2.0, bias=True),
        QCase(8, None, "swiglu", k=2, beta=-0.5, rank=3),
        QCase(4, 64, "swiglu", k=2, hidden=128, inter=64, limit=2.0, beta=1.0),
        QCase(4, None, "swiglu", k=8, experts=8, bias=True),
        QCase(8, None, "relu", k=1, tokens=1),
        QCase(4, 32, "swiglu", k=2, tokens=1, limit=3.0, alpha=1.702, beta=1.0, rank=3),
        QCase(4, None, "relu", k=5, experts=8, tokens=17),
        QCase(8, 16, "swiglu", k=1, experts=2, hidden=32, inter=16, bias=True),
        QCase(4, None, "silu", k=2, hidden=16, inter=48),
    ]
    return cases


CASES = _cases()


def _make_data(case: QCase, rng: np.random.Generator) -> dict:
    e, h, inter = case.experts, case.hidden, case.inter
    fusion = 2 if case.act == "swiglu" else 1
    lead = (case.tokens,) if case.rank == 2 else (2, (case.tokens + 1) // 2)
    tokens = math.prod(lead)
    x = (case.x_scale * rng.standard_normal((*lead, h))).astype(np.float32)
    router = rng.standard_normal((tokens, e)).astype(np.float32)
    w1 = rng.standard_normal((e, fusion * inter, h)) / math.sqrt(h)
    w2 = rng.standard_normal((e, h, inter)) / math.sqrt(inter)
    fc1, fc1_scales = quantize_symmetric(w1, case.bits, case.block, rng)
    fc2, fc2_scales = quantize_symmetric(w2, case.bits, case.block, rng)
    fc1_bias = fc2_bias = None
    if case.bias:
        fc1_bias = rng.standard_normal((e, fusion * inter)).astype(np.float32)
        fc2_bias = rng.standard_normal((e, h)).astype(np.float32)
    return {
        "input": x,
        "router_probs": router,
        "fc1": fc1,
        "fc1_scales": fc1_scales,
        "fc2": fc2,
        "fc2_scales": fc2_scales,
        "fc1_bias": fc1_bias,
        "fc2_bias": fc2_bias,
    }


def _attrs(case: QCase, normalize: int = 0, **extra) -> dict:
    """Every QMoE attribute, written explicitly."""
    attrs = {
        "k": case.k,
        "activation_type": case.act,
        "expert_weight_bits": case.bits,
        "swiglu_fusion": 1 if case.act == "swiglu" else 0,
        "activation_alpha": case.alpha,
        "activation_beta": case.beta,
        "normalize_routing_weights": normalize,
        "use_sparse_mixer": 0,
        "quant_type": "int",
        "weights_prepacked": 0,
        "accuracy_level": 0,
        "swiglu_limit_after_activation": 0,
    }
    if case.block is not None:
        attrs["block_size"] = case.block
    if case.limit is not None:
        attrs["swiglu_limit"] = case.limit
    attrs.update(extra)
    return attrs


def _ort_qmoe(d: dict, attrs: dict, const: Collection[int] = (2, 3, 5, 6)) -> np.ndarray:
    inputs = [
        d["input"],
        d["router_probs"],
        d["fc1"],
        d["fc1_scales"],
        d["fc1_bias"],
        d["fc2"],
        d["fc2_scales"],
        d["fc2_bias"],
    ]
    const = set(const) | ({4, 7} if d["fc1_bias"] is not None else set())
    return run_node("QMoE", inputs, attrs, const=const)


def _oracle(d: dict, case: QCase, normalize: int = 0) -> np.ndarray:
    return qmoe(
        d["input"],
        d["router_probs"],
        d["fc1"],
        d["fc1_scales"],
        d["fc2"],
        d["fc2_scales"],
        k=case.k,
        activation_type=case.act,
        expert_weight_bits=case.bits,
        block_size=case.block,
        swiglu_fusion=1 if case.act == "swiglu" else 0,
        activation_alpha=case.alpha,
        activation_beta=case.beta,
        swiglu_limit=case.limit,
        fc1_bias=d["fc1_bias"],
        fc2_bias=d["fc2_bias"],
        normalize_routing_weights=normalize,
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_qmoe_matches_ort(case: QCase):
    rng, seed = seeded_rng()
    d = _make_data(case, rng)
    want = _oracle(d, case)
    assert want.dtype == np.float32 and want.shape == d["input"].shape
    got = _ort_qmoe(d, _attrs(case))
    tol = BLOCKWISE_8BIT_CONST if (case.bits == 8 and case.block is not None) else EXACT
    err = rel_err(got, want)
    assert err <= tol, f"{case.id}: rel err {err:.3g} > {tol} (seed={seed})"


# ---------------------------------------------------------------------------------------------
# Pinned facts (docs: /work/shared/notes/semantics.md and docs/oracles.md)
# ---------------------------------------------------------------------------------------------


def test_pin_normalize_routing_weights_0_and_1_are_identical_in_ort():
    rng, seed = seeded_rng()
    case = QCase(4, None, "swiglu", k=2, bias=True)
    d = _make_data(case, rng)
    out0 = _ort_qmoe(d, _attrs(case, normalize=0))
    out1 = _ort_qmoe(d, _attrs(case, normalize=1))
    np.testing.assert_array_equal(out0, out1, err_msg=f"seed={seed}")
    want = _oracle(d, case, normalize=1)
    np.testing.assert_array_equal(want, _oracle(d, case, normalize=0))
    assert rel_err(out1, want) <= EXACT, f"seed={seed}"


def test_pin_routing_is_softmax_over_the_k_selected_logits():
    # Equivalent to "softmax over all E, top-k, renormalise": the MoE oracle with normalize=1
    # on the same (dequantised) weights gives the QMoE answer.
    rng, seed = seeded_rng()
    case = QCase(8, None, "relu", k=3, experts=6, bias=False)
    d = _make_data(case, rng)
    w1 = dequantize_qmoe(d["fc1"], d["fc1_scales"], 8, dtype=np.float64)
    w2 = dequantize_qmoe(d["fc2"], d["fc2_scales"], 8, dtype=np.float64)
    x64, r64 = d["input"].astype(np.float64), d["router_probs"].astype(np.float64)
    for normalize, same in ((1, True), (0, False)):
        m = moe_oracle.moe(
            x64, r64, w1, w2, k=3, activation_type="relu", normalize_routing_weights=normalize
        )
        close = rel_err(m, _oracle(d, case)) <= 1e-6
        assert close == same, f"normalize={normalize} (seed={seed})"
    assert rel_err(_ort_qmoe(d, _attrs(case)), _oracle(d, case)) <= EXACT, f"seed={seed}"


@pytest.mark.parametrize("bits", [4, 8])
def test_pin_interleaved_swiglu_row_order(bits):
    # Row 2j of FC1 is the gate, 2j+1 the linear operand: swapping the two must change ORT's
    # answer, and the oracle must follow ORT, not the swapped reading.
    rng, seed = seeded_rng()
    case = QCase(bits, None, "swiglu", k=2, limit=1.5, beta=0.5)
    d = _make_data(case, rng)
    got = _ort_qmoe(d, _attrs(case))
    assert rel_err(got, _oracle(d, case)) <= EXACT, f"seed={seed}"
    e, rows = d["fc1"].shape[:2]
    swap = np.arange(rows).reshape(-1, 2)[:, ::-1].reshape(-1)
    swapped = dict(d, fc1=d["fc1"][:, swap], fc1_scales=d["fc1_scales"][:, swap])
    assert rel_err(got, _oracle(swapped, case)) > 1e-2, f"seed={seed}"


def _loop_qmoe_swiglu(d: dict, case: QCase, gate_clamp, linear_clamp) -> np.ndarray:
    """Independent per-token loop for interleaved SwiGLU QMoE with pluggable clamps."""
    w1 = dequantize_qmoe(d["fc1"], d["fc1_scales"], case.bits, case.block, dtype=np.float64)
    w2 = dequantize_qmoe(d["fc2"], d["fc2_scales"], case.bits, case.block, dtype=np.float64)
    x = d["input"].reshape(-1, case.hidden).astype(np.float64)
    logits = d["router_probs"].astype(np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = sorted(range(case.experts), key=lambda e: (-logits[t, e], -e))[: case.k]
        weights = np.exp(logits[t, top] - logits[t, top].max())
        weights /= weights.sum()
        for e, wt in zip(top, weights, strict=True):
            h = w1[e] @ x[t]
            g, lin = gate_clamp(h[0::2]), linear_clamp(h[1::2])
            a = g / (1.0 + np.exp(-case.alpha * g)) * (lin + case.beta)
            out[t] += wt * (w2[e] @ a)
    return out.reshape(d["input"].shape)


def test_pin_swiglu_clamp_is_one_sided_on_the_gate_and_two_sided_on_the_linear():
    rng, seed = seeded_rng()
    lim = 1.0
    case = QCase(4, None, "swiglu", k=2, limit=lim, alpha=1.702, beta=1.0, x_scale=2.0)
    d = _make_data(case, rng)
    got = _ort_qmoe(d, _attrs(case))

    def both(v: np.ndarray) -> np.ndarray:
        return np.clip(v, -lim, lim)

    def upper(v: np.ndarray) -> np.ndarray:
        return np.minimum(v, lim)

    def none(v: np.ndarray) -> np.ndarray:
        return v

    measured = _loop_qmoe_swiglu(d, case, upper, both)
    assert rel_err(got, measured) <= EXACT, f"seed={seed}"
    assert rel_err(_oracle(d, case), measured) <= 1e-6, f"seed={seed}"
    for name, g, lin in (("symmetric gate", both, both), ("no clamp", none, none)):
        err = rel_err(got, _loop_qmoe_swiglu(d, case, g, lin))
        assert err > 1e-3, f"ORT matches the {name} reading: {err:.3g} (seed={seed})"


def test_pin_blockwise_8bit_inexact_only_with_constant_weights():
    rng, seed = seeded_rng()
    case = QCase(8, 32, "swiglu", k=2, hidden=128, inter=64, tokens=8)
    d = _make_data(case, rng)
    want = _oracle(d, case)
    const_err = rel_err(_ort_qmoe(d, _attrs(case), const=(2, 3, 5, 6)), want)
    input_err = rel_err(_ort_qmoe(d, _attrs(case), const=()), want)
    assert const_err > 1e-3, f"ORT became exact here: {const_err:.3g} (seed={seed})"
    assert const_err <= BLOCKWISE_8BIT_CONST, f"{const_err:.3g} (seed={seed})"
    assert input_err <= EXACT, f"weights as graph inputs: {input_err:.3g} (seed={seed})"


@pytest.mark.parametrize(("accuracy_level", "exact"), [(0, True), (4, False)])
def test_pin_blockwise_4bit_exact_unless_accuracy_level_4(accuracy_level, exact):
    rng, seed = seeded_rng()
    case = QCase(4, 32, "relu", k=2, hidden=128, inter=64, tokens=8)
    d = _make_data(case, rng)
    err = rel_err(_ort_qmoe(d, _attrs(case, accuracy_level=accuracy_level)), _oracle(d, case))
    assert (err <= EXACT) == exact, f"accuracy_level={accuracy_level}: {err:.3g} (seed={seed})"


def test_pin_ties_select_the_highest_expert_index():
    rng, seed = seeded_rng()
    case = QCase(4, None, "relu", k=2)
    d = _make_data(case, rng)
    d["input"] = d["input"][:4]
    d["router_probs"] = np.array(
        [[1, 1, 1, 1], [0.5, 2, 2, 0], [3, 1, 3, 3], [2, 2, 0, 1]], dtype=np.float32
    )
    want = _oracle(d, case)
    got = _ort_qmoe(d, _attrs(case))
    assert rel_err(got, want) <= EXACT, f"seed={seed}"
    np.testing.assert_array_equal(
        moe_oracle.select_top_k(d["router_probs"], 2), [[3, 2], [2, 1], [3, 2], [1, 0]]
    )
    # The lowest-index reading (ONNX TopK's) differs from ORT on these rows.
    lowest = dict(d, router_probs=d["router_probs"][:, ::-1].copy())
    flip = dict(
        lowest,
        fc1=d["fc1"][::-1].copy(),
        fc1_scales=d["fc1_scales"][::-1].copy(),
        fc2=d["fc2"][::-1].copy(),
        fc2_scales=d["fc2_scales"][::-1].copy(),
    )
    assert rel_err(_oracle(flip, case), want) > 1e-3, f"seed={seed}"


def test_pin_gelu_is_the_tanh_approximation():
    rng, seed = seeded_rng()
    h = 16
    x = rng.uniform(-4.0, 4.0, size=(8, h)).astype(np.float32)
    eye = np.broadcast_to(np.eye(h, dtype=np.uint8) + 128, (1, h, h)).copy()
    ones = np.ones((1, h), np.float32)
    case = QCase(8, None, "gelu", k=1, experts=1, hidden=h, inter=h)
    attrs = _attrs(case)
    router = np.zeros((8, 1), np.float32) + 0.25
    got = run_node(
        "QMoE", [x, router, eye, ones, None, eye, ones], attrs, const=(2, 3, 5, 6)
    ).astype(np.float64)
    tanh_form = moe_oracle.gelu_tanh(x)
    erf_form = 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    assert np.abs(got - tanh_form).max() <= 2e-6, f"seed={seed}"
    assert np.abs(got - erf_form).max() > 1e-5, f"seed={seed}"


def test_pin_ort_cpu_refuses_concatenated_swiglu_and_the_oracle_agrees_by_reordering():
    rng, seed = seeded_rng()
    case = QCase(4, 32, "swiglu", k=2, limit=2.0, alpha=1.702, beta=1.0, bias=True)
    d = _make_data(case, rng)
    with pytest.raises(Exception, match="swiglu_fusion=1"):
        _ort_qmoe(d, _attrs(case, swiglu_fusion=2))
    # The same weights in concatenated order: gate rows first, then linear rows.
    order = np.concatenate([np.arange(0, 2 * case.inter, 2), np.arange(1, 2 * case.inter, 2)])
    concat = dict(
        d,
        fc1=d["fc1"][:, order],
        fc1_scales=d["fc1_scales"][:, order],
        fc1_bias=d["fc1_bias"][:, order],
    )
    common = dict(
        k=case.k,
        activation_type="swiglu",
        expert_weight_bits=4,
        block_size=32,
        activation_alpha=case.alpha,
        activation_beta=case.beta,
        swiglu_limit=case.limit,
        fc2_bias=d["fc2_bias"],
    )
    args = ("input", "router_probs", "fc1", "fc1_scales", "fc2", "fc2_scales")
    fused2 = qmoe(
        *(concat[a] for a in args), swiglu_fusion=2, fc1_bias=concat["fc1_bias"], **common
    )
    fused1 = qmoe(*(d[a] for a in args), swiglu_fusion=1, fc1_bias=d["fc1_bias"], **common)
    np.testing.assert_allclose(fused2, fused1, rtol=1e-6, atol=1e-6, err_msg=f"seed={seed}")
    assert rel_err(_ort_qmoe(d, _attrs(case)), fused2) <= EXACT, f"seed={seed}"


@pytest.mark.parametrize("block_size", [8, 48])
def test_pin_ort_and_oracle_refuse_block_sizes_that_are_not_powers_of_two_from_16(block_size):
    rng, _ = seeded_rng()
    case = QCase(4, 16, "relu", k=1, hidden=96, inter=48)
    d = _make_data(case, rng)
    e, n, _ = d["fc1_scales"].shape
    d["fc1_scales"] = np.ones((e, n, 96 // block_size), np.float32)
    d["fc2_scales"] = np.ones((e, 96, 48 // block_size), np.float32)
    with pytest.raises(Exception, match="block_size"):
        _ort_qmoe(d, _attrs(case, block_size=block_size))
    with pytest.raises(ValueError, match="block_size"):
        qmoe(
            d["input"],
            d["router_probs"],
            d["fc1"],
            d["fc1_scales"],
            d["fc2"],
            d["fc2_scales"],
            k=1,
            activation_type="relu",
            expert_weight_bits=4,
            block_size=block_size,
            swiglu_fusion=0,
        )


# ---------------------------------------------------------------------------------------------
# Oracle contract errors
# ---------------------------------------------------------------------------------------------


def _valid_args(act: str = "relu") -> tuple[list, dict]:
    e, h, inter = 4, 32, 16
    fusion = 2 if act == "swiglu" else 1
    codes1 = np.full((e, fusion * inter, h), 9, np.uint8)
    codes2 = np.full((e, h, inter), 7, np.uint8)
    args = [
        np.ones((3, h), np.float32),
        np.ones((3, e), np.float32),
        pack_qmoe(codes1, 4),
        np.ones((e, fusion * inter), np.float32),
        pack_qmoe(codes2, 4),
        np.ones((e, h), np.float32),
    ]
    kwargs = dict(
        k=2, activation_type=act, expert_weight_bits=4, swiglu_fusion=1 if act == "swiglu" else 0
    )
    return args, kwargs


def _with(i: int | None = None, value=None, act: str = "relu", **kw):
    return altered(_valid_args(act), i, value, **kw)


QMOE_ERRORS = [
    ("k_too_big", _with(k=5), r"k = 5 must be in \[1, E\] = \[1, 4\]"),
    ("k_zero", _with(k=0), r"k = 0"),
    ("k_float", _with(k=2.0), r"k must be an integer"),
    ("activation", _with(activation_type="tanh"), r"activation_type must be one of"),
    ("relu_fusion1", _with(swiglu_fusion=1), r"swiglu_fusion = 1 only applies to"),
    ("swiglu_fusion0", _with(act="swiglu", swiglu_fusion=0), r"swiglu_fusion = 0 is not supported"),
    ("bits", _with(expert_weight_bits=2), r"expert_weight_bits must be one of"),
    ("block_small", _with(block_size=8), r"block_size must be None or a power of two >= 16"),
    ("block_not_dividing", _with(block_size=32), r"block_size = 32 must divide both H = 32 and I"),
    ("normalize", _with(normalize_routing_weights=2), r"normalize_routing_weights must be 0 or 1"),
    ("limit", _with(act="swiglu", swiglu_limit=-1.0), r"swiglu_limit must be positive"),
    ("alpha", _with(act="swiglu", activation_alpha=float("nan")), r"activation_alpha must be"),
    ("input_rank", _with(0, np.ones(32, np.float32)), r"input must have rank 2"),
    ("input_dtype", _with(0, np.ones((3, 32), np.int32)), r"input must be float16"),
    ("router_rows", _with(1, np.ones((2, 4), np.float32)), r"router_probs has 2 rows"),
    ("router_dtype", _with(1, np.ones((3, 4), np.float64)), r"router_probs has dtype float64"),
    ("fc1_dtype", _with(2, np.ones((4, 16, 16), np.float32)), r"fc1 must be uint8"),
    ("fc1_shape", _with(2, np.ones((4, 16, 32), np.uint8)), r"fc1 must have shape"),
    ("fc1_experts", _with(2, np.ones((3, 16, 16), np.uint8)), r"fc1 must have shape"),
    ("fc2_shape", _with(4, np.ones((4, 16, 8), np.uint8)), r"fc2 must have shape \[E, H, I/pack\]"),
    ("fc1_scales", _with(3, np.ones((4, 15), np.float32)), r"fc1_scales must have shape"),
    ("fc2_scales", _with(5, np.ones((4, 32, 1), np.float32)), r"fc2_scales must have shape"),
    ("fc1_bias", _with(fc1_bias=np.ones((4, 32), np.float32)), r"fc1_bias must have shape"),
    ("fc2_bias", _with(fc2_bias=np.ones((4, 16), np.float32)), r"fc2_bias must have shape"),
]


@pytest.mark.parametrize(
    ("call", "pattern"), [c[1:] for c in QMOE_ERRORS], ids=[c[0] for c in QMOE_ERRORS]
)
def test_qmoe_contract_errors(call, pattern):
    args, kwargs = call
    with pytest.raises(ValueError, match=pattern):
        qmoe(*args, **kwargs)


def test_qmoe_zero_tokens():
    args, kwargs = _valid_args("swiglu")
    args[0] = np.ones((0, 32), np.float32)
    args[1] = np.ones((0, 4), np.float32)
    out = qmoe(*args, **kwargs)
    assert out.shape == (0, 32) and out.dtype == np.float32
