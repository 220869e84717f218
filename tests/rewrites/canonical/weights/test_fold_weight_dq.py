"""FoldWeightLayoutPass, rule 2: layout ops move through DequantizeLinear onto its constants.

As in ``test_fold_weight_layout.py`` (the models: ``fold_weight_models.py``): the canonical
form, bit-exact equality in ORT on fresh inputs, the original unchanged; hypothesis drives
random shapes, perms, axes, slices, reshapes and concats through DequantizeLinear.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest
from fold_weight_models import (
    QUANT_TYPES,
    assert_dq_of_constants_feeds,
    assert_unchanged,
    axis_survives,
    concat_cases,
    dq_inputs,
    dq_node,
    fold,
    initializer_names,
    model,
    ops,
    ort_slice,
    per_expert_stack,
    producer,
    reshape_cases,
    slice_cases,
    tensor,
    transpose_cases,
)
from hypothesis import given, settings
from onnx import TensorProto, helper


@pytest.mark.parametrize("kind", sorted(QUANT_TYPES))
@pytest.mark.parametrize("mode", ["axis", "block"])
def test_unsqueeze_reshape_through_dequantize(kind, mode, rng):
    """Per-expert [N, K] weights: Unsqueeze to [1, N, K], then Reshape to [1, N, 2, K/2]."""
    names, inits, attrs = dq_inputs(rng, kind, (3, 8), mode, axis=0, block=2)
    inits.append(tensor("axes", np.array([0])))
    inits.append(tensor("shape", np.array([1, 3, 2, 4])))
    nodes = [
        dq_node(names, "d", attrs),
        helper.make_node("Unsqueeze", ["d", "axes"], ["u"]),
        helper.make_node("Reshape", ["u", "shape"], ["w"]),
    ]
    _, folded = fold(model(nodes, inits, [1, 3, 2, 4]), rng)
    assert_dq_of_constants_feeds(folded)
    assert ops(folded) == Counter({"DequantizeLinear": 1, "Mul": 1})


@pytest.mark.parametrize("kind", ["int4", "uint8"])
@pytest.mark.parametrize(
    ("mode", "axis", "shared_scales", "stacked_layout"),
    [
        ("tensor", 0, True, ("tensor", None)),
        ("tensor", 0, False, ("axis", 0)),  # one scale per expert
        ("axis", 0, True, ("axis", 1)),
        ("axis", 0, False, ("block", 2)),  # per row and expert: one block over K
        ("axis", 1, False, ("block", 1)),
        ("block", 1, False, ("block", 2)),
    ],
)
def test_concat_of_per_expert_dequantize(kind, mode, axis, shared_scales, stacked_layout, rng):
    """Per-expert DQs unsqueezed and concatenated into a stack: one DQ of the stacked q."""
    _, folded = fold(per_expert_stack(rng, kind, mode, axis, shared_scales), rng)
    assert_dq_of_constants_feeds(folded)
    assert ops(folded) == Counter({"DequantizeLinear": 1, "Mul": 1})
    attrs = {a.name: a.i for a in producer(folded, "w").attribute}
    want_mode, want_axis = stacked_layout
    assert ("block_size" in attrs) == (want_mode == "block")
    if want_mode != "tensor":
        assert attrs["axis"] == want_axis


def test_concat_of_different_per_axis_scales_needs_opset_21(rng):
    proto = per_expert_stack(rng, "int8", "axis", 0, shared_scales=False, opset=13)
    _, folded = fold(proto, rng)  # the Unsqueezes move into the DQs; the Concat stays
    assert ops(folded) == Counter({"DequantizeLinear": 3, "Concat": 1, "Mul": 1})


@pytest.mark.parametrize("kind", sorted(QUANT_TYPES))
@pytest.mark.parametrize(
    ("mode", "quant_axis", "split_axis"),
    [("axis", 0, 0), ("axis", 0, 1), ("block", 2, 1), ("block", 2, 2), ("tensor", 0, 2)],
)
def test_split_fused_gate_up_through_dequantize(kind, mode, quant_axis, split_axis, rng):
    """A fused gate_up [E, 2I, K] split in halves (the block axis K splits on block edges)."""
    shape = (4, 6, 8)
    names, inits, attrs = dq_inputs(rng, kind, shape, mode, quant_axis, block=4)
    half = shape[split_axis] // 2
    inits.append(tensor("sizes", np.array([half, half])))
    nodes = [
        dq_node(names, "d", attrs),
        helper.make_node("Split", ["d", "sizes"], ["gate", "up"], axis=split_axis),
        helper.make_node("Add", ["gate", "up"], ["w"]),
    ]
    out_shape = list(shape)
    out_shape[split_axis] = half
    _, folded = fold(model(nodes, inits, out_shape), rng)
    assert ops(folded) == Counter({"DequantizeLinear": 2, "Add": 1, "Mul": 1})
    for half_name in ("gate", "up"):
        assert_dq_of_constants_feeds(folded, half_name)


def test_dequantize_with_other_users_is_kept(rng):
    names, inits, attrs = dq_inputs(rng, "int4", (4, 4), "block", axis=1, block=2)
    nodes = [
        dq_node(names, "d", attrs),
        helper.make_node("Transpose", ["d"], ["t"]),
        helper.make_node("Add", ["t", "d"], ["w"]),
    ]
    _, folded = fold(model(nodes, inits, [4, 4]), rng)
    assert ops(folded) == Counter({"DequantizeLinear": 2, "Add": 1, "Mul": 1})
    assert producer(folded, "d").op_type == "DequantizeLinear"
    assert_dq_of_constants_feeds(folded, "t")
    assert {"q", "s", "zp"} <= initializer_names(folded)


def test_dequantize_of_non_constant_left_alone(rng):
    names, inits, attrs = dq_inputs(rng, "int8", (4, 4), "axis", axis=0)
    scale_input = helper.make_tensor_value_info("s", TensorProto.FLOAT, [4])
    nodes = [dq_node(names, "d", attrs), helper.make_node("Transpose", ["d"], ["w"])]
    assert_unchanged(model(nodes, inits, [4, 4], extra_inputs=[scale_input]))


def test_cast_after_dequantize_left_alone(rng):
    """DQ then Cast rounds at the DQ's type: dequantizing straight to the other type differs."""
    names, inits, attrs = dq_inputs(rng, "int8", (4, 4), "axis", axis=0)
    inits[1] = tensor("s", rng.uniform(0.1, 1, (4,)).astype(np.float16))
    nodes = [dq_node(names, "d", attrs), helper.make_node("Cast", ["d"], ["w"], to=1)]
    assert_unchanged(model(nodes, inits, [4, 4]))


