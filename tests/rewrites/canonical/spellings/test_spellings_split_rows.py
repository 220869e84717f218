"""Row-split spellings (``canonical/spellings/split_rows.py``): Reshapes of token rows moved out of a combine.

The positive cases are written the way optimum-onnx's dense gpt-oss writes its combine: the
targets computed from ``Shape(hidden)`` (``[E, B, -1, H]``), so the rules must prove the two
splits equal symbolically. Each rewritten model computes the same as the original in ONNX
Runtime; the negative cases (a different split, an axis-0 change, a kept axis, rows tiled
the other way) come out exactly as they went in.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spellings.build import build_case
from spellings.outcomes import check_equivalent
from spellings.strategies import SMALL_BASE
from test_spellings_common import assert_same, assert_untouched, normalise, ops, parse, producer

from onnx_moe_fuse import fuse
from onnx_moe_fuse.pipeline.split_rows_diagnosis import SPLIT_UNPROVED

COMBINE = """<ir_version: 10, opset_import: ["" : {opset}]>
g (float[B, S, 8] hidden, float[4, 8, 8] w_up, float[8, 4] router) => ({out_type} out) {{
  flat_shape = Constant <value = int64[2] {{-1, 8}}> ()
  x = Reshape(hidden, flat_shape)
  y = MatMul(x, w_up)
  logits = MatMul(x, router)
  probs = Softmax <axis = -1> (logits)
  w = Transpose <perm = [1, 0]> (probs)
  shape = Shape(hidden)
  zero = Constant <value = int64 {{0}}> ()
  b = Gather <axis = 0> (shape, zero)
  axis0 = Constant <value = int64[1] {{0}}> ()
  b1 = Unsqueeze(b, axis0)
  e = Constant <value = int64[1] {{4}}> ()
  rest = Constant <value = int64[1] {{-1}}> ()
  h = Constant <value = int64[1] {{8}}> ()
  t_y = Concat <axis = 0> ({y_pieces})
  t_w = Concat <axis = 0> ({w_pieces})
  y4 = Reshape(y, t_y)
  w3 = Reshape(w, t_w)
  last = Constant <value = int64[1] {{3}}> ()
  w4 = Unsqueeze(w3, last)
  m = Mul({operands})
  sum_axes = Constant <value = int64[1] {{{sum_axis}}}> ()
  out = ReduceSum <keepdims = {keepdims}> (m, sum_axes)
}}"""


def combine(
    *,
    y_pieces: str = "e, b1, rest, h",
    w_pieces: str = "e, b1, rest",
    operands: str = "y4, w4",
    sum_axis: int = 0,
    keepdims: int = 0,
    opset: int = 18,
    out_type: str = "float[B, S, 8]",
):
    return parse(
        COMBINE.format(
            y_pieces=y_pieces,
            w_pieces=w_pieces,
            operands=operands,
            sum_axis=sum_axis,
            keepdims=keepdims,
            opset=opset,
            out_type=out_type,
        )
    )


def test_split_rows_combine_becomes_a_flat_combine(rng):
    model = combine()
    after, modified = normalise(model)
    assert modified
    # the sum reads the product of the flat rows and the [E, T, 1] weights; one Reshape after
    total = producer(after, "out")
    assert total.op_type == "Reshape"
    summed = producer(after, total.input[0])
    assert summed.op_type == "ReduceSum"
    product = producer(after, summed.input[0])
    assert product.op_type == "Mul" and product.input[0] == "y"
    weights = producer(after, product.input[1])
    assert weights.op_type == "Unsqueeze" and weights.input[0] == "w"
    assert ops(after)["Reshape"] == 2  # the tokens' flattening and the split of the sum
    # the new target is the rest of the old one: it reads B, not the expert count
    assert producer(after, total.input[1]).input == ["b1", "rest", "h"]
    assert_same(model, after, rng, dims={"B": 2, "S": 3}, rtol=1e-6, atol=1e-6)


def test_weights_first_and_opset_13(rng):
    for model in (combine(operands="w4, y4"), combine(opset=13)):
        after, modified = normalise(model)
        assert modified and producer(after, "out").op_type == "Reshape"
        assert_same(model, after, rng, dims={"B": 3, "S": 2}, rtol=1e-6, atol=1e-6)


def test_a_different_split_of_the_weights_is_left_alone():
    # [E, -1, B] splits the rows the other way; a rewrite would pair other elements
    assert_untouched(combine(w_pieces="e, rest, b1"))


def test_a_sum_over_another_axis_or_keeping_it_keeps_its_reshape(rng):
    for model in (
        combine(sum_axis=1, out_type="float[4, S, 8]"),
        combine(keepdims=1, out_type="float[1, B, S, 8]"),
    ):
        after, _ = normalise(model)
        total = producer(after, "out")
        assert total.op_type == "ReduceSum"  # the sum still reads the split rows
        assert producer(after, total.input[0]).op_type == "Reshape"
        assert_same(model, after, rng, dims={"B": 2, "S": 2}, rtol=1e-6, atol=1e-6)


def test_a_reshape_that_changes_axis_0_is_left_alone():
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (float[4, 6, 8] m) => (float[3, 8] out) <int64[3] t = {8, 3, 8}, int64[1] ax = {0}> {
          s = Reshape(m, t)
          out = ReduceSum <keepdims = 0> (s, ax)
        }""")
    )


