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

import os
import secrets
from dataclasses import dataclass

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_moe_fuse.oracles.matmul_nbits_qkv import matmul_nbits, matmul_nbits_qkv, rms_norm
from onnx_moe_fuse.oracles.quant import quantize_matmul_nbits

ort = pytest.importorskip("onnxruntime")

TOL = {np.float32: 1e-5, np.float16: 5e-3}
EPSILON = 1e-6


def _rng() -> tuple[np.random.Generator, int]:
    seed = int(os.environ.get("TEST_SEED", secrets.randbits(32)))
    return np.random.default_rng(seed), seed


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """``max|got - want| / max|want|``."""
    assert got.shape == want.shape, (got.shape, want.shape)
    want64 = want.astype(np.float64)
    return float(np.abs(got.astype(np.float64) - want64).max() / max(np.abs(want64).max(), 1e-30))


def _session(nodes, inputs, outputs, initializers):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
        ir_version=10,
    )
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    so.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


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
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(case.dtype))
    inputs = [helper.make_tensor_value_info("A", elem, d["a"].shape)]
    feeds = {"A": d["a"]}
    inits = [numpy_helper.from_array(d["norm_scale"], "gamma")]
    if case.skip:
        inputs.append(helper.make_tensor_value_info("skip", elem, d["skip"].shape))
        feeds["skip"] = d["skip"]
        norm = helper.make_node(
            "SkipSimplifiedLayerNormalization",
            ["A", "skip", "gamma"],
            ["normed", "", "", "residual"],
            domain="com.microsoft",
            epsilon=EPSILON,
        )
    else:
        norm = helper.make_node(
            "SimplifiedLayerNormalization",
            ["A", "gamma"],
            ["normed"],
            axis=-1,
            epsilon=EPSILON,
            stash_type=1,
        )
    nodes = [norm]
    out_names = ["Q", "K", "V"] + (["residual"] if case.skip else [])
    for name, n, out in (("q", case.nq, "Q"), ("k", case.nkv, "K"), ("v", case.nkv, "V")):
        inits += [
            numpy_helper.from_array(d[f"{name}_b"], f"{name}_B"),
            numpy_helper.from_array(d[f"{name}_scales"], f"{name}_scales"),
        ]
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                ["normed", f"{name}_B", f"{name}_scales"],
                [out],
                domain="com.microsoft",
                K=case.k,
                N=n,
                bits=4,
                block_size=32,
                accuracy_level=0,
            )
        )
    outputs = [helper.make_tensor_value_info(o, elem, None) for o in out_names]
    return _session(nodes, inputs, outputs, inits).run(out_names, feeds)


def _oracle(case: QkvCase, d: dict):
    return matmul_nbits_qkv(
        d["a"],
        d["skip"],
        d["norm_scale"],
        d["q_b"],
        d["q_scales"],
        d["k_b"],
        d["k_scales"],
        d["v_b"],
        d["v_scales"],
        K=case.k,
        Nq=case.nq,
        Nkv=case.nkv,
        block_size=32,
        bits=4,
        epsilon=EPSILON,
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_qkv_matches_ort_composition(case: QkvCase):
    rng, seed = _rng()
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
    rng, seed = _rng()
    n = 24
    b, scales = quantize_matmul_nbits(
        rng.standard_normal((n, k)), bits, block, rng, scale_dtype=dtype
    )
    a = rng.standard_normal((2, 3, k)).astype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = helper.make_node(
        "MatMulNBits",
        ["A", "B", "S"],
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=block,
        accuracy_level=0,
    )
    sess = _session(
        [node],
        [helper.make_tensor_value_info("A", elem, a.shape)],
        [helper.make_tensor_value_info("Y", elem, None)],
        [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S")],
    )
    got = sess.run(["Y"], {"A": a})[0]
    want = matmul_nbits(a, b, scales, bits, block)
    assert want.dtype == np.dtype(dtype) and want.shape == (2, 3, n)
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"{bits}-bit block {block}: {err:.3g} (seed={seed})"


def test_rms_norm_properties():
    rng, seed = _rng()
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
    rng, _ = _rng()
    case = QkvCase(np.float32, (2,), False)
    d = _make_data(case, rng)
    inits = [
        numpy_helper.from_array(d[n], n)
        for n in ("norm_scale", "q_b", "q_scales", "k_b", "k_scales", "v_b", "v_scales")
    ]
    node = helper.make_node(
        "MatMulNBitsQkv",
        ["A", "", "norm_scale", "q_b", "q_scales", "", "k_b", "k_scales", "", "v_b", "v_scales"],
        ["Q", "K", "V"],
        domain="com.microsoft",
        K=case.k,
        Nq=case.nq,
        Nkv=case.nkv,
        block_size=32,
        bits=4,
        epsilon=EPSILON,
        accuracy_level=0,
    )
    with pytest.raises(Exception, match="Could not find an implementation for MatMulNBitsQkv"):
        _session(
            [node],
            [helper.make_tensor_value_info("A", TensorProto.FLOAT, d["a"].shape)],
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in "QKV"],
            inits,
        )


# ---------------------------------------------------------------------------------------------
# Oracle contract errors
# ---------------------------------------------------------------------------------------------


def _valid() -> tuple[list, dict]:
    rng = np.random.default_rng(0)
    case = QkvCase(np.float32, (2,), True, k=64, nq=32, nkv=16)
    d = _make_data(case, rng)
    args = [
        d[n]
        for n in (
            "a",
            "skip",
            "norm_scale",
            "q_b",
            "q_scales",
            "k_b",
            "k_scales",
            "v_b",
            "v_scales",
        )
    ]
    return args, dict(K=64, Nq=32, Nkv=16, block_size=32, bits=4, epsilon=EPSILON)


def _with(i: int | None = None, value=None, **kw):
    args, kwargs = _valid()
    if i is not None:
        args[i] = value
    kwargs.update(kw)
    return args, kwargs


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
