"""``value_dims`` / ``shape_value``: symbolic dims through the ops dense exports size things with.

optimum-onnx's dense gpt-oss sizes its layer from ``Shape`` of values the declared shapes say
nothing about: a ``Gemm`` router, ``ConstantOfShape(Shape(logits))`` zeros, the
``ScatterElements`` into them, ``Tile``d and ``Slice``d rows, Reshapes to targets computed from
``Shape(hidden)``; other dense masks are ``OneHot`` or ``Equal`` of the indices, summed by
``ReduceSum``; SwiGLU halves come from ``Split``. JetMoE's dynamic export reshapes values whose dims
nothing relates to the target (rows scattered into zeros of a computed shape) to
``Shape(input_ids)``'s sizes and adds them to the residual. Each case checks the dims against what ONNX Runtime computes for random sizes
of the symbolic dims, so a wrong fact fails here rather than as a wrong fusion.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.symbolic_dims import fill_dims, shape_value, value_dims

MODEL = """<ir_version: 10, opset_import: ["" : 18]>
g (float[B, S, 8] hidden, float[4, 8] router, float[4] bias, float[B, S, 8] other)
  => (float[B, S, 8] out)
  <float[N, 8] flat> {
  flat_shape = Constant <value = int64[2] {-1, 8}> ()
  x = Reshape(hidden, flat_shape)
  logits = Gemm <transB = 1> (x, router, bias)
  logits_t = Gemm <transA = 1> (x, x)
  shape_of_logits = Shape(logits)
  zeros = ConstantOfShape(shape_of_logits)
  zero_f = Constant <value = float {0.0}> ()
  zeros_like = Expand(zero_f, shape_of_logits)
  k = Constant <value = int64[1] {2}> ()
  top_v, top_i = TopK(logits, k)
  dense = ScatterElements <axis = 1> (zeros, top_i, top_v)
  reps = Constant <value = int64[2] {4, 1}> ()
  tiled = Tile(x, reps)
  s0 = Constant <value = int64[1] {0}> ()
  s1 = Constant <value = int64[1] {1}> ()
  big = Constant <value = int64[1] {9223372036854775807}> ()
  two = Constant <value = int64[1] {2}> ()
  odd = Slice(x, s1, big, s1, two)
  whole = Slice(x, s0, big, s0)
  part = Slice(x, s1, big, s0)
  shape = Shape(hidden)
  zero = Constant <value = int64 {0}> ()
  b = Gather <axis = 0> (shape, zero)
  b1 = Unsqueeze(b, s0)
  e = Constant <value = int64[1] {4}> ()
  rest = Constant <value = int64[1] {-1}> ()
  h = Constant <value = int64[1] {8}> ()
  target = Concat <axis = 0> (e, b1, rest, h)
  e_rows_h = Constant <value = int64[3] {4, -1, 8}> ()
  stacked = Reshape(tiled, e_rows_h)
  split = Reshape(stacked, target)
  summed = ReduceSum <keepdims = 0> (logits, s1)
  summed_keep = ReduceSum(logits, s1)
  depth = Constant <value = int64 {4}> ()
  hot_values = Constant <value = float[2] {0.0, 1.0}> ()
  hot = OneHot(top_i, depth, hot_values)
  ids_3d = Unsqueeze(top_i, rest)
  expert_range = Constant <value = int64[4] {0, 1, 2, 3}> ()
  hit = Equal(ids_3d, expert_range)
  halves = Constant <value = int64[2] {3, 5}> ()
  first_half, second_half = Split <axis = -1> (x, halves)
  third_a, third_b = Split <axis = 1, num_outputs = 2> (x)
  ones_shape = Constant <value = int64[1] {2}> ()
  ones = ConstantOfShape <value = int64[1] {1}> (ones_shape)
  out = Reshape(x, shape)
  flat = Flatten <axis = 2> (hidden)
  back = Reshape(flat, shape)
  flat_target = Concat <axis = 0> (b1, rest, h)
  back_rest = Reshape(flat, flat_target)
  resid = Add(hidden, back)
  other_shape = Shape(other)
  other_back = Reshape(flat, other_shape)
  other_resid = Add(hidden, other_back)
  like_dense = ScatterElements <axis = 1> (zeros_like, top_i, top_v)
  like_dense3 = Unsqueeze(like_dense, rest)
  s_idx = Constant <value = int64 {1}> ()
  seq = Gather <axis = 0> (shape, s_idx)
  tokens = Mul(b, seq)
  tokens1 = Unsqueeze(tokens, s0)
  group_tail = Constant <value = int64[2] {4, 3}> ()
  group_target = Concat <axis = 0> (tokens1, group_tail)
  grouped = Expand(like_dense3, group_target)
  one_row = ReduceMax(like_dense3, s0)
  one_row_grouped = Expand(one_row, group_target)
  ln_scale = Constant <value = float[8] {1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0}> ()
  normed = LayerNormalization <axis = -1> (resid, ln_scale)
}"""


@pytest.fixture(scope="module")
def graph():
    proto = onnx.parser.parse_model(MODEL)
    return proto, ir.from_proto(proto)


def _values(model: ir.Model) -> dict[str, ir.Value]:
    return {v.name: v for node in model.graph for v in node.outputs}


def _concrete(dims: list[Dim], sizes: dict[str, int]) -> list[int]:
    out = []
    for d in dims:
        n = d.coef
        for sym in d.syms:
            n *= sizes[sym]
        out.append(n)
    return out


NAMES = [
    "logits", "logits_t", "zeros", "dense", "tiled", "odd", "whole", "stacked", "split",
    "summed", "summed_keep", "hot", "hit", "first_half", "second_half", "third_a", "third_b",
    "back", "resid", "normed",
]  # fmt: skip


@pytest.mark.parametrize("batch, seq", [(1, 1), (2, 3), (3, 5)])
def test_dims_agree_with_onnx_runtime(graph, batch, seq):
    proto, model = graph
    values = _values(model)
    dims = {name: value_dims(values[name]) for name in NAMES}
    assert all(d is not None for d in dims.values()), dims
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in NAMES)
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(batch * 10 + seq)
    feeds = {
        "hidden": rng.standard_normal((batch, seq, 8), dtype=np.float32),
        "router": rng.standard_normal((4, 8), dtype=np.float32),
        "bias": rng.standard_normal(4, dtype=np.float32),
        "other": rng.standard_normal((batch, seq, 8), dtype=np.float32),
    }
    got = dict(zip(NAMES, sess.run(NAMES, feeds), strict=True))
    sizes = {"hidden[0]": batch, "hidden[1]": seq}
    for name in NAMES:
        assert _concrete(dims[name], sizes) == list(got[name].shape), name


def test_symbols_follow_the_computation(graph):
    _, model = graph
    values = _values(model)
    rows = Dim(1, ("hidden[0]", "hidden[1]"))
    assert value_dims(values["dense"]) == [rows, Dim.of(4)]
    # a fill Expanded to a shape computed at run time: that shape's dims (torch's zeros_like),
    # for the questions that ask (fill_dims)
    assert fill_dims(values["zeros_like"]) == [rows, Dim.of(4)]
    assert value_dims(values["split"]) == [
        Dim.of(4),
        Dim.sym("hidden[0]"),
        Dim.sym("hidden[1]"),
        Dim.of(8),
    ]
    assert value_dims(values["odd"]) == [rows, Dim.of(4)]


FILL_NAMES = ["zeros_like", "like_dense", "grouped", "one_row_grouped"]


@pytest.mark.parametrize("batch, seq", [(1, 1), (2, 3), (3, 5)])
def test_fill_dims_agree_with_onnx_runtime(graph, batch, seq):
    # Expands to shapes computed at run time (a fill, and data: DeepSeek-V2's group mask)
    proto, model = graph
    values = _values(model)
    dims = {name: fill_dims(values[name]) for name in FILL_NAMES}
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in FILL_NAMES)
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(batch * 10 + seq + 1)
    feeds = {
        "hidden": rng.standard_normal((batch, seq, 8), dtype=np.float32),
        "router": rng.standard_normal((4, 8), dtype=np.float32),
        "bias": rng.standard_normal(4, dtype=np.float32),
        "other": rng.standard_normal((batch, seq, 8), dtype=np.float32),
    }
    got = dict(zip(FILL_NAMES, sess.run(FILL_NAMES, feeds), strict=True))
    sizes = {"hidden[0]": batch, "hidden[1]": seq}
    for name in FILL_NAMES:
        assert dims[name] is not None, name
        assert _concrete(dims[name], sizes) == list(got[name].shape), name


def test_an_expand_to_a_computed_shape_is_followed_only_when_asked(graph):
    _, model = graph
    values = _values(model)
    rows = Dim(1, ("hidden[0]", "hidden[1]"))
    # the plain question does not evaluate computed Expand targets (their cost, model-wide)
    assert value_dims(values["grouped"]) is None
    assert fill_dims(values["grouped"]) == [rows, Dim.of(4), Dim.of(3)]
    # one row broadcast to every token: the input keeps its single row
    assert fill_dims(values["one_row"])[0] == Dim.of(1)
    assert fill_dims(values["one_row_grouped"]) == [rows, Dim.of(4), Dim.of(3)]


def test_what_cannot_be_proved_stays_unknown(graph):
    _, model = graph
    values = _values(model)
    # a Slice of part of a symbolic axis has a size the graph does not fix
    assert value_dims(values["part"]) is None


def test_constant_of_shape_with_an_integer_fill_is_a_shape(graph):
    _, model = graph
    values = _values(model)
    assert shape_value(values["ones"]).ints == [1, 1]
    assert shape_value(values["zeros"]) is None  # a float fill is data, not a shape


def test_a_reshape_target_is_the_output_shape(graph):
    """A target the input's dims do not prove is still the output's shape: Reshape fails else."""
    _, model = graph
    values = _values(model)
    tokens = [Dim.sym("hidden[0]"), Dim.sym("hidden[1]"), Dim.of(8)]
    assert value_dims(values["flat"]) == [Dim.sym("flat[0]"), Dim.of(8)]  # N: not read
    assert value_dims(values["back"]) == tokens
    assert value_dims(values["resid"]) == tokens  # the residual sum of two equal shapes
    assert value_dims(values["normed"]) == tokens
    # what -1 leaves is not proved: the output's own symbol, never the input's sequence
    assert value_dims(values["back_rest"]) == [
        Dim.sym("hidden[0]"),
        Dim.sym("back_rest[1]"),
        Dim.of(8),
    ]
    # a target read from another input's Shape (whatever its dim names say) is that input's
    # sizes: the sum with the tokens is of two shapes the graph does not prove equal
    assert value_dims(values["other_back"]) == [
        Dim.sym("other[0]"),
        Dim.sym("other[1]"),
        Dim.of(8),
    ]
    resid = value_dims(values["other_resid"])
    assert resid[:2] == [Dim.sym("other_resid[0]"), Dim.sym("other_resid[1]")], resid