@settings(max_examples=60, deadline=None)
@given(transpose_cases())
def test_transpose_through_dequantize(case):
    shape, perm, mode, axis, block, kind, zero_point, seed = case
    rng = np.random.default_rng(seed)
    positive = axis % len(shape)
    names, inits, attrs = dq_inputs(rng, kind, shape, mode, positive, block, zero_point)
    if "axis" in attrs:
        attrs["axis"] = axis  # negative axes too
    nodes = [dq_node(names, "d", attrs), helper.make_node("Transpose", ["d"], ["w"], perm=perm)]
    out_shape = [shape[p] for p in perm]
    _, folded = fold(model(nodes, inits, out_shape), rng)
    assert_dq_of_constants_feeds(folded)
    new_dq = producer(folded, "w")
    if mode != "tensor":
        (new_axis,) = [a.i for a in new_dq.attribute if a.name == "axis"]
        assert new_axis == perm.index(positive)


@settings(max_examples=60, deadline=None)
@given(slice_cases())
def test_slice_through_dequantize(case):
    """Any Slice folds unless it is empty or cuts blocks; the numbers never change."""
    shape, mode, quant_axis, cut_axis, (start, end, step), kind, seed = case
    rng = np.random.default_rng(seed)
    names, inits, attrs = dq_inputs(rng, kind, shape, mode, quant_axis, block=3)
    for name, values in [("starts", [start]), ("ends", [end]), ("axes", [cut_axis])]:
        inits.append(tensor(name, np.array(values)))
    inits.append(tensor("steps", np.array([step])))
    nodes = [
        dq_node(names, "d", attrs),
        helper.make_node("Slice", ["d", "starts", "ends", "axes", "steps"], ["w"]),
    ]
    kept = ort_slice(shape[cut_axis], start, end, step)
    out_shape = list(shape)
    out_shape[cut_axis] = len(kept)
    proto = model(nodes, inits, out_shape)
    first, stop = (kept[0], kept[-1] + 1) if len(kept) else (0, 0)
    on_blocks = (
        list(kept) == list(range(first, stop))
        and first % 3 == 0
        and (stop % 3 == 0 or stop == shape[cut_axis])
    )
    eligible = len(kept) > 0 and (mode != "block" or cut_axis != quant_axis or on_blocks)
    if not eligible:
        assert_unchanged(proto)
        return
    _, folded = fold(proto, rng)
    assert_dq_of_constants_feeds(folded)