def test_one_token_rows_unflattened_into_slots_stay():
    # [T*k, H] rows of a static one-token export made [1, k, H] slots: the rows rule's own form
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (float[6, 8] m) => (float[1, 8] out) <int64[3] t = {1, 6, 8}, int64[1] ax = {1}> {
          s = Reshape(m, t)
          out = ReduceSum <keepdims = 0> (s, ax)
        }""")
    )


def test_slots_split_by_batch_and_sequence_sum_over_k(rng):
    model = parse("""<ir_version: 10, opset_import: ["" : 18]>
    g (float[6, 2, 8] y, float[6, 2] w) => (float[2, 3, 8] out)
      <int64[4] t = {2, 3, 2, 8}, int64[3] s = {2, 3, 2}, int64[1] last = {3}, int64[1] ax = {2}> {
      y4 = Reshape(y, t)
      w3 = Reshape(w, s)
      w4 = Unsqueeze(w3, last)
      m = Mul(w4, y4)
      out = ReduceSum <keepdims = 0> (m, ax)
    }""")
    after, modified = normalise(model)
    assert modified
    total = producer(after, "out")
    assert total.op_type == "Reshape" and producer(after, total.input[0]).op_type == "ReduceSum"
    assert_same(model, after, rng, rtol=1e-6, atol=1e-6)


def test_tiled_rows_regrouped_by_copy_become_an_expand(rng):
    model = parse("""<ir_version: 10, opset_import: ["" : 18]>
    g (float[T, 8] x) => (float[3, T, 8] y) <int64[2] reps = {3, 1}, int64[3] t = {3, -1, 8}> {
      tiled = Tile(x, reps)
      y = Reshape(tiled, t)
    }""")
    after, modified = normalise(model)
    assert modified and ops(after) == {"Unsqueeze": 1, "Expand": 1, "Constant": 2}
    assert_same(model, after, rng, dims={"T": 5})


def test_tiled_rows_regrouped_by_row_stay():
    # [T, 3, 8] interleaves copies and rows: not the broadcast of x over a copy axis
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (float[5, 8] x) => (float[5, 3, 8] y) <int64[2] reps = {3, 1}, int64[3] t = {5, 3, 8}> {
          tiled = Tile(x, reps)
          y = Reshape(tiled, t)
        }""")
    )
    assert_untouched(
        parse("""<ir_version: 10, opset_import: ["" : 18]>
        g (float[5, 8] x) => (float[5, 16] y) <int64[2] reps = {1, 2}, int64[2] t = {5, 16}> {
          tiled = Tile(x, reps)
          y = Reshape(tiled, t)
        }""")
    )


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 4),
    weights_first=st.booleans(),
    opset=st.sampled_from([13, 18, 21]),
    seed=st.integers(0, 2**31),
)
def test_split_rows_combines_keep_their_numbers(batch, seq, weights_first, opset, seed):
    model = combine(operands="w4, y4" if weights_first else "y4, w4", opset=opset)
    after, modified = normalise(model)
    assert modified and producer(after, "out").op_type == "Reshape"
    assert_same(
        model,
        after,
        np.random.default_rng(seed),
        dims={"B": batch, "S": seq},
        rtol=1e-6,
        atol=1e-6,
    )


# -- end to end: the generator's split combines, fused or refused naming the part ----------------


def _split_case(**changes):
    base = replace(SMALL_BASE, combine="split_rows", rank=3, token_dims=(2, 3), top_k=2)
    return replace(base, **changes)


@pytest.mark.parametrize("experts", ["gather_expand", "einsum", "dense_onehot"])
@pytest.mark.parametrize("shapes", ["static", "symbolic"])
def test_split_combines_fuse_and_match_ort(experts, shapes):
    outcome = check_equivalent(_split_case(experts=experts, shapes=shapes))
    assert outcome.kind == "fused", outcome


@pytest.mark.parametrize(
    ("mutation", "words"),
    [("router_token_slice", "router"), ("topk_axis", "TopK"), ("router_second_input", "router")],
)
def test_an_unproved_split_names_what_else_is_wrong(mutation, words):
    """The split cannot be proved when the router reads other rows: the near miss says both."""
    built = build_case(_split_case(experts="gather_expand", shapes="symbolic", mutation=mutation))
    result = fuse(built.model)
    assert result.report.fusions == []
    [miss] = result.report.near_misses
    assert miss["reason"].startswith(SPLIT_UNPROVED), miss
    assert words in miss["reason"].split("with the split moved out, ")[1], miss
    assert result.model.SerializeToString() == built.model.SerializeToString()
