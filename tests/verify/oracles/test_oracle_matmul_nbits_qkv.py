"""The MatMulNBitsQkv oracle against ONNX Runtime's CPU composition, plus MatMulNBits alone.

ORT 1.32 has no CPU kernel for ``com.microsoft.MatMulNBitsQkv`` (pinned below), so the reference
is the composition it replaces: ``SimplifiedLayerNormalization`` (ai.onnx domain, registered by
ORT at since_version 1) or ``com.microsoft.SkipSimplifiedLayerNormalization`` (its output 3 is
``A + skip``), then three ``com.microsoft.MatMulNBits`` (bits 4, block_size 32, accuracy_level
0). Weights, scales and the norm scale are initializers; graph optimisations are off.

Error measure: ``max|ort - oracle| / max|oracle|``. float32 is exact to rounding (1e-5 bound);
float16 gets 5e-3 because ORT's composition rounds the normalised activations to float16 before
the matmuls and the oracle does not.

Random inputs are fresh each run (seed in the messages; ``TEST_SEED`` replays one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from helpers import altered, rel_err, seeded_rng

from onnx_moe_fuse.verify.oracles.matmul_nbits_qkv import matmul_nbits, matmul_nbits_qkv, rms_norm
from onnx_moe_fuse.verify.oracles.quant import quantize_matmul_nbits
from onnx_moe_fuse.verify.ort_nodes import node_model, run_node, run_qkv_composition, session

ort = pytest.importorskip("onnxruntime")

TOL = {np.float32: 1e-5, np.float16: 5e-3}
EPSILON = 1e-6


@dataclass(frozen=True)
class QkvCase:
    """One MatMulNBitsQkv configuration; the data is random per run."""

    dtype: type
    lead: tuple[int, ...]
    skip: bool
    k: int = 96
    nq: int = 64
    nkv: int = 32

    @property
    def id(self) -> str:
        """Readable test id."""
        shape = "x".join(str(d) for d in (*self.lead, self.k))
        skip = "skip" if self.skip else "noskip"
        return f"{np.dtype(self.dtype).name}-{shape}-{skip}-Nq{self.nq}-Nkv{self.nkv}"


CASES = [
    QkvCase(dtype, lead, skip)
    for dtype in (np.float32, np.float16)
    for lead in ((1,), (5,), (1, 1), (2, 3))
    for skip in (False, True)
] + [
    QkvCase(np.float32, (3,), True, k=80, nq=48, nkv=16),  # K not a multiple of block_size
    QkvCase(np.float16, (1, 2), False, k=80, nq=32, nkv=32),
    QkvCase(np.float32, (2, 2), True, k=256, nq=128, nkv=64),
]


def _make_data(case: QkvCase, rng: np.random.Generator) -> dict:
    dt = case.dtype
    d = {
        "a": rng.standard_normal((*case.lead, case.k)).astype(dt),
        "skip": rng.standard_normal((*case.lead, case.k)).astype(dt) if case.skip else None,
        "norm_scale": rng.uniform(0.5, 1.5, case.k).astype(dt),
    }
    for name, n in (("q", case.nq), ("k", case.nkv), ("v", case.nkv)):
        w = rng.standard_normal((n, case.k)) / np.sqrt(case.k)
        d[f"{name}_b"], d[f"{name}_scales"] = quantize_matmul_nbits(w, 4, 32, rng, scale_dtype=dt)
    return d


def _ort_composition(case: QkvCase, d: dict) -> list[np.ndarray]:
    """ORT's composition on the case: Q, K, V and, with skip, the residual."""
    call = {
        "aT": d["a"],
        "skipT": d["skip"],
        "normScaleT": d["norm_scale"],
        **{f"{p}BT": d[f"{p}_b"] for p in "qkv"},
        **{f"{p}ScalesT": d[f"{p}_scales"] for p in "qkv"},
    }
    out = run_qkv_composition(call, _qkv_attrs(case))
    return [out[key] for key in ("qT", "kT", "vT", "residualT") if key in out]


#: The oracle's array arguments, in order, as named in ``_make_data``.
ARGS = ("a", "skip", "norm_scale", "q_b", "q_scales", "k_b", "k_scales", "v_b", "v_scales")


def _qkv_attrs(case: QkvCase) -> dict:
    """The MatMulNBitsQkv attributes of a case (4-bit weights in blocks of 32)."""
    return dict(K=case.k, Nq=case.nq, Nkv=case.nkv, block_size=32, bits=4, epsilon=EPSILON)


def _oracle(case: QkvCase, d: dict):
    return matmul_nbits_qkv(*(d[n] for n in ARGS), **_qkv_attrs(case))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_qkv_matches_ort_composition(case: QkvCase):
    rng, seed = seeded_rng()
    d = _make_data(case, rng)
    q, k, v, residual = _oracle(case, d)
    got = _ort_composition(case, d)
    for name, want, have in zip("QKV", (q, k, v), got[:3], strict=True):
        assert want.dtype == np.dtype(case.dtype), f"{name} dtype"
        assert want.shape == (*case.lead, case.nq if name == "Q" else case.nkv)
        err = rel_err(have, want)
        assert err <= TOL[case.dtype], f"{case.id} {name}: {err:.3g} (seed={seed})"
    if case.skip:
        assert residual is not None and residual.dtype == np.dtype(case.dtype)
        np.testing.assert_array_equal(residual, got[3], err_msg=f"seed={seed}")
    else:
        assert residual is None


NBITS_CASES = [
    (bits, block, k, dtype)
    for bits in (2, 4, 8)
    for block, k in ((16, 64), (32, 80), (128, 256))
    for dtype in (np.float32, np.float16)
]