@settings(max_examples=60, deadline=None)
@given(reshape_cases())
def test_reshape_through_dequantize(case):
    """A reshape folds into the DQ exactly when its quantized axis survives (always per tensor)."""
    shape, target, mode, axis, kind, seed = case
    rng = np.random.default_rng(seed)
    names, inits, attrs = dq_inputs(rng, kind, shape, mode, axis, block=2)
    inits.append(tensor("shape", np.array(target)))
    nodes = [dq_node(names, "d", attrs), helper.make_node("Reshape", ["d", "shape"], ["w"])]
    proto = model(nodes, inits, target)
    if mode != "tensor" and not axis_survives(shape, target, axis):
        assert_unchanged(proto)
        return
    _, folded = fold(proto, rng)
    assert_dq_of_constants_feeds(folded)


@settings(max_examples=60, deadline=None)
@given(concat_cases())
def test_concat_through_dequantize(case):
    """Concat of DQs folds into one DQ whenever one DQ can hold every element's scale."""
    shape, mode, quant_axis, concat_axis, sizes, kind, shared, seed = case
    rng = np.random.default_rng(seed)
    if shared:  # one scale tensor for every part, so parts of one shape
        sizes = [shape[concat_axis]] * len(sizes)
    nodes, inits, fixed = [], [], None
    for i, size in enumerate(sizes):
        part_shape = tuple(size if a == concat_axis else d for a, d in enumerate(shape))
        names, part_inits, attrs = dq_inputs(
            rng, kind, part_shape, mode, quant_axis, 2, prefix=f"p{i}", fixed=fixed
        )
        if shared and fixed is None:
            fixed = tuple(ir.serde.deserialize_tensor(t).numpy() for t in part_inits[1:])
        inits += part_inits
        nodes.append(dq_node(names, f"d{i}", attrs))
    parts = [f"d{i}" for i in range(len(sizes))]
    nodes.append(helper.make_node("Concat", parts, ["w"], axis=concat_axis))
    out_shape = list(shape)
    out_shape[concat_axis] = sum(sizes)
    proto = model(nodes, inits, out_shape)
    across = concat_axis != quant_axis
    if mode == "block":
        folds = across or all(size % 2 == 0 for size in sizes[:-1])
    elif mode == "axis" and across:
        folds = shared or len(shape) == 3  # one block along the third axis
    else:
        folds = True
    if not folds:
        assert_unchanged(proto)
        return
    _, folded = fold(proto, rng)
    assert_dq_of_constants_feeds(folded)
