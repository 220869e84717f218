"""Two-operand ``Einsum`` -> MatMul/Transpose/Unsqueeze/Squeeze (Mul/ReduceSum without contraction).

The MoE equations must come out in the forms the layer rules match; random equations must
compute what ``numpy.einsum`` does (float64 reference, relative 1e-5 in float32 as the module
says); what the lowering does not take stays byte-identical.
"""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from onnx import numpy_helper as nh
from test_spellings_common import (
    assert_same,
    assert_untouched,
    normalise,
    ops,
    producer,
    random_feeds,
    session,
)

from onnx_moe_fuse.rewrites.canonical.spellings.einsum import lower, parse_equation

RTOL = ATOL = 1e-5
DIMS = {"t": 5, "k": 2, "h": 8, "i": 6, "e": 4, "b": 2, "s": 3, "d": 4}


def _einsum_model(
    equation: str,
    shapes: list[list[int]],
    out_shape: list[int],
    *,
    weight: np.ndarray | None = None,
    gather: bool = False,
    opset: int = 18,
    elem: int = TensorProto.FLOAT,
) -> onnx.ModelProto:
    """``y = Einsum(a, b)``: ``b`` an input, a weight initializer, or ``Gather(W, idx)``."""
    inputs = [helper.make_tensor_value_info("a", elem, shapes[0])]
    nodes, inits = [], []
    if weight is None:
        inputs.append(helper.make_tensor_value_info("b", elem, shapes[1]))
    elif gather:
        inits.append(nh.from_array(weight, "W"))
        inputs.append(helper.make_tensor_value_info("idx", TensorProto.INT64, shapes[1][:2]))
        nodes.append(helper.make_node("Gather", ["W", "idx"], ["b"]))
    else:
        inits.append(nh.from_array(weight, "b"))
    nodes.append(helper.make_node("Einsum", ["a", "b"], ["y"], equation=equation))
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("y", elem, out_shape)], inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def _shapes(equation: str) -> tuple[list[list[int]], list[int]]:
    eq = parse_equation(equation)
    return [[DIMS[c] for c in eq.first], [DIMS[c] for c in eq.second]], [DIMS[c] for c in eq.out]


def _moe_model(rng, equation: str, weight: bool = False, gather: bool = False):
    shapes, out = _shapes(equation)
    w = None
    if gather:  # W [E, ...] gathered by [t, k] indices into the second operand
        w = rng.standard_normal([DIMS["e"], *shapes[1][2:]]).astype(np.float32)
    elif weight:
        w = rng.standard_normal(shapes[1]).astype(np.float32)
    return _einsum_model(equation, shapes, out, weight=w, gather=gather)


def _feeds(rng, model):
    feeds = random_feeds(session(model), rng, {})
    if "idx" in feeds:
        feeds["idx"] = rng.integers(0, DIMS["e"], feeds["idx"].shape).astype(np.int64)
    return feeds


def _check(rng, model):
    after, modified = normalise(model)
    assert modified and "Einsum" not in ops(after)
    assert_same(model, after, rng, rtol=RTOL, atol=ATOL, feeds=_feeds(rng, model))
    return after


def test_per_slot_projection_is_the_rules_matmul(rng):
    after = _check(rng, _moe_model(rng, "tkh,tkhi->tki", gather=True))
    assert ops(after) == {"Gather": 1, "Unsqueeze": 1, "MatMul": 1, "Squeeze": 1, "Constant": 2}
    squeeze = producer(after, "y")
    matmul = producer(after, squeeze.input[0])
    lhs = producer(after, matmul.input[0])
    assert squeeze.op_type == "Squeeze" and matmul.op_type == "MatMul"
    assert lhs.op_type == "Unsqueeze" and lhs.input[0] == "a" and matmul.input[1] == "b"


def test_per_slot_transposed_weights_keep_the_weight_on_the_right(rng):
    after = _check(rng, _moe_model(rng, "tkh,tkih->tki", gather=True))
    matmul = producer(after, producer(after, "y").input[0])
    assert producer(after, matmul.input[0]).input[0] == "a"
    rhs = producer(after, matmul.input[1])
    assert rhs.op_type == "Transpose" and rhs.input == ["b"]


