"""The behaviour check's candidate formulas are ORT's: one MoE node on ORT 1.32 CPU, probed.

A MoE node with one expert, k = 1 and identity FC1/FC2 weights computes its activation on the
tokens themselves (an interleaved FC1 puts the gate of column ``j`` in row ``2j`` and its linear
operand in ``2j + 1``), so its output at the probe grid is ORT's activation; it must agree with
:mod:`onnx_moe_fuse.rewrites.moe.behaviour.activation`'s float64 formulas within the same
tolerance the check applies to a model's region.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from activation_layers import session
from onnx import TensorProto, helper, numpy_helper

from onnx_moe_fuse.rewrites.moe.behaviour.activation import single_candidate, swiglu
from onnx_moe_fuse.rewrites.moe.behaviour.probes import (
    atol_for,
    deviation,
    probe_values,
    rtol_for,
    small_values,
)

F32 = np.dtype(np.float32)


def _moe(h: int, w1: np.ndarray, w2: np.ndarray, **attrs) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")]
    node = helper.make_node(
        "MoE", ["x", "probs", "w1", "", "w2"], ["y"], domain="com.microsoft", k=1,
        normalize_routing_weights=1, **attrs,
    )  # fmt: skip
    graph = helper.make_graph(
        [node], "moe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", h]),
         helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["T", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", h])], inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    probs = np.zeros((x.shape[0], 1), np.float32)
    return session(model).run(None, {"x": x, "probs": probs})[0]


@pytest.mark.parametrize("kind", ["relu", "gelu", "silu", "identity"])
def test_elementwise_formulas_are_orts(kind: str) -> None:
    v = probe_values([7.0, 1.702])
    p = len(v)
    eye = np.eye(p, dtype=np.float32)[None]
    got = _run(_moe(p, eye, eye, activation_type=kind), v[None, :])[0]
    d = deviation(
        got, single_candidate(kind, v), np.abs(v.astype(np.float64)), rtol_for(F32), atol_for(F32)
    )
    assert d.agrees, (kind, d, v[d.at])


@pytest.mark.parametrize(("alpha", "beta", "limit"), [(1.0, 0.0, None), (1.702, 1.0, 7.0)])
def test_swiglu_formula_is_orts(alpha: float, beta: float, limit: float | None) -> None:
    consts = [alpha, beta] + ([limit] if limit else [])
    v, small = probe_values(consts), small_values(consts)
    g = np.concatenate([np.repeat(v, len(small)), np.tile(small, len(v))])
    lin = np.concatenate([np.tile(small, len(v)), np.repeat(v, len(small))])
    p = 256
    rows = -(-len(g) // p)
    g, lin = (np.resize(a, rows * p).reshape(rows, p) for a in (g, lin))
    w1 = np.zeros((1, 2 * p, 2 * p), np.float32)
    w1[0, 2 * np.arange(p), np.arange(p)] = 1  # row 2j: the gate of column j
    w1[0, 2 * np.arange(p) + 1, p + np.arange(p)] = 1  # row 2j + 1: its linear operand
    w2 = np.zeros((1, 2 * p, p), np.float32)
    w2[0, np.arange(p), np.arange(p)] = 1
    attrs = {"activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": alpha,
             "activation_beta": beta}  # fmt: skip
    if limit is not None:
        attrs["swiglu_limit"] = limit
    got = _run(_moe(2 * p, w1, w2, **attrs), np.concatenate([g, lin], axis=1))[:, :p]
    want, scale, mult = swiglu(g, lin, alpha, beta, limit)
    d = deviation(got, want, scale, rtol_for(F32), atol_for(F32) * (1 + mult))
    assert d.agrees, (d, g.reshape(-1)[d.at], lin.reshape(-1)[d.at])
