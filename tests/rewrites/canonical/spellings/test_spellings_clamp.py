"""``Min``/``Max`` clamps and attribute ``Clip`` -> ``Clip(x, lo, hi)``, exactly (inf, NaN too)."""

from __future__ import annotations

import numpy as np
import onnx
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

SPECIAL = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.0e38, -3.0e38], dtype=np.float32)


def _feeds(rng) -> dict[str, np.ndarray]:
    x = np.concatenate([rng.standard_normal(21).astype(np.float32) * 3, SPECIAL])
    return {"x": x.reshape(4, 7)}


def _model(body: str, opset: int = 18, dtype: str = "float") -> onnx.ModelProto:
    return parse(f"""<ir_version: 10, opset_import: ["" : {opset}]>
    g ({dtype}[4, 7] x) => ({dtype}[4, 7] y) {{
      lo = Constant <value = {dtype} {{-1}}> ()
      hi = Constant <value = {dtype} {{2}}> ()
      {body}
    }}""")


def _clip_inputs(model: onnx.ModelProto) -> list[str]:
    clip = producer(model, "y")
    assert clip.op_type == "Clip"
    return list(clip.input)


def _constant(model: onnx.ModelProto, name: str) -> float:
    return float(nh.to_array(producer(model, name).attribute[0].t))


def test_min_max_becomes_one_clip(rng):
    for body in ("t = Max(x, lo)\n y = Min(t, hi)", "t = Max(lo, x)\n y = Min(hi, t)"):
        model = _model(body)
        after, modified = normalise(model)
        # one Clip reading the model's own bound Constants; the infinite bounds of the
        # one-sided steps are gone with the Clip they fed
        assert modified and ops(after) == {"Clip": 1, "Constant": 2}
        x, lo, hi = _clip_inputs(after)
        assert x == "x" and _constant(after, lo) == -1.0 and _constant(after, hi) == 2.0
        assert_same(model, after, rng, feeds=_feeds(rng))


def test_max_min_becomes_one_clip_when_ordered(rng):
    model = _model("t = Min(x, hi)\n y = Max(t, lo)")
    after, _ = normalise(model)
    assert ops(after)["Clip"] == 1
    assert_same(model, after, rng, feeds=_feeds(rng))


def test_max_min_with_crossed_bounds_is_not_merged(rng):
    # Max(Min(x, -1), 2) is 2 everywhere, Clip(x, 2, -1) is -1: the merge must not happen
    model = _model("t = Min(x, lo)\n y = Max(t, hi)")
    after, _ = normalise(model)
    assert ops(after)["Clip"] == 2
    assert_same(model, after, rng, feeds=_feeds(rng))


def test_one_sided_clamps_keep_infinities(rng):
    for body, inf_at in (("y = Min(x, hi)", 1), ("y = Max(lo, x)", 2)):
        model = _model(body)
        after, _ = normalise(model)
        inputs = _clip_inputs(after)
        assert np.isinf(_constant(after, inputs[inf_at]))
        assert_same(model, after, rng, feeds=_feeds(rng))


def test_integer_clamp_leaves_the_bound_empty(rng):
    model = _model("y = Min(x, hi)", dtype="int64")
    after, _ = normalise(model)
    assert _clip_inputs(after)[1] == ""
    feeds = {"x": np.concatenate([rng.integers(-9, 9, 26), [2**63 - 1, -(2**63)]]).reshape(4, 7)}
    assert_same(model, after, rng, feeds=feeds)


def test_rank_one_bound_is_made_scalar(rng):
    model = parse("""<ir_version: 10, opset_import: ["" : 18]>
    g (float[4, 7] x) => (float[4, 7] y) <float[1] hi = {0.5}> {
      y = Min(x, hi)
    }""")
    after, _ = normalise(model)
    bound = producer(after, _clip_inputs(after)[2])
    assert bound.op_type == "Constant" and list(bound.attribute[0].t.dims) == []
    assert_same(model, after, rng, feeds=_feeds(rng))


def test_bound_that_could_change_rank_stays():
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    hi = nh.from_array(np.array([[0.5]], dtype=np.float32), "hi")
    graph = helper.make_graph([helper.make_node("Min", ["x", "hi"], ["y"])], "g", [x], [y], [hi])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    assert_untouched(model)


def test_non_scalar_bound_and_old_opset_stay():
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (float[4, 7] x) => (float[4, 7] y) <float[7] hi = {1, 2, 3, 4, 5, 6, 7}> {
          y = Min(x, hi)
        }""")
    )
    assert_untouched(_model("y = Min(x, hi)", opset=12))


def test_attribute_clip_becomes_inputs(rng):
    for attrs, bounds in (("<min = -0.5, max = 1.5>", (-0.5, 1.5)), ("<max = 1.5>", None)):
        model = parse(f"""<ir_version: 10, opset_import: ["" : 6]>
        g (float[4, 7] x) => (float[4, 7] y) {{
          y = Clip {attrs} (x)
        }}""")
        after, modified = normalise(model)
        x, lo, hi = _clip_inputs(after)
        assert modified and x == "x"
        if bounds is not None:
            assert (_constant(after, lo), _constant(after, hi)) == bounds
        else:  # the absent min is its default, the float32 lowest (so -inf is clamped as before)
            assert _constant(after, lo) == float(np.finfo(np.float32).min)
        # the input form is ONNX from opset 11: run it there, the original at opset 6
        after.opset_import[0].version = 11
        feeds = _feeds(rng)
        expected = session(model).run(None, feeds)[0]
        np.testing.assert_array_equal(session(after).run(None, feeds)[0], expected)


#: (inner op, its inputs, outer op, its inputs): every operand order of both clamp nestings.
CLAMP_FORMS = [
    ("Max", ["x", "lo"], "Min", ["t", "hi"]),
    ("Max", ["lo", "x"], "Min", ["hi", "t"]),
    ("Min", ["x", "hi"], "Max", ["t", "lo"]),
    ("Min", ["hi", "x"], "Max", ["lo", "t"]),
]


@settings(max_examples=30, deadline=None)
@given(
    lo=st.floats(-4, 4, width=32),
    hi=st.floats(-4, 4, width=32),
    form=st.sampled_from(CLAMP_FORMS),
    seed=st.integers(0, 2**31),
)
def test_clamp_forms_compute_the_same(lo, hi, form, seed):
    inner_op, inner_in, outer_op, outer_in = form
    nodes = [
        helper.make_node(inner_op, inner_in, ["t"]),
        helper.make_node(outer_op, outer_in, ["y"]),
    ]
    bounds = [nh.from_array(np.array(v, np.float32), n) for n, v in (("lo", lo), ("hi", hi))]
    vi = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [4, 7]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "g", vi[:1], vi[1:], bounds)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    rng = np.random.default_rng(seed)
    after, modified = normalise(model)
    assert modified and not {"Min", "Max"} & set(ops(after)), form
    # Min(Max(x, lo), hi) is Clip(x, lo, hi) for every lo, hi; Max(Min(x, hi), lo) when lo <= hi
    merged = inner_op == "Max" or lo <= hi
    assert ops(after)["Clip"] == (1 if merged else 2)
    assert_same(model, after, rng, feeds=_feeds(rng))