def test_combine_is_the_rules_matmul_combine(rng):
    for equation in ("tki,tk->ti", "tk,tki->ti"):
        after = _check(rng, _moe_model(rng, equation))
        assert ops(after) == {"Unsqueeze": 1, "MatMul": 1, "Squeeze": 1, "Constant": 2}
        matmul = producer(after, producer(after, "y").input[0])
        weights_first = equation.startswith("tk,")
        lhs = producer(after, matmul.input[0])
        assert lhs.op_type == "Unsqueeze" and lhs.input[0] == ("a" if weights_first else "b")
        assert matmul.input[1] == ("b" if weights_first else "a")


def test_routers_are_one_matmul(rng):
    for equation in ("bsh,hd->bsd", "th,he->te"):
        after = _check(rng, _moe_model(rng, equation, weight=True))
        assert ops(after) == {"MatMul": 1}
        assert producer(after, "y").input == ["a", "b"]


def test_dense_experts(rng):
    # one GEMM broadcast over the experts, [e, t, i], then the output order
    after = _check(rng, _moe_model(rng, "th,ehi->tei", weight=True))
    assert ops(after) == {"MatMul": 1, "Transpose": 1}
    assert producer(after, producer(after, "y").input[0]).input == ["a", "b"]


def test_implicit_output_and_opset_12(rng):
    shapes, out = [[3, 4], [4, 5]], [3, 5]
    _check(rng, _einsum_model("ij,jk", shapes, out))
    after = _check(
        rng, _einsum_model("tkh,tkhi->tki", [[5, 2, 8], [5, 2, 8, 6]], [5, 2, 6], opset=12)
    )
    assert all(len(n.input) == 1 for n in after.graph.node if n.op_type in ("Squeeze", "Unsqueeze"))


def test_what_the_lowering_does_not_take_stays():
    assert_untouched(_einsum_model("ii,i->i", [[3, 3], [3]], [3]))
    assert_untouched(_einsum_model("...h,hd->...d", [[2, 3, 4], [4, 5]], [2, 3, 5]))
    assert_untouched(_einsum_model("ij,jk->ik", [[2, 3], [3, 4]], [2, 4], elem=TensorProto.INT8))
    three = _einsum_model("ij,jk->ik", [[2, 3], [3, 4]], [2, 4])
    three.graph.input.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [4, 2]))
    three.graph.node[0].input.append("c")
    three.graph.node[0].attribute[0].s = b"ij,jk,kl->il"
    three.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 2
    assert_untouched(three)


def test_lowering_of_the_moe_equations_is_as_documented():
    # weights right, fewest transposes: per slot Unsqueeze + MatMul + Squeeze, no Transpose
    per_slot = lower(parse_equation("tkh,tkhi->tki"), (False, True))
    assert (per_slot.left.source, per_slot.left.unsqueeze, per_slot.squeeze) == (0, [2], [2])
    assert per_slot.transposes() == 0
    combine = lower(parse_equation("tki,tk->ti"))
    assert combine.left.source == 1 and combine.transposes() == 0


@st.composite
def equations(draw):
    letters = "abcdef"
    first = draw(st.lists(st.sampled_from(letters), min_size=1, max_size=4, unique=True))
    second = draw(st.lists(st.sampled_from(letters), min_size=1, max_size=4, unique=True))
    seen = sorted(set(first) | set(second))
    out = draw(st.permutations(draw(st.lists(st.sampled_from(seen), unique=True, max_size=4))))
    dims = {c: draw(st.integers(1, 4)) for c in seen}
    return "".join(first) + "," + "".join(second) + "->" + "".join(out), dims


@settings(max_examples=60, deadline=None)
@given(case=equations(), seed=st.integers(0, 2**31))
def test_random_equations_match_numpy(case, seed):
    equation, dims = case
    eq = parse_equation(equation)
    shapes = [[dims[c] for c in eq.first], [dims[c] for c in eq.second]]
    model = _einsum_model(equation, shapes, [dims[c] for c in eq.out])
    after, modified = normalise(model)
    assert modified and "Einsum" not in ops(after), equation
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    (got,) = session(after).run(None, {"a": a, "b": b})
    expected = np.einsum(equation, a.astype(np.float64), b.astype(np.float64))
    assert got.shape == expected.shape, equation
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=equation)
