"""Tests of the wgpu evaluator (``onnx_moe_fuse.verify.evaluator``).

GroupedMatMul sample models run on the WebGPU GroupedMatMul kernel and must match the reference
path; nodes the kernels cannot take are refused with errors naming the node and the input; a
kernel package that is not installed is reported by name.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import nonzero_rel_err
from onnx import helper

from onnx_moe_fuse.samples import get_sample
from onnx_moe_fuse.verify import evaluator
from onnx_moe_fuse.verify.evaluator import (
    MATMUL_NBITS_QKV,
    QMOE,
    KernelNodeError,
    KernelPackageMissingError,
    UnsupportedNodeError,
    bind_node,
    missing_kernel_packages,
    run_wgpu,
)
from onnx_moe_fuse.verify.oracles.matmul_nbits_qkv import matmul_nbits_qkv
from onnx_moe_fuse.verify.oracles.quant import quantize_matmul_nbits
from onnx_moe_fuse.verify.reference import random_feeds, run_reference

RTOL = 1e-4
# The input bind keys of a QMoE manifest that implements no FC3, zero points or router weights.
QMOE_CORE = (
    "inputT",
    "routerT",
    "fc1T",
    "fc1ScalesT",
    "fc1BiasT",
    "fc2T",
    "fc2ScalesT",
    "fc2BiasT",
)
GMM_SAMPLES = [
    "mixtral_gmm_f32",
    "qwen3_gmm_int4b32",
    "gptoss_gmm_u8pc",
    "qwen2_gmm_f32_rank3",
]
_F32 = onnx.TensorProto.FLOAT
_I64 = onnx.TensorProto.INT64


def _gmm_model(dtype: int = _F32, **attrs: int) -> onnx.ModelProto:
    node = helper.make_node("GroupedMatMul", ["x", "w", "idx"], ["y"], name="gmm0", **attrs)
    graph = helper.make_graph(
        [node],
        "gmm",
        [
            helper.make_tensor_value_info("x", dtype, [3, 4]),
            helper.make_tensor_value_info("w", dtype, [2, 4, 5]),
            helper.make_tensor_value_info("idx", _I64, [3, 1]),
        ],
        [helper.make_tensor_value_info("y", dtype, [3, 1, 5])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 29)], ir_version=10)


def _gmm_feeds(rng: np.random.Generator, dtype: str = "float32") -> dict[str, np.ndarray]:
    return {
        "x": rng.standard_normal((3, 4)).astype(dtype),
        "w": rng.standard_normal((2, 4, 5)).astype(dtype),
        "idx": np.array([[0], [1], [1]], dtype=np.int64),
    }


def _qmoe_node(extra_inputs: dict[int, str]) -> onnx.NodeProto:
    inputs = ["x", "logits", "w1", "s1", "", "w2", "s2"]
    for position, name in extra_inputs.items():
        inputs += [""] * (position + 1 - len(inputs))
        inputs[position] = name
    return helper.make_node(
        "QMoE", inputs, ["y"], name="moe0", domain="com.microsoft", k=1, expert_weight_bits=4
    )


@pytest.mark.parametrize("name", GMM_SAMPLES)
def test_grouped_matmul_samples_match_reference(name: str, device, rng) -> None:
    sample = get_sample(name)
    seed = int(rng.integers(2**31))
    feeds = random_feeds(sample.model, seed, sample.dim_values)
    got = run_wgpu(sample.model, feeds, check_shapes=True)
    expected = run_reference(sample.model, feeds)
    assert got.keys() == expected.keys()
    for out, ref in expected.items():
        assert got[out].shape == ref.shape and got[out].dtype == ref.dtype
        err = nonzero_rel_err(got[out], ref)
        assert err <= RTOL, f"{name}/{out}: wgpu vs reference rel err {err:.2e} (seed {seed})"


def test_grouped_matmul_node_runs_on_the_kernel(device, rng, monkeypatch) -> None:
    """The node really goes through get_kernel (not through the numpy oracle)."""
    calls: list[str] = []
    real = evaluator.get_kernel

    def spy(name: str, *args, **kwargs):
        calls.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(evaluator, "get_kernel", spy)
    feeds = _gmm_feeds(rng)
    got = run_wgpu(_gmm_model(), feeds)["y"]
    assert calls == ["GroupedMatMul"]
    expected = np.einsum("mk,mskn->msn", feeds["x"], feeds["w"][feeds["idx"]])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_kernel_refusal_names_node_and_input(device, rng) -> None:
    with pytest.raises(KernelNodeError, match=r"GroupedMatMul node 'gmm0'.*input 0 input"):
        run_wgpu(_gmm_model(onnx.TensorProto.DOUBLE), _gmm_feeds(rng, "float64"))
    feeds = _gmm_feeds(rng)
    feeds["idx"] = np.array([[0], [2], [1]], dtype=np.int64)
    with pytest.raises(KernelNodeError, match=r"'gmm0'.*group_indices.*outside"):
        run_wgpu(_gmm_model(), feeds)


def test_unknown_attribute_is_refused(device, rng) -> None:
    with pytest.raises(UnsupportedNodeError, match=r"'gmm0': attribute foo=1"):
        run_wgpu(_gmm_model(foo=1), _gmm_feeds(rng))


@pytest.mark.parametrize(
    ("position", "what"),
    [(8, "fc3_experts_weights"), (14, "router_weights"), (15, "input 15")],
)
def test_qmoe_unsupported_inputs_are_refused(position: int, what: str) -> None:
    node = _qmoe_node({position: "extra"})
    values: list[np.ndarray | None] = [np.zeros(1, np.float32)] * 7
    values += [None] * (position - 7) + [np.zeros(1, np.float32)]
    with pytest.raises(UnsupportedNodeError, match=rf"QMoE node 'moe0'.*{what}.*'extra'"):
        bind_node(QMOE, node, values, {"k": 1, "expert_weight_bits": 4}, QMOE_CORE)


def test_qmoe_zero_points_dropped_only_when_symmetric() -> None:
    node = _qmoe_node({11: "zp1"})
    z = np.zeros(1, np.float32)
    base: list[np.ndarray | None] = [z, z, z, z, None, z, z, None, None, None, None]
    attrs = {"expert_weight_bits": 4, "block_size": 0, "swiglu_limit": float("inf")}
    symmetric = np.full((2, 3, 1), 0x88, np.uint8)
    tensors, kept, _ = bind_node(QMOE, node, [*base, symmetric], attrs, QMOE_CORE)
    assert set(tensors) == {"inputT", "routerT", "fc1T", "fc1ScalesT", "fc2T", "fc2ScalesT"}
    assert kept == {"expert_weight_bits": 4}  # block_size 0 / infinite limit mean "absent"
    with pytest.raises(UnsupportedNodeError, match=r"input 11 fc1_zero_points.*symmetric"):
        bind_node(QMOE, node, [*base, np.full((2, 3, 1), 0x78, np.uint8)], attrs, QMOE_CORE)
    # A kernel that declares the zero-point input gets it as it is.
    tensors, _, _ = bind_node(QMOE, node, [*base, symmetric], attrs, [*QMOE_CORE, "fc1ZeroPointsT"])
    assert tensors["fc1ZeroPointsT"] is not None


def test_missing_kernel_package_is_named(monkeypatch) -> None:
    def no_packages(name: str, *args, **kwargs):
        raise KeyError(f"no kernel package {name!r} version 1 (have: GroupedMatMul v1)")

    monkeypatch.setattr(evaluator, "get_kernel", no_packages)
    node = _qmoe_node({})
    x = helper.make_tensor_value_info("x", _F32, ["T", 8])
    y = helper.make_tensor_value_info("y", _F32, ["T", 8])
    graph = helper.make_graph([node], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("com.microsoft", 1)])
    missing = missing_kernel_packages(model)
    assert list(missing) == ["com.microsoft.QMoE"]
    assert "kernels/qmoe" in missing["com.microsoft.QMoE"]
    values = [np.zeros((2, 8), np.float32)] * 7
    with pytest.raises(KernelPackageMissingError, match=r"com\.microsoft\.QMoE.*kernels/qmoe"):
        evaluator.run_node(QMOE, node, values, {"k": 1})


def _qkv_model(with_skip: bool, with_residual: bool, q_bias: bool = False) -> onnx.ModelProto:
    k, nq, nkv = 64, 32, 16
    inputs = ["a", "skip" if with_skip else "", "gamma", "qb", "qs", "qbias" if q_bias else ""]
    inputs += ["kb", "ks", "", "vb", "vs"]
    outputs = ["q", "k", "v"] + (["res"] if with_residual else [])
    node = helper.make_node(
        "MatMulNBitsQkv",
        inputs,
        outputs,
        name="qkv0",
        domain="com.microsoft",
        K=k,
        Nq=nq,
        Nkv=nkv,
        block_size=32,
        bits=4,
        epsilon=1e-6,
        accuracy_level=0,
    )
    graph_inputs = [helper.make_tensor_value_info("a", _F32, ["T", k])]
    if with_skip:
        graph_inputs.append(helper.make_tensor_value_info("skip", _F32, ["T", k]))
    graph_outputs = [
        helper.make_tensor_value_info(name, _F32, ["T", n])
        for name, n in (("q", nq), ("k", nkv), ("v", nkv), ("res", k))[: len(outputs)]
    ]
    graph = helper.make_graph([node], "qkv", graph_inputs, graph_outputs)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
        ir_version=10,
    )


def _qkv_weights(rng: np.random.Generator, with_bias: bool = False) -> dict[str, np.ndarray]:
    weights = {"gamma": (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)}
    for name, n in (("q", 32), ("k", 16), ("v", 16)):
        b, s = quantize_matmul_nbits(rng.standard_normal((n, 64)) * 0.2, 4, 32)
        weights[f"{name}b"], weights[f"{name}s"] = b, s.astype(np.float32)
    if with_bias:
        weights["qbias"] = np.zeros(32, np.float32)
    return weights


@pytest.mark.parametrize("with_skip", [False, True])
def test_matmul_nbits_qkv_runs_on_its_kernel(with_skip: bool, device, rng) -> None:
    missing = missing_kernel_packages(_qkv_model(with_skip, True))
    if missing:
        pytest.skip("; ".join(missing.values()))
    model = _qkv_model(with_skip, with_residual=with_skip)
    weights = _qkv_weights(rng)
    for name, value in weights.items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    feeds = {"a": rng.standard_normal((5, 64)).astype(np.float32)}
    if with_skip:
        feeds["skip"] = rng.standard_normal((5, 64)).astype(np.float32)
    got = run_wgpu(model, feeds)
    w = weights
    expected = matmul_nbits_qkv(
        feeds["a"], feeds.get("skip"), w["gamma"], w["qb"], w["qs"], w["kb"], w["ks"],
        w["vb"], w["vs"], K=64, Nq=32, Nkv=16, block_size=32, bits=4, epsilon=1e-6,
    )  # fmt: skip
    for name, ref in zip(("q", "k", "v", "res"), expected, strict=True):
        if name not in got:
            assert ref is None or not with_skip
            continue
        err = nonzero_rel_err(got[name], ref)
        assert err <= RTOL, f"{name}: wgpu vs oracle rel err {err:.2e}"


def test_matmul_nbits_qkv_bias_is_refused_unless_declared(rng) -> None:
    model = _qkv_model(False, False, q_bias=True)
    node = model.graph.node[0]
    w = _qkv_weights(rng, with_bias=True)
    a = np.zeros((2, 64), np.float32)
    values = [a, None, w["gamma"], w["qb"], w["qs"], w["qbias"], w["kb"], w["ks"], None]
    values += [w["vb"], w["vs"]]
    declared = ["aT", "skipT", "normScaleT", "qBT", "qScalesT", "kBT", "kScalesT", "vBT"]
    with pytest.raises(UnsupportedNodeError, match=r"'qkv0': input 5 q_bias.*a Q bias"):
        bind_node(MATMUL_NBITS_QKV, node, values, {}, [*declared, "vScalesT"])


def test_unfused_com_microsoft_ops_run_on_the_wgpu_path_as_on_the_reference(rng) -> None:
    """MatMulNBits and the simplified norms have no kernel package: the reference code runs them.

    No device is needed: the model holds no kernel op. Checked against the oracles (independent
    numpy code) and against the reference path.
    """
    from onnx_moe_fuse.verify.oracles.matmul_nbits_qkv import matmul_nbits, rms_norm
    from onnx_moe_fuse.verify.ort_nodes import make_model

    assert {c.__name__ for c in evaluator.REFERENCE_OP_CLASSES} == {
        "GatherElements",  # onnx 1.23's own misreads axis=-1 (verify/reference.py)
        "MatMulNBits",
        "SimplifiedLayerNormalization",
        "SkipSimplifiedLayerNormalization",
    }
    w = _qkv_weights(rng)
    nodes = [
        helper.make_node(
            "SkipSimplifiedLayerNormalization", ["a", "skip", "gamma"], ["normed", "", "", "sum"],
            domain="com.microsoft", epsilon=1e-6,
        ),
        helper.make_node(
            "SimplifiedLayerNormalization", ["sum", "gamma"], ["normed2"], axis=-1, epsilon=1e-6
        ),
        helper.make_node(
            "MatMulNBits", ["normed", "qb", "qs"], ["q"], domain="com.microsoft", K=64, N=32, bits=4,
            block_size=32,
        ),
    ]  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, _F32, [5, 64]) for n in ("a", "skip")]
    outputs = [helper.make_tensor_value_info(n, _F32, None) for n in ("q", "normed2")]
    inits = [onnx.numpy_helper.from_array(w[k], k) for k in ("gamma", "qb", "qs")]
    model = make_model(nodes, inputs, outputs, inits)
    feeds = {k: rng.standard_normal((5, 64)).astype(np.float32) for k in ("a", "skip")}
    got = run_wgpu(model, feeds)
    ref = run_reference(model, feeds)
    for name in ("q", "normed2"):
        np.testing.assert_array_equal(got[name], ref[name])
    normed, total = rms_norm(feeds["a"], w["gamma"], 1e-6, feeds["skip"])
    normed2, _ = rms_norm(total, w["gamma"], 1e-6)
    want_q = matmul_nbits(normed, w["qb"], w["qs"], bits=4, block_size=32)
    assert nonzero_rel_err(got["q"], want_q) <= RTOL
    assert nonzero_rel_err(got["normed2"], normed2) <= RTOL
