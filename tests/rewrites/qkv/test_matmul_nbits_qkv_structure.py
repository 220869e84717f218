"""The RMS norm + Q/K/V rule: structure it must see through, and what it must refuse.

As in ``test_matmul_nbits_qkv_rule.py``: the rule set is applied with onnxscript's rewriter
directly; inputs are fresh random values on every run (``TEST_SEED=<seed>`` replays them).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import pytest
from qkv_rule_helpers import (
    SAMPLES,
    TOL,
    assert_unchanged,
    attrs,
    fuse,
    fused_nodes,
    fused_sample,
    inits,
    op_counts,
    reasons,
    rel_err,
    seed_of,
    slots,
)

from onnx_moe_fuse.rewrites.qkv.rule import (
    near_misses,
)
from onnx_moe_fuse.samples import all_samples, get_sample
from onnx_moe_fuse.samples.qkv import QkvSpec, build_qkv
from onnx_moe_fuse.verify.checker import verify
from onnx_moe_fuse.verify.reference import random_feeds, run_reference

# -- structure the rule must see through, and refusals ---------------------------------------------


def _edit(model: onnx.ModelProto, fn) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    fn(m)
    return m


def _set_attr(model: onnx.ModelProto, op: str, name: str, value) -> None:
    for node in model.graph.node:
        if node.op_type == op:
            for a in list(node.attribute):
                if a.name == name:
                    node.attribute.remove(a)
            node.attribute.append(oh.make_attribute(name, value))


def _add_init(model: onnx.ModelProto, name: str, array: np.ndarray) -> None:
    model.graph.initializer.append(onnx.numpy_helper.from_array(array, name))


def _nbits_bias(m: onnx.ModelProto) -> None:
    node = next(n for n in m.graph.node if n.op_type == "MatMulNBits")
    _add_init(m, "bias_0", np.zeros(attrs(node)["N"], np.float32))
    node.input.extend(["", "", "bias_0"])


def _nbits_g_idx(order: str):
    def edit(m: onnx.ModelProto) -> None:
        g = np.arange(96, dtype=np.int32) // 32
        if order == "shuffled":
            g = g[::-1].copy()
        _add_init(m, "g_idx", g)
        for node in m.graph.node:
            if node.op_type == "MatMulNBits":
                node.input.extend(["", "g_idx"])

    return edit


def _uint4_without_zero_point(m: onnx.ModelProto) -> None:
    for node in m.graph.node:
        if node.op_type == "DequantizeLinear":
            del node.input[2:]


def _int4_zero_point(m: onnx.ModelProto) -> None:
    weights = inits(m)
    for node in m.graph.node:
        if node.op_type == "DequantizeLinear":
            name = node.input[0] + "_zp"
            shape = weights[node.input[1]].shape  # the scale's [k_blocks, N]
            _add_init(m, name, np.full(shape, 1, ml_dtypes.int4))
            node.input.append(name)


def _float_weight(m: onnx.ModelProto) -> None:
    dq = next(n for n in m.graph.node if n.op_type == "DequantizeLinear")
    m.graph.node.remove(dq)
    _add_init(m, dq.output[0], np.zeros((96, 64), np.float32))


def _fourth_projection(m: onnx.ModelProto) -> None:
    node = next(n for n in m.graph.node if n.op_type == "MatMulNBits")
    extra = onnx.NodeProto()
    extra.CopyFrom(node)
    extra.output[0] = "p4"
    m.graph.node.append(extra)
    n = attrs(node)["N"]
    m.graph.output.append(oh.make_tensor_value_info("p4", onnx.TensorProto.FLOAT, ["T", n]))


def _ssln_bias(m: onnx.ModelProto) -> None:
    _add_init(m, "ssln_bias", np.zeros(96, np.float32))
    next(n for n in m.graph.node if n.op_type == "SkipSimplifiedLayerNormalization").input.append(
        "ssln_bias"
    )


def _reduce_first_axis(m: onnx.ModelProto) -> None:
    for node in m.graph.node:
        if node.op_type == "ReduceMean":
            for a in node.attribute:
                if a.name == "axes":
                    a.ints[:] = [0]


def _pow3(m: onnx.ModelProto) -> None:
    for t in m.graph.initializer:
        if t.name == "rms_two":
            t.CopyFrom(onnx.numpy_helper.from_array(np.array(3.0, np.float32), t.name))


def _no_shapes(m: onnx.ModelProto) -> None:
    for v in [*m.graph.input, *m.graph.output]:
        v.type.tensor_type.ClearField("shape")


REFUSALS = [
    ("qkv_sln_nbits_kvq_order", _nbits_bias, "bias input"),
    ("qkv_sln_nbits_kvq_order", _nbits_g_idx("shuffled"), "g_idx"),
    ("qkv_rms23_dq_uint4_f16", _uint4_without_zero_point, "asymmetric zero point"),
    ("qkv_decomposed_recip_dq_int4_rank3", _int4_zero_point, "asymmetric zero points"),
    ("qkv_add_sln_dq_int4_residual", _float_weight, "not a DequantizeLinear output"),
    ("qkv_sln_nbits_kvq_order", _fourth_projection, "feeds 4 projections"),
    ("qkv_skip_sln_nbits_residual_rank3", _ssln_bias, "with a bias input"),
    ("qkv_decomposed_nbits", _reduce_first_axis, "not the last axis"),
    ("qkv_decomposed_nbits", _pow3, "not 2"),
    (
        "qkv_sln_nbits_kvq_order",
        lambda m: _set_attr(m, "SimplifiedLayerNormalization", "axis", 0),
        "axis 0",
    ),
    ("qkv_sln_nbits_kvq_order", _no_shapes, "unknown rank"),
]


@pytest.mark.parametrize(("name", "edit", "keyword"), REFUSALS, ids=[r[2] for r in REFUSALS])
def test_refusals(name: str, edit, keyword: str) -> None:
    model = _edit(get_sample(name).model, edit)
    assert_unchanged(model)
    why = reasons(model)
    assert any(keyword in r for r in why), why


def test_plain_g_idx_still_fuses() -> None:
    model = _edit(get_sample("qkv_sln_nbits_kvq_order").model, _nbits_g_idx("plain"))
    assert len(fused_nodes(fuse(model))) == 1


def _fused_and_checked(model: onnx.ModelProto, dims: dict[str, int], rng) -> onnx.ModelProto:
    fused = fuse(model)
    assert len(fused_nodes(fused)) == 1, op_counts(fused)
    seed = seed_of(rng)
    feeds = random_feeds(model, seed, dims)
    want = run_reference(model, feeds)
    got = run_reference(fused, feeds)
    for out, value in want.items():
        assert rel_err(got[out], value) <= TOL[value.dtype], (out, seed)
    return fused


def test_mixed_projection_kinds(rng: np.random.Generator) -> None:
    """Q from MatMulNBits, K and V from DequantizeLinear + MatMul (the "ndd" mix)."""
    a = build_qkv(QkvSpec("mix_a", "sln", "nbits"))
    b = build_qkv(QkvSpec("mix_b", "sln", "dq_int4"))
    m = onnx.ModelProto()
    m.CopyFrom(a)
    keep = [n for n in a.graph.node if n.output[0] not in ("k", "v")]
    add = [n for n in b.graph.node if n.op_type != "SimplifiedLayerNormalization"]
    add = [n for n in add if n.output[0] not in ("q", "q_proj_weight")]
    del m.graph.node[:]
    m.graph.node.extend(keep + add)
    weights = [t for t in a.graph.initializer if not t.name.startswith(("k_", "v_"))]
    weights += [t for t in b.graph.initializer if t.name.startswith(("k_", "v_"))]
    del m.graph.initializer[:]
    m.graph.initializer.extend(weights)
    fused = _fused_and_checked(m, {"T": 5}, rng)
    (node,) = fused_nodes(fused)
    assert slots(node)["q_B"] == "q_proj_B" and slots(node)["k_B"] != "k_proj_B"


def test_broadcast_skip_add_reads_the_sum(rng: np.random.Generator) -> None:
    """Add(x, bias [K]) is no skip: the fused node reads the sum as A, the Add stays."""
    model = build_qkv(QkvSpec("bcast", "add_sln", "nbits", residual_output=True))

    def edit(m: onnx.ModelProto) -> None:
        m.graph.input.remove(next(i for i in m.graph.input if i.name == "skip"))
        _add_init(m, "skip", np.linspace(-1, 1, 96, dtype=np.float32))

    model = _edit(model, edit)
    fused = _fused_and_checked(model, {"T": 5}, rng)
    (node,) = fused_nodes(fused)
    assert (slots(node)["A"], slots(node)["skip"], len(node.output)) == ("residual", "", 3)
    assert op_counts(fused)["Add"] == 1


def test_residual_reader_before_the_norm_keeps_the_add(rng: np.random.Generator) -> None:
    model = build_qkv(QkvSpec("early", "add_sln", "nbits"))

    def edit(m: onnx.ModelProto) -> None:
        nodes = list(m.graph.node)
        at = next(i for i, n in enumerate(nodes) if n.op_type == "Add") + 1
        nodes.insert(at, oh.make_node("Neg", ["residual"], ["early_reader"]))
        del m.graph.node[:]
        m.graph.node.extend(nodes)
        m.graph.output.append(
            oh.make_tensor_value_info("early_reader", onnx.TensorProto.FLOAT, ["T", 96])
        )

    model = _edit(model, edit)
    fused = _fused_and_checked(model, {"T": 5}, rng)
    (node,) = fused_nodes(fused)
    assert (slots(node)["A"], slots(node)["skip"], len(node.output)) == ("residual", "", 3)


def test_normed_as_graph_output_keeps_the_norm(rng: np.random.Generator) -> None:
    model = build_qkv(QkvSpec("normed_out", "skip_sln", "nbits", residual_output=True))
    model = _edit(
        model,
        lambda m: m.graph.output.append(
            oh.make_tensor_value_info("normed", onnx.TensorProto.FLOAT, ["T", 96])
        ),
    )
    fused = _fused_and_checked(model, {"T": 5}, rng)
    (node,) = fused_nodes(fused)
    assert (slots(node)["A"], slots(node)["skip"]) == ("residual", "")
    assert op_counts(fused)["SkipSimplifiedLayerNormalization"] == 1


def test_float16_decomposed_without_casts(device, rng: np.random.Generator) -> None:
    del device
    spec = QkvSpec("f16_plain", "decomposed", "dq_int4", dtype="float16", rank=3)
    model = build_qkv(spec)
    fused = fuse(model)
    assert len(fused_nodes(fused)) == 1
    report = verify(model, fused, seeds=(seed_of(rng),), dim_values={"B": 2, "S": 3})
    assert report.passed, report.messages


def test_scale_cast_from_float32(rng: np.random.Generator) -> None:
    """A float32 scale cast to the float16 chain fuses when it is exact in float16, else not."""
    spec = QkvSpec("scale32", "decomposed", "nbits", dtype="float16")

    def edit(exact: bool):
        def fn(m: onnx.ModelProto) -> None:
            t = next(t for t in m.graph.initializer if t.name == "norm_scale")
            gamma = onnx.numpy_helper.to_array(t).astype(np.float32)
            if not exact:
                gamma = gamma + np.float32(1e-6)
            t.CopyFrom(onnx.numpy_helper.from_array(gamma, "norm_scale"))
            mul = next(n for n in m.graph.node if n.output[0] == "normed")
            mul.input[1] = "norm_scale_h"
            cast = oh.make_node(
                "Cast", ["norm_scale"], ["norm_scale_h"], to=onnx.TensorProto.FLOAT16
            )
            nodes = [cast, *m.graph.node]
            del m.graph.node[:]
            m.graph.node.extend(nodes)

        return fn

    exact = _edit(build_qkv(spec), edit(True))
    (node,) = fused_nodes(_fused_and_checked(exact, {"T": 5}, rng))
    assert slots(node)["norm_scale"] != "norm_scale"
    inexact = _edit(build_qkv(spec), edit(False))
    assert_unchanged(inexact)
    assert any("not exactly representable" in r for r in reasons(inexact))


def test_two_layers_both_fuse(rng: np.random.Generator) -> None:
    """Two preludes in one graph, the second reading the first's Q."""
    a = build_qkv(QkvSpec("layer", "sln", "nbits", nq=96))
    m = onnx.ModelProto()
    m.CopyFrom(a)
    second = []
    for node in a.graph.node:
        n = onnx.NodeProto()
        n.CopyFrom(node)
        n.input[:] = ["q" if i == "x" else (f"{i}_2" if i else i) for i in n.input]
        n.output[:] = [f"{o}_2" for o in n.output]
        second.append(n)
    m.graph.node.extend(second)
    m.graph.initializer.extend(
        onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t), f"{t.name}_2")
        for t in a.graph.initializer
    )
    m.graph.output.extend(
        oh.make_tensor_value_info(f"{o.name}_2", onnx.TensorProto.FLOAT, None)
        for o in a.graph.output
    )
    fused = fuse(m)
    assert len(fused_nodes(fused)) == 2
    seed = seed_of(rng)
    feeds = random_feeds(m, seed, {"T": 5})
    want, got = run_reference(m, feeds), run_reference(fused, feeds)
    for out, value in want.items():
        assert rel_err(got[out], value) <= 1e-4, (out, seed)


