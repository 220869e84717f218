"""Cast chains that keep precision -> one Cast or none; lossy chains and graph outputs stay."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from test_spellings_common import assert_same, assert_untouched, normalise, ops, producer

from onnx_moe_fuse.rewrites.canonical.spellings.cast import WIDENING

_NP = {
    TensorProto.FLOAT16: np.float16,
    TensorProto.FLOAT: np.float32,
    TensorProto.DOUBLE: np.float64,
    TensorProto.INT8: np.int8,
    TensorProto.UINT8: np.uint8,
    TensorProto.INT16: np.int16,
    TensorProto.INT32: np.int32,
    TensorProto.INT64: np.int64,
}


def _chain(source: int, casts: list[int], tail: str = "Neg") -> onnx.ModelProto:
    """``x: source`` -> Cast(to=casts[0]) -> ... -> ``tail`` (so the last cast is not an output)."""
    nodes, prev = [], "x"
    for i, to in enumerate(casts):
        nodes.append(helper.make_node("Cast", [prev], [f"c{i}"], to=to))
        prev = f"c{i}"
    nodes.append(helper.make_node(tail, [prev], ["y"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", source, [3, 5])],
        [helper.make_tensor_value_info("y", casts[-1], [3, 5])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _feeds(rng, source: int) -> dict[str, np.ndarray]:
    np_type = _NP[source]
    if np.issubdtype(np_type, np.integer):
        info = np.iinfo(np_type)
        return {"x": rng.integers(info.min, info.max, (3, 5), endpoint=True).astype(np_type)}
    x = (rng.standard_normal((3, 5)) * 100).astype(np_type)
    x.flat[:3] = [np.inf, -np.inf, np.finfo(np_type).tiny]
    return {"x": x}


def test_float_round_trip_through_double_is_removed(rng):
    model = _chain(TensorProto.FLOAT, [TensorProto.DOUBLE, TensorProto.FLOAT])
    after, modified = normalise(model)
    assert modified and ops(after) == {"Neg": 1}
    assert producer(after, "y").input == ["x"]
    assert_same(model, after, rng, feeds=_feeds(rng, TensorProto.FLOAT))


def test_cast_to_own_type_is_removed(rng):
    model = _chain(TensorProto.FLOAT, [TensorProto.FLOAT])
    after, _ = normalise(model)
    assert ops(after) == {"Neg": 1}
    assert_same(model, after, rng, feeds=_feeds(rng, TensorProto.FLOAT))


def test_widening_then_narrowing_becomes_one_cast(rng):
    model = _chain(TensorProto.FLOAT16, [TensorProto.FLOAT, TensorProto.INT32])
    after, _ = normalise(model)
    assert ops(after) == {"Cast": 1, "Neg": 1}
    cast = producer(after, "c1")  # the one Cast takes the chain's output name
    assert cast.input == ["x"] and cast.attribute[0].i == TensorProto.INT32
    feeds = {"x": (_feeds(rng, TensorProto.FLOAT16)["x"].clip(-1e4, 1e4))}
    assert_same(model, after, rng, feeds=feeds)


def test_lossy_chain_stays():
    assert_untouched(_chain(TensorProto.FLOAT, [TensorProto.FLOAT16, TensorProto.FLOAT]))
    assert_untouched(_chain(TensorProto.DOUBLE, [TensorProto.FLOAT, TensorProto.DOUBLE]))
    assert_untouched(_chain(TensorProto.INT32, [TensorProto.FLOAT, TensorProto.INT32]))


def test_cast_making_a_graph_output_stays():
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    assert_untouched(model)


def _expected_casts(source: int, wide: int, target: int) -> int:
    """How many Casts ``x -> wide -> target`` keeps.

    A cast to its own type goes, and so does the first of a chain that widens (the whole chain
    when it comes back to ``x``'s type).
    """
    if wide == source or ir.DataType(wide) in WIDENING.get(ir.DataType(source), ()):
        return 0 if target == source else 1
    return 1 if target == wide else 2


@settings(max_examples=40, deadline=None)
@given(
    source=st.sampled_from(sorted(_NP)),
    wide=st.sampled_from(sorted(_NP)),
    target=st.sampled_from(sorted(_NP)),
    seed=st.integers(0, 2**31),
)
def test_cast_chains_compute_the_same(source, wide, target, seed):
    rng = np.random.default_rng(seed)
    model = _chain(source, [wide, target], tail="Identity")
    after, _ = normalise(model)
    assert ops(after)["Cast"] == _expected_casts(source, wide, target)
    feeds = _feeds(rng, source)
    # a float -> integer cast out of the target's range is undefined in ONNX: stay in range
    if not np.issubdtype(_NP[source], np.integer):
        feeds["x"] = np.nan_to_num(feeds["x"], posinf=100, neginf=0).clip(0, 100)
    assert_same(model, after, rng, feeds=feeds)
