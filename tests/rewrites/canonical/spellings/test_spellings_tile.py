"""``Tile`` of unit axes -> ``Expand`` (bit for bit); Tile of real axes, unknown repeats stay."""

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
    parse,
    producer,
)


def test_token_replication_becomes_expand(rng):
    model = parse("""<ir_version: 10, opset_import: ["" : 18]>
    g (float[T, 8] x) => (float[T, 2, 8] y) {
      axes = Constant <value = int64[1] {1}> ()
      u = Unsqueeze(x, axes)
      reps = Constant <value = int64[3] {1, 2, 1}> ()
      y = Tile(u, reps)
    }""")
    after, modified = normalise(model)
    assert modified and "Tile" not in ops(after)
    assert producer(after, "y").op_type == "Expand" and producer(after, "y").input == ["u", "reps"]
    assert_same(model, after, rng, dims={"T": 5})


def test_static_unit_axis_becomes_expand(rng):
    model = parse("""<ir_version: 10, opset_import: ["" : 18]>
    g (float[3, 1, 4] x) => (float[3, 5, 4] y) <int64[3] reps = {1, 5, 1}> {
      y = Tile(x, reps)
    }""")
    after, _ = normalise(model)
    assert ops(after) == {"Expand": 1}
    assert_same(model, after, rng)


def test_opset_11_unsqueeze_attribute(rng):
    model = parse("""<ir_version: 10, opset_import: ["" : 11]>
    g (float[T, 8] x) => (float[T, 8, 3] y) <int64[3] reps = {1, 1, 3}> {
      u = Unsqueeze <axes = [-1]> (x)
      y = Tile(u, reps)
    }""")
    after, _ = normalise(model)
    assert ops(after) == {"Unsqueeze": 1, "Expand": 1}
    assert_same(model, after, rng, dims={"T": 4})


def test_tile_of_real_axes_and_unknown_repeats_stays():
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (float[T, 8] x) => (float[T, 16] y) <int64[2] reps = {1, 2}> {
          y = Tile(x, reps)
        }""")
    )
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (float[T, 1] x, int64[2] reps) => (float[A, B] y) {
          y = Tile(x, reps)
        }""")
    )
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (float[T, 1] x) => (float[T, 0] y) <int64[2] reps = {1, 0}> {
          y = Tile(x, reps)
        }""")
    )


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    data=st.data(),
    seed=st.integers(0, 2**31),
)
def test_tile_of_unsqueezed_axes_is_expand(shape, data, seed):
    rank = len(shape) + 1
    axis = data.draw(st.integers(-rank, rank - 1))
    count = data.draw(st.integers(1, 4))
    repeats = [1] * rank
    repeats[axis % rank] = count
    out_shape = list(shape)
    out_shape.insert(axis % rank, count)
    nodes = [
        helper.make_node("Unsqueeze", ["x", "axes"], ["u"]),
        helper.make_node("Tile", ["u", "reps"], ["y"]),
    ]
    inits = [
        nh.from_array(np.array([axis], np.int64), "axes"),
        nh.from_array(np.array(repeats, np.int64), "reps"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    after, _ = normalise(model)
    assert ops(after) == {"Unsqueeze": 1, "Expand": 1}
    assert_same(model, after, np.random.default_rng(seed))