def _swapped_q_k(name: str) -> onnx.ModelProto:
    fused = onnx.ModelProto()
    fused.CopyFrom(fused_sample(name))
    (node,) = fused_nodes(fused)
    node.input[3], node.input[6] = node.input[6], node.input[3]
    node.input[4], node.input[7] = node.input[7], node.input[4]
    return fused


def test_verification_has_teeth(device, rng: np.random.Generator) -> None:
    """Swapping the Q and K weights of an equal-width fusion is caught on both paths."""
    name = "qkv_sln_nbits_equal_widths_named"
    s = SAMPLES[name]
    wrong = _swapped_q_k(name)
    seed = seed_of(rng)
    feeds = random_feeds(s.model, seed, s.dim_values)
    want, got = run_reference(s.model, feeds), run_reference(wrong, feeds)
    assert rel_err(got["query_states"], want["query_states"]) > 1e-2, seed
    del device
    report = verify(s.model, wrong, seeds=(seed,), dim_values=s.dim_values, paths=("wgpu",))
    assert not report.passed and report.paths["wgpu"].status == "failed", report.messages


def test_rules_ignore_the_moe_samples() -> None:
    """No MoE sample holds an RMS norm: the rules fire nowhere and explain nothing there."""
    for s in all_samples("moe"):
        assert_unchanged(s.model)
        assert near_misses(s.model) == [], s.name
