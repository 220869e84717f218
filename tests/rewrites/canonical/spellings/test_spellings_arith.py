"""``Gemm`` -> ``MatMul``; ``Mul(v, Reciprocal(s))`` -> ``Div(v, s)``; constant operands second.

Tolerances as the module states: Gemm relative 1e-5 (the runtime's GEMM may fuse scaling and
bias into its accumulation), reciprocal products relative 2**-22 (2 ulp in float32: ``v * (1/s)``
rounds twice), commuted operands exact.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper
from onnx import numpy_helper as nh
from test_spellings_common import (
    assert_same,
    assert_untouched,
    normalise,
    ops,
    parse,
    producer,
    session,
)

GEMM_RTOL, GEMM_ATOL = 1e-5, 1e-6
RECIPROCAL_RTOL = 2.0**-22


def _gemm_model(rng, m, k, n, trans_a, trans_b, alpha, beta, c_shape, dtype=np.float32):
    """A Gemm with constant B (and C when ``c_shape`` is not None)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    a_shape = [k, m] if trans_a else [m, k]
    b = rng.standard_normal([n, k] if trans_b else [k, n]).astype(dtype)
    inits = [nh.from_array(b, "b")]
    inputs = ["a", "b"]
    if c_shape is not None:
        inits.append(nh.from_array(rng.standard_normal(c_shape).astype(dtype), "c"))
        inputs.append("c")
    node = helper.make_node(
        "Gemm", inputs, ["y"], transA=trans_a, transB=trans_b, alpha=alpha, beta=beta
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("a", elem, a_shape)],
        [helper.make_tensor_value_info("y", elem, [m, n])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


@settings(max_examples=25, deadline=None)
@given(
    dims=st.tuples(st.integers(1, 6), st.integers(1, 7), st.integers(1, 5)),
    trans=st.tuples(st.booleans(), st.booleans()),
    alpha=st.sampled_from([1.0, 0.5, 2.0, -1.25]),
    beta=st.sampled_from([1.0, 0.0, 0.25, 3.0]),
    c_form=st.sampled_from([None, "full", "row", "scalar"]),
    seed=st.integers(0, 2**31),
)
def test_gemm_becomes_matmul(dims, trans, alpha, beta, c_form, seed):
    rng = np.random.default_rng(seed)
    m, k, n = dims
    c_shape = {None: None, "full": [m, n], "row": [n], "scalar": []}[c_form]
    model = _gemm_model(rng, m, k, n, int(trans[0]), int(trans[1]), alpha, beta, c_shape)
    after, modified = normalise(model)
    assert modified
    hist = ops(after)
    assert "Gemm" not in hist and hist["MatMul"] == 1
    assert hist["Transpose"] == int(trans[0]) + int(trans[1])
    has_add = c_shape is not None and beta != 0.0
    assert hist["Add"] == int(has_add)
    assert hist["Mul"] == int(alpha != 1.0) + int(has_add and beta != 1.0)
    assert_same(model, after, rng, rtol=GEMM_RTOL, atol=GEMM_ATOL)


def test_gemm_int64_unscaled(rng):
    model = parse("""<ir_version: 10, opset_import: ["" : 18]>
    g (int64[3, 4] a, int64[4, 2] b, int64[2] c) => (int64[3, 2] y) {
      y = Gemm(a, b, c)
    }""")
    after, _ = normalise(model)
    assert ops(after) == {"MatMul": 1, "Add": 1}
    # ORT has no int64 Gemm kernel: compare with the ONNX definition in numpy
    feeds = {
        "a": rng.integers(-9, 9, (3, 4)),
        "b": rng.integers(-9, 9, (4, 2)),
        "c": rng.integers(-9, 9, (2,)),
    }
    (got,) = session(after).run(None, feeds)
    np.testing.assert_array_equal(got, feeds["a"] @ feeds["b"] + feeds["c"])


def test_gemm_scale_not_exact_in_float16_stays(rng):
    assert_untouched(_gemm_model(rng, 2, 3, 4, 0, 1, 0.1, 1.0, [4], dtype=np.float16))


def test_gemm_scaled_int_stays():
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (int64[3, 4] a, int64[4, 2] b) => (int64[3, 2] y) {
          y = Gemm <alpha = 2.0> (a, b)
        }""")
    )


_RECIPROCAL = """<ir_version: 10, opset_import: ["" : 18]>
g (float[N, 4] v, float[N, 1] s) => (float[N, 4] y) {
  r = Reciprocal(s)
  y = Mul(%s)
}"""


def _positive_feeds(rng, n: int) -> dict[str, np.ndarray]:
    v = rng.standard_normal((n, 4)).astype(np.float32)
    return {"v": v, "s": (np.abs(v).sum(axis=1, keepdims=True) + 0.1).astype(np.float32)}


def test_reciprocal_product_becomes_div(rng):
    for operands in ("v, r", "r, v"):
        model = parse(_RECIPROCAL % operands)
        after, modified = normalise(model)
        assert modified and ops(after) == {"Div": 1}
        assert producer(after, "y").input == ["v", "s"]
        assert_same(model, after, rng, rtol=RECIPROCAL_RTOL, feeds=_positive_feeds(rng, 11))


def test_reciprocal_read_elsewhere_stays():
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (float[N, 4] v, float[N, 1] s) => (float[N, 4] y, float[N, 1] r) {
          r = Reciprocal(s)
          y = Mul(v, r)
        }""")
    )


def test_constant_first_is_swapped_exactly(rng):
    model = parse("""<ir_version: 10, opset_import: ["" : 18]>
    g (float[N, 4] x) => (float[N, 4] y) <float[4] w = {0.5, -1.5, 2.25, 3.0}> {
      c = Constant <value = float {1.75}> ()
      m = Mul(c, x)
      y = Add(w, m)
    }""")
    after, modified = normalise(model)
    assert modified
    assert producer(after, "m").input == ["x", "c"]
    assert producer(after, "y").input == ["m", "w"]
    assert_same(model, after, rng, dims={"N": 6})


def test_constant_second_and_two_constants_stay():
    model = parse("""<ir_version: 10, opset_import: ["" : 18]>
    g (float[N, 4] x) => (float[N, 4] y) <float[4] w = {0.5, -1.5, 2.25, 3.0}> {
      c = Constant <value = float {1.75}> ()
      both = Mul(c, w)
      m = Mul(x, both)
      y = Add(m, w)
    }""")
    assert_untouched(model)
