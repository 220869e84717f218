"""Top-1 selection: ``ArgMax`` / ``ReduceMax`` beside it -> ``TopK(k=1)``; Unsqueeze(Squeeze)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_spellings_common import assert_same, assert_untouched, normalise, ops, parse, producer

_SWITCH = """<ir_version: 10, opset_import: ["" : {opset}]>
g (float[T, 6] p) => (int64[{idx_shape}] i, float[{idx_shape}] w) {{
  axes = Constant <value = int64[1] {{{axis}}}> ()
  i = ArgMax <axis = {axis}, keepdims = {keepdims}> (p)
  w = ReduceMax <keepdims = {keepdims}> (p, axes)
}}"""


def _switch(axis: int, keepdims: int, opset: int = 18) -> str:
    shape = "T, 1" if keepdims else "T"
    return _SWITCH.format(opset=opset, axis=axis, keepdims=keepdims, idx_shape=shape)


def _ties(rng: np.random.Generator, rows: int) -> dict:
    """Scores with many equal maxima (a few integer levels), so ties decide the index."""
    return {"p": rng.integers(0, 3, size=(rows, 6)).astype(np.float32)}


@settings(max_examples=12, deadline=None)
@given(axis=st.sampled_from([-1, 1]), keepdims=st.sampled_from([0, 1]), seed=st.integers(0, 2**31))
def test_argmax_and_max_become_one_row_top1(axis, keepdims, seed):
    rng = np.random.default_rng(seed)
    model = parse(_switch(axis, keepdims))
    after, modified = normalise(model)
    assert modified and "ArgMax" not in ops(after) and "ReduceMax" not in ops(after)
    assert ops(after)["TopK"] == 2
    # ties: TopK's lower-index tie break is ArgMax's first maximum, bit for bit
    assert_same(model, after, rng, feeds=_ties(rng, 9))
    assert_same(model, after, rng, dims={"T": 5})


def test_last_index_argmax_and_lone_reducemax_stay():
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (float[T, 6] p) => (int64[T, 1] i) {
          i = ArgMax <axis = -1, select_last_index = 1> (p)
        }""")
    )
    # a ReduceMax with no selection of the same row beside it (a softmax's shift)
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (float[T, 6] p) => (float[T, 6] s) {
          axes = Constant <value = int64[1] {-1}> ()
          m = ReduceMax (p, axes)
          s = Sub(p, m)
        }""")
    )


def test_maximum_along_another_axis_than_the_argmax_is_not_rewritten():
    model = parse("""<ir_version: 10, opset_import: ["" : 18]>
    g (float[T, 6] p) => (int64[1, 6] i, float[T, 1] w) {
      axes = Constant <value = int64[1] {-1}> ()
      i = ArgMax <axis = 0> (p)
      w = ReduceMax (p, axes)
    }""")
    after, _ = normalise(model)
    assert producer(after, "w").op_type == "ReduceMax"


def test_opset_12_and_bfloat16_stay():
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 12]>
        g (float[T, 6] p) => (int64[T, 1] i, float[T, 1] w) {
          i = ArgMax <axis = -1> (p)
          w = ReduceMax <axes = [-1]> (p)
        }""")
    )
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (bfloat16[T, 6] p) => (int64[T, 1] i) {
          i = ArgMax <axis = -1> (p)
        }""")
    )


def test_unsqueeze_of_squeeze_on_the_same_axis_is_identity(rng):
    model = parse("""<ir_version: 10, opset_import: ["" : 18]>
    g (float[T, 4] p) => (float[T, 1] y) {
      one = Constant <value = int64[1] {1}> ()
      x, i = TopK(p, one)
      a = Constant <value = int64[1] {-1}> ()
      b = Constant <value = int64[1] {1}> ()
      s = Squeeze(x, a)
      y = Unsqueeze(s, b)
    }""")
    after, modified = normalise(model)
    assert modified and producer(after, "y").op_type == "Identity"
    assert_same(model, after, rng, dims={"T": 4})


def test_unsqueeze_elsewhere_than_the_squeeze_stays():
    # not a TopK's output: left for the passes that read the pair as written
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (float[T, 1] x) => (float[T, 1] y) {
          a = Constant <value = int64[1] {1}> ()
          s = Squeeze(x, a)
          y = Unsqueeze(s, a)
        }""")
    )
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (float[T, 1] x) => (float[1, T] y) {
          a = Constant <value = int64[1] {1}> ()
          b = Constant <value = int64[1] {0}> ()
          s = Squeeze(x, a)
          y = Unsqueeze(s, b)
        }""")
    )


def _rounds_model(rounds: int, experts: int, fill: str = "-inf", mask_at: str = "prev") -> str:
    """PhiMoE-style rounds of ArgMax over a router projection, each masking the previous pick."""
    lines = ["l = MatMul(x, w)", "i0 = ArgMax <axis = -1, keepdims = 1> (l)"]
    for j in range(1, rounds):
        at = f"i{j - 1}" if mask_at == "prev" else "i0"
        lines += [
            f"shape{j} = Shape(i{j - 1})",
            f"fill{j} = ConstantOfShape <value = float[1] {{{fill}}}> (shape{j})",
            f"s{j} = ScatterElements <axis = -1> ({'l' if j == 1 else f's{j - 1}'}, {at}, fill{j})",
            f"i{j} = ArgMax <axis = -1, keepdims = 1> (s{j})",
        ]
    joined = ", ".join(f"i{j}" for j in range(rounds))
    lines.append(f"y = Concat <axis = -1> ({joined})")
    body = "\n      ".join(lines)
    return f"""<ir_version: 10, opset_import: ["" : 18]>
    g (float[T, 8] x, float[8, {experts}] w) => (int64[T, {rounds}] y) {{
      {body}
    }}"""


@settings(max_examples=20, deadline=None)
@given(experts=st.integers(2, 6), data=st.data(), seed=st.integers(0, 2**31))
def test_top1_rounds_become_one_topk_and_compute_the_same(experts, data, seed):
    rounds = data.draw(st.integers(2, experts))
    rng = np.random.default_rng(seed)
    model = parse(_rounds_model(rounds, experts))
    after, modified = normalise(model)
    assert modified
    y = producer(after, "y")
    assert y.op_type == "TopK"
    # ties everywhere: integer-valued logits (x one-hot-ish, w small integers)
    x = rng.integers(-1, 2, size=(9, 8)).astype(np.float32)
    w = rng.integers(-1, 2, size=(8, experts)).astype(np.float32)
    assert_same(model, after, rng, feeds={"x": x, "w": w})
    assert_same(model, after, rng, dims={"T": 5})


def test_rounds_that_do_not_mask_with_minus_inf_or_mask_another_pick_stay():
    for text in (_rounds_model(2, 4, fill="0"), _rounds_model(3, 4, mask_at="first")):
        after, _ = normalise(parse(text))
        assert producer(after, "y").op_type == "Concat"
    # as many rounds as experts + 1 would pick a masked expert again: left as it is
    after, _ = normalise(parse(_rounds_model(3, 2)))
    assert producer(after, "y").op_type == "Concat"