@pytest.mark.parametrize(
    ("bits", "block", "k", "dtype"),
    NBITS_CASES,
    ids=[f"{b}b-blk{bl}-K{k}-{np.dtype(t).name}" for b, bl, k, t in NBITS_CASES],
)
def test_matmul_nbits_matches_ort(bits, block, k, dtype):
    rng, seed = seeded_rng()
    n = 24
    b, scales = quantize_matmul_nbits(
        rng.standard_normal((n, k)), bits, block, rng, scale_dtype=dtype
    )
    a = rng.standard_normal((2, 3, k)).astype(dtype)
    attrs = dict(K=k, N=n, bits=bits, block_size=block, accuracy_level=0)
    got = run_node("MatMulNBits", [a, b, scales], attrs, const=(1, 2))
    want = matmul_nbits(a, b, scales, bits, block)
    assert want.dtype == np.dtype(dtype) and want.shape == (2, 3, n)
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"{bits}-bit block {block}: {err:.3g} (seed={seed})"


def test_rms_norm_properties():
    rng, seed = seeded_rng()
    a = rng.standard_normal((4, 64))
    skip = rng.standard_normal((4, 64))
    normed, residual = rms_norm(a, np.ones(64), 0.0, skip)
    np.testing.assert_allclose(residual, a + skip, rtol=1e-15, err_msg=f"seed={seed}")
    np.testing.assert_allclose(np.mean(normed**2, axis=-1), 1.0, rtol=1e-12, err_msg=f"seed={seed}")
    scale = rng.uniform(0.5, 2.0, 64)
    scaled, none = rms_norm(a, scale, 1e-6)
    assert none is None
    ref = a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + 1e-6) * scale
    np.testing.assert_allclose(scaled, ref, rtol=1e-12, err_msg=f"seed={seed}")


def test_pin_matmul_nbits_qkv_has_no_cpu_kernel():
    rng, _ = seeded_rng()
    case = QkvCase(np.float32, (2,), False)
    d = _make_data(case, rng)
    weights = [d[n] for n in ("q_b", "q_scales", "k_b", "k_scales", "v_b", "v_scales")]
    model, _ = node_model(
        "MatMulNBitsQkv",
        [d["a"], None, d["norm_scale"], *weights[:2], None, *weights[2:4], None, *weights[4:]],
        {**_qkv_attrs(case), "accuracy_level": 0},
        const=(2, 3, 4, 6, 7, 9, 10),
        outputs=("Q", "K", "V"),
    )
    with pytest.raises(Exception, match="Could not find an implementation for MatMulNBitsQkv"):
        session(model)


# ---------------------------------------------------------------------------------------------
# Oracle contract errors
# ---------------------------------------------------------------------------------------------


def _valid() -> tuple[list, dict]:
    rng = np.random.default_rng(0)
    case = QkvCase(np.float32, (2,), True, k=64, nq=32, nkv=16)
    d = _make_data(case, rng)
    return [d[n] for n in ARGS], _qkv_attrs(case)


def _with(i: int | None = None, value=None, **kw):
    return altered(_valid(), i, value, **kw)


QKV_ERRORS = [
    ("K_attr", _with(K=32), r"a has last axis 64, but K = 32"),
    ("Nq_attr", _with(Nq=16), r"q_B must have shape \[N, k_blocks, blob_size\] = \(16, 2, 16\)"),
    ("k_B_shape", _with(5, np.zeros((16, 1, 16), np.uint8)), r"k_B must have shape"),
    ("v_B_dtype", _with(7, np.zeros((16, 2, 16), np.int8)), r"v_B must be uint8"),
    ("q_scales_shape", _with(4, np.ones((32, 3), np.float32)), r"q_scales must have shape"),
    ("k_scales_dtype", _with(6, np.ones((16, 2), np.float16)), r"k_scales has dtype float16"),
    ("skip_shape", _with(1, np.ones((3, 64), np.float32)), r"skip must have a's shape"),
    ("skip_dtype", _with(1, np.ones((2, 64), np.float16)), r"skip has dtype float16"),
    ("norm_scale_shape", _with(2, np.ones(32, np.float32)), r"norm_scale must have shape \[K\]"),
    ("a_rank", _with(0, np.ones(64, np.float32), skip=None), r"a must have rank 2"),
    ("a_dtype", _with(0, np.ones((2, 64), np.int32)), r"a must be float16, float32 or float64"),
    ("block_size", _with(block_size=8), r"block_size must be a power of two >= 16"),
    ("bits", _with(bits=3), r"bits must be one of"),
    ("epsilon", _with(epsilon=-1.0), r"epsilon must be finite and >= 0"),
    ("Nkv_zero", _with(Nkv=0), r"Nkv must be a positive integer"),
]


@pytest.mark.parametrize(
    ("call", "pattern"), [c[1:] for c in QKV_ERRORS], ids=[c[0] for c in QKV_ERRORS]
)
def test_qkv_contract_errors(call, pattern):
    args, kwargs = call
    if "skip" in kwargs:
        args[1] = kwargs.pop("skip")
    with pytest.raises(ValueError, match=pattern):
        matmul_nbits_qkv(*args, **kwargs)


def test_matmul_nbits_errors():
    a = np.ones((2, 64), np.float32)
    b, s = quantize_matmul_nbits(np.ones((8, 64)))
    with pytest.raises(ValueError, match=r"scales has dtype float16, but a has dtype float32"):
        matmul_nbits(a, b, s.astype(np.float16))
    with pytest.raises(
        ValueError, match=r"b_packed must have shape \[N, k_blocks, blob_size\] = \(8, 3, 16\)"
    ):
        matmul_nbits(np.ones((2, 96), np.float32), b, s)
