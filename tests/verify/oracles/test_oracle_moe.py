"""The MoE oracle against ONNX Runtime's CPU ``com.microsoft.MoE``, plus the facts it pins.

ORT 1.32's CPU MoE runs relu, gelu, silu and identity (``swiglu_fusion=0``, no FC3) and swiglu
with interleaved FC1 (``swiglu_fusion=1``); it refuses swiglu_fusion 0 and 2 at session creation
and any FC3 at run time. Those modes are checked by equivalence: the same weights rearranged
into the interleaved form give the same oracle output, and that form is compared with ORT.

Nodes use ORT's input positions (0 input, 1 router_probs, 2 fc1, 3 fc1 bias, 4 fc2, 5 fc2 bias,
6 fc3, 7 fc3 bias), every attribute written explicitly, weights as initializers, graph
optimisations off. Error measure: ``max|ort - oracle| / max|oracle|``.

Random inputs are fresh each run (seed in the messages; ``TEST_SEED`` replays one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from helpers import altered, rel_err, seeded_rng

from onnx_moe_fuse.verify.oracles import moe as moe_oracle
from onnx_moe_fuse.verify.oracles.moe import moe
from onnx_moe_fuse.verify.ort_nodes import run_node

ort = pytest.importorskip("onnxruntime")

EXACT = 1e-4
FLOAT16 = 5e-3


@dataclass(frozen=True)
class MCase:
    """One MoE configuration; the data is random per run."""

    act: str
    k: int
    normalize: int
    swiglu_fusion: int = 0
    rank: int = 2
    bias: bool = False
    alpha: float = 1.0
    beta: float = 0.0
    limit: float | None = None
    experts: int = 4
    hidden: int = 32
    inter: int = 16
    tokens: int = 6
    x_scale: float = 1.0
    dtype: type = np.float32

    @property
    def id(self) -> str:
        """Readable test id."""
        parts = [self.act, f"fusion{self.swiglu_fusion}", f"norm{self.normalize}"]
        if (self.alpha, self.beta, self.limit) != (1.0, 0.0, None):
            parts.append(f"a{self.alpha}-b{self.beta}-lim{self.limit}")
        parts += [f"k{self.k}of{self.experts}", f"rank{self.rank}", f"T{self.tokens}"]
        if self.bias:
            parts.append("bias")
        if self.dtype is not np.float32:
            parts.append(np.dtype(self.dtype).name)
        return "-".join(parts)


def _cases() -> list[MCase]:
    variants = [
        {"act": "relu"},
        {"act": "gelu"},
        {"act": "silu"},
        {"act": "identity"},
        {"act": "swiglu", "swiglu_fusion": 1},
        {"act": "swiglu", "swiglu_fusion": 1, "alpha": 1.702, "beta": 1.0, "limit": 7.0},
    ]
    cases = []
    for i, variant in enumerate(variants):
        for normalize in (0, 1):
            j = 2 * i + normalize
            scale = 3.0 if variant.get("limit") else 1.0
            cases.append(
                MCase(
                    k=1 + j % 4,
                    normalize=normalize,
                    rank=2 + (j // 2) % 2,
                    bias=bool(j % 3),
                    x_scale=scale,
                    **variant,
                )
            )
    cases += [
        MCase("swiglu", k=2, normalize=1, swiglu_fusion=1, limit=1.0, beta=0.5, bias=True),
        MCase("gelu", k=5, normalize=0, experts=8, tokens=17, bias=True),
        MCase("relu", k=8, normalize=0, experts=8),
        MCase("silu", k=1, normalize=1, tokens=1, rank=3),
        MCase("swiglu", k=2, normalize=0, swiglu_fusion=1, alpha=2.0, dtype=np.float16),
        MCase("relu", k=2, normalize=1, bias=True, dtype=np.float16, rank=3),
    ]
    return cases


CASES = _cases()


def _fusion(case: MCase) -> int:
    return 2 if case.act == "swiglu" and case.swiglu_fusion in (1, 2) else 1


def _make_data(case: MCase, rng: np.random.Generator) -> dict:
    e, h, inter = case.experts, case.hidden, case.inter
    f = _fusion(case)
    lead = (case.tokens,) if case.rank == 2 else (2, (case.tokens + 1) // 2)
    tokens = math.prod(lead)
    dt = case.dtype
    d = {
        "input": (case.x_scale * rng.standard_normal((*lead, h))).astype(dt),
        "router_probs": rng.standard_normal((tokens, e)).astype(dt),
        "fc1": (rng.standard_normal((e, f * inter, h)) / math.sqrt(h)).astype(dt),
        "fc2": (rng.standard_normal((e, h, inter)) / math.sqrt(inter)).astype(dt),
        "fc1_bias": None,
        "fc2_bias": None,
    }
    if case.bias:
        d["fc1_bias"] = rng.standard_normal((e, f * inter)).astype(dt)
        d["fc2_bias"] = rng.standard_normal((e, h)).astype(dt)
    return d


def _attrs(case: MCase, **extra) -> dict:
    """Every MoE attribute, written explicitly."""
    attrs = {
        "k": case.k,
        "activation_type": case.act,
        "swiglu_fusion": case.swiglu_fusion,
        "normalize_routing_weights": case.normalize,
        "activation_alpha": case.alpha,
        "activation_beta": case.beta,
        "use_sparse_mixer": 0,
        "swiglu_limit_after_activation": 0,
    }
    if case.limit is not None:
        attrs["swiglu_limit"] = case.limit
    attrs.update(extra)
    return attrs


def _ort_moe(d: dict, attrs: dict) -> np.ndarray:
    inputs = [
        d["input"],
        d["router_probs"],
        d["fc1"],
        d["fc1_bias"],
        d["fc2"],
        d["fc2_bias"],
        d.get("fc3"),
        d.get("fc3_bias"),
    ]
    return run_node("MoE", inputs, attrs, const=(2, 3, 4, 5, 6, 7))


def _oracle(d: dict, case: MCase, **over) -> np.ndarray:
    kw = dict(
        fc1_bias=d["fc1_bias"],
        fc2_bias=d["fc2_bias"],
        fc3=d.get("fc3"),
        fc3_bias=d.get("fc3_bias"),
        k=case.k,
        activation_type=case.act,
        swiglu_fusion=case.swiglu_fusion,
        normalize_routing_weights=case.normalize,
        activation_alpha=case.alpha,
        activation_beta=case.beta,
        swiglu_limit=case.limit,
    )
    kw.update(over)
    return moe(d["input"], d["router_probs"], d["fc1"], d["fc2"], **kw)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_moe_matches_ort(case: MCase):
    rng, seed = seeded_rng()
    d = _make_data(case, rng)
    want = _oracle(d, case)
    assert want.dtype == np.float32 and want.shape == d["input"].shape
    got = _ort_moe(d, _attrs(case))
    tol = FLOAT16 if case.dtype is np.float16 else EXACT
    err = rel_err(got, want)
    assert err <= tol, f"{case.id}: rel err {err:.3g} > {tol} (seed={seed})"


# ---------------------------------------------------------------------------------------------
# Modes ORT CPU lacks, by equivalence with the interleaved form
# ---------------------------------------------------------------------------------------------


def _split_gate_linear(rng: np.random.Generator, e: int, h: int, inter: int) -> dict:
    return {
        "gate": rng.standard_normal((e, inter, h)) / math.sqrt(h),
        "linear": rng.standard_normal((e, inter, h)) / math.sqrt(h),
        "gate_bias": rng.standard_normal((e, inter)),
        "linear_bias": rng.standard_normal((e, inter)),
    }


def _interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty((a.shape[0], 2 * a.shape[1], *a.shape[2:]), dtype=np.float32)
    out[:, 0::2], out[:, 1::2] = a, b
    return out


SWIGLU_PARAMS = [
    {"alpha": 1.0, "beta": 0.0, "limit": None},
    {"alpha": 1.702, "beta": 1.0, "limit": 7.0},
    {"alpha": 1.0, "beta": 0.5, "limit": 1.0},
]


@pytest.mark.parametrize(
    "params", SWIGLU_PARAMS, ids=lambda p: "a{alpha}-b{beta}-lim{limit}".format(**p)
)
def test_swiglu_fusion_0_and_2_equal_interleaved_which_equals_ort(params):
    rng, seed = seeded_rng()
    e, h, inter, k = 4, 32, 16, 2
    p = _split_gate_linear(rng, e, h, inter)
    x = (3.0 * rng.standard_normal((5, h))).astype(np.float32)
    router = rng.standard_normal((5, e)).astype(np.float32)
    fc2 = (rng.standard_normal((e, h, inter)) / math.sqrt(inter)).astype(np.float32)
    fc2_bias = rng.standard_normal((e, h)).astype(np.float32)
    f32 = {name: v.astype(np.float32) for name, v in p.items()}
    common = dict(
        k=k,
        activation_type="swiglu",
        normalize_routing_weights=1,
        activation_alpha=params["alpha"],
        activation_beta=params["beta"],
        swiglu_limit=params["limit"],
        fc2_bias=fc2_bias,
    )
    out0 = moe(
        x,
        router,
        f32["gate"],
        fc2,
        fc1_bias=f32["gate_bias"],
        fc3=f32["linear"],
        fc3_bias=f32["linear_bias"],
        swiglu_fusion=0,
        **common,
    )
    fc1_i = _interleave(f32["gate"], f32["linear"])
    bias_i = _interleave(f32["gate_bias"], f32["linear_bias"])
    out1 = moe(x, router, fc1_i, fc2, fc1_bias=bias_i, swiglu_fusion=1, **common)
    fc1_c = np.concatenate([f32["gate"], f32["linear"]], axis=1)
    bias_c = np.concatenate([f32["gate_bias"], f32["linear_bias"]], axis=1)
    out2 = moe(x, router, fc1_c, fc2, fc1_bias=bias_c, swiglu_fusion=2, **common)
    np.testing.assert_allclose(out0, out1, rtol=1e-6, atol=1e-6, err_msg=f"seed={seed}")
    np.testing.assert_allclose(out2, out1, rtol=1e-6, atol=1e-6, err_msg=f"seed={seed}")
    case = MCase("swiglu", k=k, normalize=1, swiglu_fusion=1, **params)
    d = {
        "input": x,
        "router_probs": router,
        "fc1": fc1_i,
        "fc1_bias": bias_i,
        "fc2": fc2,
        "fc2_bias": fc2_bias,
    }
    err = rel_err(_ort_moe(d, _attrs(case)), out1)
    assert err <= EXACT, f"rel err {err:.3g} (seed={seed})"


@pytest.mark.parametrize("with_fc3_bias", [False, True])
def test_silu_with_fc3_equals_plain_swiglu_which_equals_ort(with_fc3_bias):
    # silu(fc1 x) * (fc3 x) is swiglu with alpha 1, beta 0 and no limit.
    rng, seed = seeded_rng()
    e, h, inter = 4, 32, 16
    p = {n: v.astype(np.float32) for n, v in _split_gate_linear(rng, e, h, inter).items()}
    x = rng.standard_normal((2, 3, h)).astype(np.float32)
    router = rng.standard_normal((6, e)).astype(np.float32)
    fc2 = (rng.standard_normal((e, h, inter)) / math.sqrt(inter)).astype(np.float32)
    linear_bias = p["linear_bias"] if with_fc3_bias else np.zeros_like(p["linear_bias"])
    silu = moe(
        x,
        router,
        p["gate"],
        fc2,
        fc1_bias=p["gate_bias"],
        fc3=p["linear"],
        fc3_bias=p["linear_bias"] if with_fc3_bias else None,
        k=3,
        activation_type="silu",
        normalize_routing_weights=0,
    )
    case = MCase("swiglu", k=3, normalize=0, swiglu_fusion=1)
    d = {
        "input": x,
        "router_probs": router,
        "fc1": _interleave(p["gate"], p["linear"]),
        "fc1_bias": _interleave(p["gate_bias"], linear_bias),
        "fc2": fc2,
        "fc2_bias": None,
    }
    np.testing.assert_allclose(_oracle(d, case), silu, rtol=1e-6, atol=1e-6, err_msg=f"seed={seed}")
    assert rel_err(_ort_moe(d, _attrs(case)), silu) <= EXACT, f"seed={seed}"


# ---------------------------------------------------------------------------------------------
# Pinned facts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fusion", [0, 2])
def test_pin_ort_cpu_refuses_swiglu_fusion_0_and_2(fusion):
    rng, _ = seeded_rng()
    case = MCase("swiglu", k=2, normalize=1, swiglu_fusion=fusion)
    d = _make_data(case, rng)
    if fusion == 0:
        d["fc3"] = (rng.standard_normal((4, 16, 32)) / 6).astype(np.float32)
    with pytest.raises(Exception, match="only supports interleaved SwiGLU"):
        _ort_moe(d, _attrs(case))


def test_pin_ort_cpu_refuses_fc3():
    rng, _ = seeded_rng()
    case = MCase("silu", k=2, normalize=1)
    d = _make_data(case, rng)
    d["fc3"] = (rng.standard_normal((4, 16, 32)) / 6).astype(np.float32)
    with pytest.raises(Exception, match="FC3 is not implemented for CPU MoE"):
        _ort_moe(d, _attrs(case))


def test_pin_ort_cpu_refuses_swiglu_limit_after_activation():
    rng, _ = seeded_rng()
    case = MCase("swiglu", k=2, normalize=1, swiglu_fusion=1, limit=7.0)
    d = _make_data(case, rng)
    with pytest.raises(Exception, match="swiglu_limit_after_activation"):
        _ort_moe(d, _attrs(case, swiglu_limit_after_activation=1))


def test_pin_normalize_routing_weights_changes_moe():
    rng, seed = seeded_rng()
    case0 = MCase("relu", k=2, normalize=0, bias=True)
    case1 = MCase("relu", k=2, normalize=1, bias=True)
    d = _make_data(case0, rng)
    out0, out1 = _ort_moe(d, _attrs(case0)), _ort_moe(d, _attrs(case1))
    assert rel_err(out0, out1.astype(np.float64)) > 1e-2, f"seed={seed}"
    assert rel_err(out0, _oracle(d, case0)) <= EXACT, f"seed={seed}"
    assert rel_err(out1, _oracle(d, case1)) <= EXACT, f"seed={seed}"
    # normalize=0 weights are the plain softmax values: they sum to less than 1.
    _, w = moe_oracle.route_moe(d["router_probs"], 2, 0)
    assert np.all(w.sum(axis=1) < 1.0), f"seed={seed}"


@pytest.mark.parametrize("act", ["silu", "gelu", "relu", "identity"])
def test_pin_alpha_and_beta_only_affect_swiglu(act):
    rng, seed = seeded_rng()
    case = MCase(act, k=2, normalize=1, alpha=2.0, beta=0.5)
    d = _make_data(case, rng)
    want = _oracle(d, case)
    np.testing.assert_array_equal(want, _oracle(d, case, activation_alpha=1.0, activation_beta=0))
    assert rel_err(_ort_moe(d, _attrs(case)), want) <= EXACT, f"seed={seed}"


def test_pin_gelu_is_the_tanh_approximation():
    rng, seed = seeded_rng()
    h = 16
    x = rng.uniform(-4.0, 4.0, size=(8, h)).astype(np.float32)
    eye = np.eye(h, dtype=np.float32)[None]
    d = {
        "input": x,
        "router_probs": np.full((8, 1), 0.5, np.float32),
        "fc1": eye,
        "fc1_bias": None,
        "fc2": eye,
        "fc2_bias": None,
    }
    case = MCase("gelu", k=1, normalize=0, experts=1, hidden=h, inter=h)
    got = _ort_moe(d, _attrs(case)).astype(np.float64)
    tanh_form = moe_oracle.gelu_tanh(x)
    erf_form = 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    assert np.abs(got - tanh_form).max() <= 2e-6, f"seed={seed}"
    assert np.abs(got - erf_form).max() > 1e-5, f"seed={seed}"
    np.testing.assert_allclose(_oracle(d, case), tanh_form, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("normalize", [0, 1])
def test_pin_ties_select_the_highest_expert_index(normalize):
    rng, seed = seeded_rng()
    case = MCase("swiglu", k=2, normalize=normalize, swiglu_fusion=1, bias=True)
    d = _make_data(case, rng)
    d["input"] = d["input"][:4]
    d["router_probs"] = np.array(
        [[1, 1, 1, 1], [0.5, 2, 2, 0], [3, 1, 3, 3], [2, 2, 0, 1]], dtype=np.float32
    )
    want = _oracle(d, case)
    assert rel_err(_ort_moe(d, _attrs(case)), want) <= EXACT, f"seed={seed}"
    # Reversing the expert order turns "highest index" into "lowest index" (ONNX TopK): differs.
    rev = {n: (v[::-1].copy() if n.startswith("fc") and v is not None else v) for n, v in d.items()}
    rev["router_probs"] = d["router_probs"][:, ::-1].copy()
    assert rel_err(_oracle(rev, case), want) > 1e-3, f"seed={seed}"


# ---------------------------------------------------------------------------------------------
# Oracle contract errors
# ---------------------------------------------------------------------------------------------


def _valid(act: str = "relu", fusion: int = 0) -> tuple[list, dict]:
    e, h, inter = 4, 8, 6
    f = 2 if act == "swiglu" and fusion else 1
    args = [
        np.ones((3, h), np.float32),
        np.ones((3, e), np.float32),
        np.ones((e, f * inter, h), np.float32),
        np.ones((e, h, inter), np.float32),
    ]
    return args, dict(k=2, activation_type=act, swiglu_fusion=fusion)


def _with(i: int | None = None, value=None, act: str = "relu", fusion: int = 0, **kw):
    return altered(_valid(act, fusion), i, value, **kw)


_FC3 = np.ones((4, 6, 8), np.float32)

MOE_ERRORS = [
    ("k_too_big", _with(k=5), r"k = 5 must be in \[1, E\] = \[1, 4\]"),
    ("activation", _with(activation_type="softmax"), r"activation_type must be one of"),
    ("fusion3", _with(swiglu_fusion=3), r"swiglu_fusion must be 0, 1 or 2"),
    ("relu_fusion2", _with(swiglu_fusion=2), r"only applies to activation_type='swiglu'"),
    ("swiglu0_no_fc3", _with(act="swiglu"), r"fc3 is required"),
    ("relu_fc3", _with(fc3=_FC3), r"fc3 is only used by swiglu"),
    (
        "fc3_bias_alone",
        _with(act="silu", fc3_bias=np.ones((4, 6), np.float32)),
        r"fc3_bias is given",
    ),
    ("fc3_shape", _with(act="silu", fc3=np.ones((4, 8, 6), np.float32)), r"fc3 must have shape"),
    (
        "fc1_rows",
        _with(2, np.ones((4, 12, 8), np.float32)),
        r"fc1 must have shape \[E, fusion\*I, H\]",
    ),
    ("fc1_transposed", _with(2, np.ones((4, 8, 6), np.float32)), r"fc1 must have shape"),
    ("fc2_shape", _with(3, np.ones((4, 6, 8), np.float32)), r"fc2 must have shape \[E, H, I\]"),
    ("fc2_dtype", _with(3, np.ones((4, 8, 6), np.float64)), r"fc2 has dtype float64"),
    ("fc1_bias", _with(fc1_bias=np.ones((4, 12), np.float32)), r"fc1_bias must have shape"),
    ("normalize", _with(normalize_routing_weights=-1), r"normalize_routing_weights must be 0 or 1"),
    (
        "limit_zero",
        _with(act="swiglu", fusion=1, swiglu_limit=0.0),
        r"swiglu_limit must be positive",
    ),
    ("router_rank", _with(1, np.ones((3, 4, 1), np.float32)), r"router_probs must have rank 2"),
    ("input_rank4", _with(0, np.ones((1, 1, 3, 8), np.float32)), r"input must have rank 2"),
]


@pytest.mark.parametrize(
    ("call", "pattern"), [c[1:] for c in MOE_ERRORS], ids=[c[0] for c in MOE_ERRORS]
)
def test_moe_contract_errors(call, pattern):
    args, kwargs = call
    with pytest.raises(ValueError, match=pattern):
        moe(*args, **kwargs)
