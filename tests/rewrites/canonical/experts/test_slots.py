"""``CanonicalSlotsPass``: Unsqueeze of Expand/Unsqueeze chains -> ``Expand?(Unsqueeze(x, axes))``.

The axis arithmetic is checked against numpy on random shapes and axes (hypothesis), the pass on
small models in ORT (bit for bit, graph optimisations off), what it must leave alone stays
byte-identical, and the hand-written ``einsum_experts`` layer fuses with the pass in the pipeline.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import parse, random_feeds, session
from hypothesis import given, settings
from hypothesis import strategies as st

import onnx_moe_fuse.pipeline.canonicalise as canonicalise_module
from onnx_moe_fuse import fuse
from onnx_moe_fuse.rewrites.canonical.experts.slots.canonical_slots import CanonicalSlotsPass
from onnx_moe_fuse.rewrites.canonical.experts.slots.unsqueeze import (
    merged_unsqueeze_axes,
    swapped_expand,
)
from onnx_moe_fuse.samples.handwritten import Qwen3Sizes, handwritten_layer, qwen3_int4

# -- the axis arithmetic against numpy -------------------------------------------------------------


def _unsqueeze(a: np.ndarray, axes: list[int]) -> np.ndarray:
    rank = a.ndim + len(axes)
    return np.expand_dims(a, tuple(x % rank for x in axes))


def _expand(a: np.ndarray, shape: list[int]) -> np.ndarray:
    return a * np.ones(shape, dtype=a.dtype)  # ONNX Expand: bidirectional broadcast


@st.composite
def _axes(draw, rank: int) -> list[int]:
    count = draw(st.integers(1, 3))
    final = rank + count
    chosen = draw(st.lists(st.integers(0, final - 1), min_size=count, max_size=count, unique=True))
    return [a - final if draw(st.booleans()) else a for a in chosen]  # negative ones too


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_merge_matches_two_unsqueezes(data):
    shape = data.draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    a = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1
    inner = data.draw(_axes(len(shape)))
    outer = data.draw(_axes(len(shape) + len(inner)))
    merged = merged_unsqueeze_axes(inner, outer, len(shape))
    assert merged is not None
    want = _unsqueeze(_unsqueeze(a, inner), outer)
    np.testing.assert_array_equal(_unsqueeze(a, merged), want)
    assert _unsqueeze(a, merged).shape == want.shape


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_swap_matches_unsqueeze_of_expand(data):
    shape = data.draw(st.lists(st.integers(1, 3), min_size=0, max_size=3))
    a = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1
    # an Expand shape broadcastable with a: each aligned dim 1, a's dim, or a new size where a is 1
    extra = data.draw(st.integers(0, 2))
    target = [data.draw(st.integers(1, 3)) for _ in range(extra)]
    for d in shape:
        target.append(data.draw(st.sampled_from([1, d] if d != 1 else [1, 2, 3])))
    drop = data.draw(st.integers(0, len(target)))  # Expand shapes may be shorter than a's rank
    target = target[drop:] if len(target) - drop <= len(shape) else target
    expanded = _expand(a, target)
    axes = data.draw(_axes(expanded.ndim))
    swapped = swapped_expand(axes, target, a.ndim)
    assert swapped is not None
    new_axes, new_shape = swapped
    want = _unsqueeze(expanded, axes)
    got = _expand(_unsqueeze(a, new_axes), new_shape)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_invalid_axes_are_refused():
    assert merged_unsqueeze_axes([1, 1], [0], 2) is None
    assert merged_unsqueeze_axes([5], [0], 2) is None
    assert swapped_expand([7], [1, 2, 1], 3) is None


# -- the pass on models ------------------------------------------------------------------------


def _run(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    ir_model = ir.from_proto(model).clone()
    result = CanonicalSlotsPass()(ir_model)
    return ir.to_proto(result.model), result.modified


def _ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node if n.op_type != "Constant")


def _producer(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if name in n.output)


def _assert_exact(before: onnx.ModelProto, after: onnx.ModelProto, rng, dims=None) -> None:
    s_before, s_after = session(before), session(after)
    feeds = random_feeds(s_before, rng, dims)
    for e, g in zip(s_before.run(None, feeds), s_after.run(None, feeds), strict=True):
        assert e.shape == g.shape
        np.testing.assert_array_equal(g, e)


_EINSUM_LHS = """<ir_version: 10, opset_import: ["" : 21]>
g (float[T, 8] x) => (float[T, 3, 1, 8] gate_lhs, float[T, 3, 1, 8] up_lhs) {
  one = Constant <value = int64[1] {1}> ()
  u = Unsqueeze(x, one)
  s = Constant <value = int64[3] {1, 3, 1}> ()
  e = Expand(u, s)
  two = Constant <value = int64[1] {2}> ()
  gate_lhs = Unsqueeze(e, two)
  two_b = Constant <value = int64[1] {-2}> ()
  up_lhs = Unsqueeze(e, two_b)
}"""


def test_einsum_lowering_becomes_one_unsqueeze_then_expand(rng):
    model = parse(_EINSUM_LHS)
    after, modified = _run(model)
    assert modified
    assert _ops(after) == {"Unsqueeze": 2, "Expand": 2}
    for out in ("gate_lhs", "up_lhs"):
        expand = _producer(after, out)
        assert expand.op_type == "Expand"
        unsq = _producer(after, expand.input[0])
        assert unsq.op_type == "Unsqueeze" and unsq.input[0] == "x"
        axes = onnx.numpy_helper.to_array(_producer(after, unsq.input[1]).attribute[0].t)
        shape = onnx.numpy_helper.to_array(_producer(after, expand.input[1]).attribute[0].t)
        assert axes.tolist() == [1, 2] and shape.tolist() == [1, 3, 1, 1]
    names = [o for n in after.graph.node for o in n.output]
    assert len(names) == len(set(names))
    _assert_exact(model, after, rng, {"T": 5})


def test_static_token_dims_and_short_expand_shape(rng):
    model = parse("""<ir_version: 10, opset_import: ["" : 21]>
    g (float[4, 1, 6] x) => (float[4, 2, 1, 6] y) {
      s = Constant <value = int64[2] {2, 6}> ()
      e = Expand(x, s)
      a = Constant <value = int64[1] {-2}> ()
      y = Unsqueeze(e, a)
    }""")
    after, modified = _run(model)
    assert modified and _producer(after, "y").op_type == "Expand"
    _assert_exact(model, after, rng)


def test_expand_read_elsewhere_stays_and_names_stay(rng):
    model = parse("""<ir_version: 10, opset_import: ["" : 21]>
    g (float[T, 8] x) => (float[T, 2, 1, 8] y, float[T, 2, 8] e) {
      one = Constant <value = int64[1] {1}> ()
      u = Unsqueeze(x, one)
      s = Constant <value = int64[3] {1, 2, 1}> ()
      e = Expand(u, s)
      two = Constant <value = int64[1] {2}> ()
      y = Unsqueeze(e, two)
    }""")
    after, _ = _run(model)
    assert _producer(after, "e").op_type == "Expand" and _producer(after, "e").input[0] == "u"
    assert [o.name for o in after.graph.output] == ["y", "e"]
    _assert_exact(model, after, rng, {"T": 3})


def _assert_untouched(model: onnx.ModelProto) -> None:
    ir_model = ir.from_proto(model)
    reference = ir.to_proto(ir_model.clone()).SerializeToString()
    result = CanonicalSlotsPass()(ir_model.clone())
    assert not result.modified
    assert ir.to_proto(result.model).SerializeToString() == reference


@pytest.mark.parametrize(
    "body",
    [
        # the Expand shape is not a constant
        """g (float[T, 8] x, int64[3] s) => (float[T, 2, 1, 8] y) {
          one = Constant <value = int64[1] {1}> ()
          u = Unsqueeze(x, one)
          e = Expand(u, s)
          two = Constant <value = int64[1] {2}> ()
          y = Unsqueeze(e, two)
        }""",
        # the axes are not a constant
        """g (float[T, 8] x, int64[1] a) => (float[T, 1, 1, 8] y) {
          one = Constant <value = int64[1] {1}> ()
          u = Unsqueeze(x, one)
          y = Unsqueeze(u, a)
        }""",
        # a lone Unsqueeze of an input: already canonical
        """g (float[T, 8] x) => (float[T, 1, 1, 8] y) {
          a = Constant <value = int64[2] {1, 2}> ()
          y = Unsqueeze(x, a)
        }""",
    ],
)
def test_left_alone(body):
    _assert_untouched(parse('<ir_version: 10, opset_import: ["" : 21]>\n' + body))


def test_unknown_rank_left_alone():
    """The rank of the expanded tensor is unknown: where the axes land is unknown too."""
    h = onnx.helper
    nodes = [
        h.make_node(
            "Constant", [], ["s"], value=h.make_tensor("s", onnx.TensorProto.INT64, [2], [2, 1])
        ),
        h.make_node("Expand", ["x", "s"], ["e"]),
        h.make_node(
            "Constant", [], ["a"], value=h.make_tensor("a", onnx.TensorProto.INT64, [1], [0])
        ),
        h.make_node("Unsqueeze", ["e", "a"], ["y"]),
    ]
    graph = h.make_graph(
        nodes,
        "unknown_rank",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    _assert_untouched(h.make_model(graph, opset_imports=[h.make_opsetid("", 21)]))


def test_opset_11_attribute_axes_left_alone():
    _assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 11]>
        g (float[T, 8] x) => (float[T, 1, 1, 8] y) {
          u = Unsqueeze <axes = [1]> (x)
          y = Unsqueeze <axes = [2]> (u)
        }""")
    )


# -- the hand-written Einsum layer through the whole fuser ----------------------------------------


@pytest.fixture
def with_slots_pass(monkeypatch):
    """The pipeline with ``CanonicalSlotsPass`` right after ``NormalizeSpellingsPass``."""
    registered = canonicalise_module.canonicalisation_passes

    def passes(refusals=None):
        found = registered(refusals)
        kinds = [type(p).__name__ for p in found]
        if "CanonicalSlotsPass" not in kinds:
            found.insert(kinds.index("NormalizeSpellingsPass") + 1, CanonicalSlotsPass())
        return found

    monkeypatch.setattr(canonicalise_module, "canonicalisation_passes", passes)


def _outputs(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return session(model).run(None, feeds)


def test_einsum_experts_fuses(with_slots_pass, rng):
    layer = handwritten_layer("einsum_experts")
    result = fuse(layer.model)
    fused = result.model
    ops = collections.Counter(n.op_type for n in fused.graph.node)
    assert ops[layer.expected.op] == 1, ops
    node = next(n for n in fused.graph.node if n.op_type == layer.expected.op)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    for key, want in layer.expected.attributes.items():
        assert attrs[key] == want, key
    feeds = random_feeds(session(layer.model), rng, {"T": 7})
    (want,) = _outputs(layer.model, feeds)
    (got,) = _outputs(fused, feeds)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_einsum_experts_with_different_up_tokens_stays(with_slots_pass):
    """Mutation: the up projection reads other tokens than the gate one: no MoE computes that."""
    model = handwritten_layer("einsum_experts").model
    graph = model.graph
    up = next(n for n in graph.node if n.output[0] == "up_tki")
    neg = onnx.helper.make_node("Neg", ["x_tkh"], ["x_tkh_negated"], name="negate_up_tokens")
    up.input[0] = "x_tkh_negated"
    graph.node.insert(list(graph.node).index(up), neg)
    onnx.checker.check_model(model, full_check=True)
    reference = model.SerializeToString()
    result = fuse(model)
    assert not result.report.fusions
    assert result.model.SerializeToString() == reference


# -- repeated token rows (the hand-decomposed Qwen3 block) --------------------------------------

_ROWS = """<ir_version: 10, opset_import: ["" : 21]>
g (float[T, 8] x, float[T, 6] logits) => (float[T, 2, 8] expert_out) <
  float[6, 8, 10] w1 = {%s}, float[6, 5, 8] w2 = {%s}, float[1, 1, 5] bias = {%s}> {
  kk = Constant <value = int64[1] {2}> ()
  top_w, idx = TopK <axis = -1> (logits, kk)
  a1 = Constant <value = int64[1] {%s}> ()
  u = Unsqueeze(x, a1)
  rep = Constant <value = int64[3] {%s}> ()
  e = Expand(u, rep)
  rs = Constant <value = int64[3] {-1, 1, 8}> ()
  rows = Reshape(e, rs)
  flat = Constant <value = int64[1] {-1}> ()
  ids = Reshape(idx, flat)
  w1_rows = Gather <axis = 0> (w1, ids)
  fc1 = MatMul(rows, w1_rows)
  sizes = Constant <value = int64[2] {5, 5}> ()
  gate, up = Split <axis = %s> (fc1, sizes)
  sig = %s(gate)
  silu = Mul(gate, sig)
  glu = Mul(silu, up)
  act = Add(glu, bias)
  w2_rows = Gather <axis = 0> (w2, ids)
  fc2 = MatMul(act, w2_rows)
  back = Constant <value = int64[3] {-1, 2, 8}> ()
  expert_out = Reshape(fc2, back)
}"""


def _rows_model(
    rng, axis1="1", repeat="1, 2, 1", split_axis="-1", sigmoid="Sigmoid"
) -> onnx.ModelProto:
    def floats(n):
        return ", ".join(f"{v:.6f}" for v in rng.standard_normal(n))

    return parse(_ROWS % (floats(480), floats(240), floats(5), axis1, repeat, split_axis, sigmoid))


def test_repeated_rows_become_per_slot_projections(rng):
    model = _rows_model(rng)
    after, modified = _run(model)
    assert modified
    for name in ("fc1", "expert_out"):
        squeeze = _producer(after, name)
        assert squeeze.op_type == "Squeeze"
        mm = _producer(after, squeeze.input[0])
        gather = _producer(after, mm.input[1])
        assert mm.op_type == "MatMul" and gather.op_type == "Gather" and gather.input[1] == "idx"
    lhs = _producer(after, _producer(after, _producer(after, "fc1").input[0]).input[0])
    assert lhs.op_type == "Expand" and _producer(after, lhs.input[0]).input[0] == "x"
    assert "Reshape" not in _ops(after)
    assert {"gate", "up", "act"} <= {o for n in after.graph.node for o in n.output}
    _assert_exact(model, after, rng, {"T": 5})


def test_split_on_axis_2_is_the_last_axis_too(rng):
    model = _rows_model(rng, split_axis="2")
    after, modified = _run(model)
    assert modified
    _assert_exact(model, after, rng, {"T": 4})


@pytest.mark.parametrize(
    "mutation",
    [
        {"axis1": "0", "repeat": "2, 1, 1"},  # rows j*T + t: not the order of the flat ids
        {"repeat": "1, 3, 1"},  # repeated 3 times for 2 experts a token: R is not T*k
        # over the unit axis of [R, 1, 5] it is all ones; over the k axis of [T, k, 5] it is not
        {"sigmoid": "Softmax <axis = 1>"},
    ],
)
def test_rows_mutations_left_alone(rng, mutation):
    model = _rows_model(rng, **mutation)
    _assert_untouched(model)


def test_escaping_activation_value_left_alone(rng):
    model = _rows_model(rng)
    model.graph.output.append(onnx.helper.make_tensor_value_info("gate", 1, None))
    _assert_untouched(model)


def test_qwen3_int4_fuses(with_slots_pass, rng):
    layer = qwen3_int4(Qwen3Sizes(hidden=64, inter=32, experts=8, top_k=2))
    result = fuse(layer.model)
    ops = collections.Counter(n.op_type for n in result.model.graph.node)
    assert ops[layer.expected.op] == 1, ops
    node = next(n for n in result.model.graph.node if n.op_type == layer.expected.op)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    for key, want in layer.expected.attributes.items():
        assert attrs[key] == want, key
    feeds = random_feeds(session(layer.model), rng, {"batch": 2, "seq": 3})
    (want,) = _outputs(layer.model, feeds)
    (got,) = _outputs(result.model, feeds)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_qwen3_int4_rows_out_of_order_stays(with_slots_pass):
    """Mutation: tokens repeated as rows ``j*T + t`` while the ids are flattened ``t*k + j``."""
    model = qwen3_int4(Qwen3Sizes(hidden=64, inter=32, experts=8, top_k=2)).model
    for init in model.graph.initializer:
        if init.name == "axis1":
            init.CopyFrom(onnx.numpy_helper.from_array(np.array([0], np.int64), "axis1"))
        if init.name == "expand_k":
            init.CopyFrom(onnx.numpy_helper.from_array(np.array([2, 1, 1], np.int64), "expand_k"))
    onnx.checker.check_model(model, full_check=True)
    reference = model.SerializeToString()
    result = fuse(model)
    assert not result.report.fusions
    assert result.model.SerializeToString() == reference
