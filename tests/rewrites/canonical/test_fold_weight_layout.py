"""FoldWeightLayoutPass: layout ops on constant weights fold, and move through DequantizeLinear.

Each test builds a small model ``y = Mul(x, layout(weight))`` (the Mul keeps the folded value
off the graph outputs, as a MoE's Gather would), runs the pass on a clone, and checks three
things: the canonical form (no layout op left, constants or a DQ of constants feeding the Mul),
bit-exact equality with the original in ONNX Runtime CPU (optimisations off) on fresh random
inputs, and that the original model (which shares tensors with the clone) did not change. What
must be left alone is checked to stay byte-identical; hypothesis drives random shapes, perms,
axes, slices, reshapes and concats through DequantizeLinear.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from onnx_moe_fuse.rewrites.canonical.weights.fold_weight_layout import FoldWeightLayoutPass

OPSET = 21
LAYOUT_OPS = {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Concat", "Slice", "Split", "Cast"}
QUANT_TYPES = {
    "int8": (ir.DataType.INT8, -128, 127),
    "uint8": (ir.DataType.UINT8, 0, 255),
    "int4": (ir.DataType.INT4, -8, 7),
    "uint4": (ir.DataType.UINT4, 0, 15),
}


# -- building and running models ---------------------------------------------------------------


def tensor(name: str, array: np.ndarray, dtype: ir.DataType | None = None) -> onnx.TensorProto:
    """A TensorProto of ``array`` (int4/uint4 arrays are ml_dtypes arrays, stored packed)."""
    ir_tensor = ir.Tensor(np.asarray(array), dtype=dtype, name=name)
    return ir.serde.serialize_tensor(ir_tensor)


def weights(rng, shape, dtype=np.float32) -> np.ndarray:
    """Random weights, never zero."""
    return (rng.uniform(0.5, 2.0, shape) * rng.choice([-1, 1], shape)).astype(dtype)


def quantized(rng, kind: str, shape) -> tuple[np.ndarray, ir.DataType]:
    """Random quantized data of ``kind`` as a numpy / ml_dtypes array, with its ONNX type."""
    dtype, low, high = QUANT_TYPES[kind]
    values = rng.integers(low, high + 1, shape)
    return values.astype(dtype.numpy()), dtype


def model(nodes, initializers, out_shape, x_dtype=TensorProto.FLOAT, extra_inputs=(), opset=OPSET):
    """``y = Mul(x, w)`` where ``nodes`` compute ``w`` from ``initializers``."""
    graph = helper.make_graph(
        [*nodes, helper.make_node("Mul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", x_dtype, out_shape), *extra_inputs],
        [helper.make_tensor_value_info("y", x_dtype, None)],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of ``proto`` in ORT CPU with graph optimisations off."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # ORT prepacks constant MatMul weights (another summation order, measured up to 7e-7 apart
    # on the torch grouped_mm exports): folding makes weights constant, so compare unpacked.
    so.add_session_config_entry("session.disable_prepacking", "1")
    session = ort.InferenceSession(proto.SerializeToString(), so, ["CPUExecutionProvider"])
    return session.run(None, feeds)


def fold(proto: onnx.ModelProto, rng, x_dtype=np.float32):
    """Run the pass on a clone; check equality in ORT and that the original is untouched."""
    original = ir.serde.deserialize_model(proto)
    before = ir.serde.serialize_model(original).SerializeToString()
    work = original.clone()
    result = FoldWeightLayoutPass()(work)
    folded = ir.serde.serialize_model(work)
    assert ir.serde.serialize_model(original).SerializeToString() == before
    names = [o for n in folded.graph.node for o in n.output] + [
        i.name for i in folded.graph.initializer
    ]
    assert len(names) == len(set(names)), "duplicate value names"
    x_shape = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    feeds = {"x": weights(rng, x_shape, x_dtype)}
    for expected, got in zip(run(proto, feeds), run(folded, feeds), strict=True):
        np.testing.assert_array_equal(got, expected)
    return result, folded


def ops(proto: onnx.ModelProto) -> Counter:
    """Op histogram of a model's main graph."""
    return Counter(n.op_type for n in proto.graph.node)


def producer(proto: onnx.ModelProto, name: str) -> onnx.NodeProto | None:
    """The node of ``proto`` that outputs ``name`` (None: an initializer or input)."""
    return next((n for n in proto.graph.node if name in n.output), None)


def initializer_names(proto: onnx.ModelProto) -> set[str]:
    """Names of the initializers of ``proto``."""
    return {t.name for t in proto.graph.initializer}


def assert_unchanged(proto: onnx.ModelProto) -> None:
    """The pass leaves ``proto`` byte-identical and reports no change."""
    original = ir.serde.deserialize_model(proto)
    before = ir.serde.serialize_model(original).SerializeToString()
    work = original.clone()
    assert not FoldWeightLayoutPass()(work).modified
    assert ir.serde.serialize_model(work).SerializeToString() == before


# -- rule 1: layout ops on constants ---------------------------------------------------------------


def node(op, inputs, output="w", **attrs):
    """One node writing ``output``."""
    return helper.make_node(op, inputs, [output], **attrs)


# name: (nodes computing w from W, W's shape, int64 parameter initializers)
FLOAT_CASES = {
    "transpose": ([node("Transpose", ["W"], perm=[0, 2, 1])], (3, 5, 4), {}),
    "transpose_default": ([node("Transpose", ["W"])], (3, 5, 4), {}),
    "reshape": ([node("Reshape", ["W", "shape"])], (3, 5, 4), {"shape": [0, -1]}),
    "squeeze": ([node("Squeeze", ["W", "axes"])], (3, 1, 4), {"axes": [1]}),
    "unsqueeze": ([node("Unsqueeze", ["W", "axes"])], (3, 4), {"axes": [0, -1]}),
    "slice": (  # rows 5, 3, 1 (negative step), every other column from 1
        [node("Slice", ["W", "starts", "ends", "axes", "steps"])],
        (6, 8),
        {"starts": [-1, 1], "ends": [0, 100], "axes": [0, 1], "steps": [-2, 2]},
    ),
    "identity": ([node("Identity", ["W"])], (3, 4), {}),
    "chain": (
        [
            node("Unsqueeze", ["W", "axes"], "w0"),
            node("Transpose", ["w0"], "w1", perm=[1, 0, 2]),
            node("Identity", ["w1"]),
        ],
        (4, 6),
        {"axes": [0]},
    ),
}


@pytest.mark.parametrize("case", sorted(FLOAT_CASES))
def test_folds_layout_op_on_initializer(case, rng):
    nodes, shape, params = FLOAT_CASES[case]
    inits = [tensor("W", weights(rng, shape))]
    inits += [tensor(name, np.array(values, np.int64)) for name, values in params.items()]
    # The shape of w, from the model itself (x broadcasts as a single element).
    (w_value,) = run(model(nodes, inits, [1]), {"x": np.ones((1,), np.float32)})
    result, folded = fold(model(nodes, inits, list(w_value.shape)), rng)
    assert result.modified
    assert ops(folded) == Counter({"Mul": 1})
    assert "w" in initializer_names(folded) and "W" not in initializer_names(folded)


def test_folds_constant_node_concat_split_cast(rng):
    """Concat of a Constant node and initializers, Split of the stack, Cast float16 -> float32."""
    parts = [weights(rng, (2, 4, 3), np.float16) for _ in range(3)]
    nodes = [
        helper.make_node("Constant", [], ["c0"], value=tensor("c0", parts[0])),
        helper.make_node("Concat", ["c0", "p1", "p2"], ["stack"], axis=0),
        helper.make_node("Split", ["stack", "sizes"], ["gate", "up"], axis=1),
        helper.make_node("Cast", ["up"], ["w"], to=TensorProto.FLOAT),
    ]
    inits = [tensor("p1", parts[1]), tensor("p2", parts[2]), tensor("sizes", np.array([1, 3]))]
    result, folded = fold(model(nodes, inits, [6, 3, 3]), rng)
    assert ops(folded) == Counter({"Mul": 1})
    assert initializer_names(folded) == {"w"}  # the unused split half and the parts are gone
    assert dict(result.model.graph.initializers)["w"].const_value.dtype == ir.DataType.FLOAT


def test_split_num_outputs_uneven(rng):
    nodes = [
        helper.make_node("Split", ["W"], ["a", "b", "c"], axis=-1, num_outputs=3),
        helper.make_node("Concat", ["c", "a"], ["w"], axis=1),
    ]
    _, folded = fold(model(nodes, [tensor("W", weights(rng, (3, 8)))], [3, 5]), rng)
    assert ops(folded) == Counter({"Mul": 1})


def test_folds_int4_transpose_before_dequantize(rng):
    """Output-major int4 codes transposed in the graph, then dequantized: the codes fold."""
    q, dtype = quantized(rng, "int4", (2, 6, 4))
    scale = rng.uniform(0.1, 1.0, (2, 2, 6)).astype(np.float32)
    inits = [tensor("q", q, dtype), tensor("s", scale)]
    nodes = [
        node("Transpose", ["q"], "qt", perm=[0, 2, 1]),
        node("DequantizeLinear", ["qt", "s"], axis=1, block_size=2),
    ]
    proto = model(nodes, inits, [2, 4, 6])
    result = FoldWeightLayoutPass()(ir.serde.deserialize_model(proto).clone())
    folded = ir.serde.serialize_model(result.model)
    assert ops(folded) == Counter({"DequantizeLinear": 1, "Mul": 1})
    codes = dict(result.model.graph.initializers)["qt"].const_value
    assert codes.dtype == ir.DataType.INT4
    np.testing.assert_array_equal(
        codes.numpy().astype(np.int8), q.transpose(0, 2, 1).astype(np.int8)
    )
    x = weights(rng, (2, 4, 6))
    expected = x * (q.transpose(0, 2, 1).astype(np.float32) * np.repeat(scale, 2, axis=1))
    np.testing.assert_array_equal(run(folded, {"x": x})[0], expected)


@pytest.mark.parametrize(
    ("source", "target"),
    [(TensorProto.FLOAT, TensorProto.FLOAT16), (TensorProto.FLOAT, TensorProto.INT32)],
)
def test_rounding_cast_left_alone(source, target, rng):
    w = weights(rng, (3, 4), helper.tensor_dtype_to_np_dtype(source))
    nodes = [helper.make_node("Cast", ["W"], ["w"], to=target)]
    assert_unchanged(model(nodes, [tensor("W", w)], [3, 4], x_dtype=target))


def test_graph_input_with_default_initializer_is_not_constant(rng):
    """A graph input backed by an initializer can be fed at run time: never fold it."""
    nodes = [helper.make_node("Transpose", ["W"], ["w"], perm=[1, 0])]
    w_input = helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 3])
    proto = model(nodes, [tensor("W", weights(rng, (4, 3)))], [3, 4], extra_inputs=[w_input])
    assert_unchanged(proto)


def test_non_constant_parameter_left_alone(rng):
    nodes = [helper.make_node("Reshape", ["W", "shape"], ["w"])]
    shape_input = helper.make_tensor_value_info("shape", TensorProto.INT64, [2])
    assert_unchanged(
        model(nodes, [tensor("W", weights(rng, (2, 6)))], [3, 4], extra_inputs=[shape_input])
    )


def test_non_constant_and_graph_output_left_alone(rng):
    nodes = [helper.make_node("Transpose", ["x"], ["w"], perm=[1, 0])]
    assert_unchanged(model(nodes, [], [3, 3]))
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["W"], ["y"])],
        "g",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [tensor("W", weights(rng, (2, 3)))],
    )
    assert_unchanged(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]))


@pytest.mark.parametrize("quantized_stack", [False, True])
def test_unstacking_split_left_alone(quantized_stack, rng):
    """Split(W, [1] * E, axis=0) + Squeeze is how grouped_mm reads expert e of a stack: kept."""
    if quantized_stack:
        names, inits, attrs = dq_inputs(rng, "int4", (3, 4, 6), "block", axis=2, block=3)
        nodes = [dq_node(names, "W", attrs)]
    else:
        nodes, inits = [], [tensor("W", weights(rng, (3, 4, 6)))]
    inits.append(tensor("axes", np.array([0])))
    nodes += [
        helper.make_node("Split", ["W"], ["e0", "e1", "e2"], axis=0, num_outputs=3),
        node("Squeeze", ["e1", "axes"]),
    ]
    assert_unchanged(model(nodes, inits, [4, 6]))


def test_shared_weight_stays_for_its_other_user(rng):
    nodes = [
        helper.make_node("Transpose", ["W"], ["wt"]),
        helper.make_node("Add", ["wt", "W"], ["w"]),
    ]
    _, folded = fold(model(nodes, [tensor("W", weights(rng, (3, 3)))], [3, 3]), rng)
    assert ops(folded) == Counter({"Add": 1, "Mul": 1})
    assert initializer_names(folded) == {"W", "wt"}


# -- rule 2: through DequantizeLinear --------------------------------------------------------------


def dq_inputs(rng, kind, shape, mode, axis=0, block=2, zero_point=True, prefix="", fixed=None):
    """Initializers q, s (and zp) for a DQ of ``mode`` ('tensor', 'axis', 'block'), and attrs.

    ``fixed`` gives the (scale, zero point) arrays to use instead of random ones.
    """
    q, dtype = quantized(rng, kind, shape)
    if mode == "tensor":
        scale_shape, attrs = (), {}
    elif mode == "axis":
        scale_shape, attrs = (shape[axis],), {"axis": axis}
    else:
        blocks = -(-shape[axis] // block)
        scale_shape = shape[:axis] + (blocks,) + shape[axis + 1 :]
        attrs = {"axis": axis, "block_size": block}
    scale, zp = fixed or (
        rng.uniform(0.1, 1.0, scale_shape).astype(np.float32),
        quantized(rng, kind, scale_shape)[0],
    )
    names = [f"{prefix}q", f"{prefix}s"] + ([f"{prefix}zp"] if zero_point else [])
    inits = [tensor(names[0], q, dtype), tensor(names[1], scale)]
    if zero_point:
        inits.append(tensor(names[2], zp, dtype))
    return names, inits, attrs


def dq_node(names, out, attrs):
    """A DequantizeLinear node."""
    return helper.make_node("DequantizeLinear", names, [out], **attrs)


def assert_dq_of_constants_feeds(folded, value="w"):
    """``value`` is a DequantizeLinear output whose inputs are all initializers."""
    node = producer(folded, value)
    assert node is not None and node.op_type == "DequantizeLinear"
    assert set(node.input) <= initializer_names(folded)
    assert not LAYOUT_OPS & set(ops(folded))


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


def per_expert_stack(rng, kind, mode, axis, shared_scales, opset=OPSET, expert_shape=(4, 6)):
    """Three per-expert DQs of ``expert_shape``, unsqueezed to [1, ...] and concatenated."""
    nodes, inits = [], [tensor("axes", np.array([0]))]
    fixed = None
    if shared_scales:
        _, shared, _ = dq_inputs(rng, kind, expert_shape, mode, axis)
        fixed = tuple(ir.serde.deserialize_tensor(t).numpy() for t in shared[1:])
    for e in range(3):
        names, expert_inits, attrs = dq_inputs(
            rng, kind, expert_shape, mode, axis, 2, prefix=f"e{e}", fixed=fixed
        )
        inits += expert_inits
        nodes += [
            dq_node(names, f"d{e}", attrs),
            helper.make_node("Unsqueeze", [f"d{e}", "axes"], [f"u{e}"]),
        ]
    nodes.append(helper.make_node("Concat", ["u0", "u1", "u2"], ["w"], axis=0))
    return model(nodes, inits, [3, *expert_shape], opset=opset)


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


# -- rule 2: properties over random layouts --------------------------------------------------------


@st.composite
def transpose_cases(draw):
    rank = draw(st.integers(2, 4))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank)))
    perm = draw(st.permutations(range(rank)))
    mode = draw(st.sampled_from(["tensor", "axis", "block"]))
    axis = draw(st.integers(-rank, rank - 1))
    block = draw(st.sampled_from([1, 2, 4]))
    kind = draw(st.sampled_from(sorted(QUANT_TYPES)))
    return shape, list(perm), mode, axis, block, kind, draw(st.booleans()), draw(st.integers(0))


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


@st.composite
def slice_cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=2, max_size=3)))
    mode = draw(st.sampled_from(["tensor", "axis", "block"]))
    quant_axis = draw(st.integers(0, len(shape) - 1))
    cut_axis = draw(st.integers(0, len(shape) - 1))
    dim = shape[cut_axis]
    ends = sorted([draw(st.integers(-dim - 1, dim + 1)), draw(st.integers(-dim - 1, dim + 1))])
    step = draw(st.sampled_from([1, 1, 2, -1]))
    start, end = ends if step > 0 else ends[::-1]
    kind = draw(st.sampled_from(sorted(QUANT_TYPES)))
    return shape, mode, quant_axis, cut_axis, (start, end, step), kind, draw(st.integers(0))


def ort_slice(dim: int, start: int, end: int, step: int) -> list[int]:
    """The indices ORT's Slice keeps of ``range(dim)`` (ONNX clamps unlike Python's slices)."""
    graph = helper.make_graph(
        [helper.make_node("Slice", ["r", "b", "e", "a", "s"], ["y"])],
        "slice",
        [],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
        [
            tensor(name, np.array(values))
            for name, values in [
                ("r", list(range(dim))),
                ("b", [start]),
                ("e", [end]),
                ("a", [0]),
                ("s", [step]),
            ]
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    return [int(i) for i in run(proto, {})[0]]


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


@st.composite
def reshape_cases(draw):
    """A shape and a reshape of it: adjacent dims merged, dims split, ones inserted."""
    shape = draw(st.lists(st.integers(1, 6), min_size=2, max_size=3))
    target = list(shape)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["merge", "split", "one"]))
        at = draw(st.integers(0, len(target) - 1))
        if how == "merge" and at + 1 < len(target):
            target[at : at + 2] = [target[at] * target[at + 1]]
        elif how == "split" and target[at] % 2 == 0:
            target[at : at + 1] = [2, target[at] // 2]
        else:
            target.insert(at, 1)
    mode = draw(st.sampled_from(["tensor", "axis", "block"]))
    axis = draw(st.integers(0, len(shape) - 1))
    kind = draw(st.sampled_from(sorted(QUANT_TYPES)))
    return tuple(shape), target, mode, axis, kind, draw(st.integers(0))


def axis_survives(shape, target, axis) -> bool:
    """Whether ``target`` keeps dim ``axis`` of ``shape`` whole, with as many elements before."""
    before = int(np.prod(shape[:axis]))
    return any(
        d == shape[axis] and int(np.prod(target[:i])) == before for i, d in enumerate(target)
    )


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


@st.composite
def concat_cases(draw):
    rank = draw(st.integers(2, 3))
    shape = draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank))
    mode = draw(st.sampled_from(["tensor", "axis", "block"]))
    quant_axis, concat_axis = draw(st.integers(0, rank - 1)), draw(st.integers(0, rank - 1))
    sizes = draw(st.lists(st.integers(1, 5), min_size=2, max_size=3))
    kind = draw(st.sampled_from(sorted(QUANT_TYPES)))
    shared = draw(st.booleans())
    return shape, mode, quant_axis, concat_axis, sizes, kind, shared, draw(st.integers(0))


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


# -- names, subgraphs, laziness --------------------------------------------------------------------


def test_fresh_names_avoid_existing_ones(rng):
    """The pushed DQ's new constants are named after its output, skipping names in use."""
    names, inits, attrs = dq_inputs(rng, "int8", (4, 6), "block", axis=1, block=3)
    inits.append(tensor("w_quantized", weights(rng, (1,))))
    nodes = [
        dq_node(names, "d", attrs),
        helper.make_node("Transpose", ["d"], ["t"]),
        helper.make_node("Mul", ["t", "w_quantized"], ["w"]),
    ]
    _, folded = fold(model(nodes, inits, [6, 4]), rng)
    assert_dq_of_constants_feeds(folded, "t")
    assert {"t_quantized", "t_scale", "t_zero_point", "w_quantized"} <= initializer_names(folded)


def test_folds_inside_subgraph_from_outer_weight(rng):
    branch = helper.make_graph(
        [
            helper.make_node("Transpose", ["W"], ["wt"], perm=[1, 0]),
            helper.make_node("Mul", ["x", "wt"], ["out"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["out2"])],
        "else",
        [],
        [helper.make_tensor_value_info("out2", TensorProto.FLOAT, None)],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["cond"], value=tensor("c", np.array(True))),
            helper.make_node("If", ["cond"], ["w"], then_branch=branch, else_branch=other),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("w", TensorProto.FLOAT, None)],
        [tensor("W", weights(rng, (4, 3)))],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    result, folded = fold(proto, rng)
    then_branch = next(a.g for a in folded.graph.node[1].attribute if a.name == "then_branch")
    assert [n.op_type for n in then_branch.node] == ["Mul"]
    assert {t.name for t in then_branch.initializer} == {"wt"}


def test_folding_reads_no_weight_until_asked(rng):
    """Rule 1 defers the numpy work: a Transpose of Cast of a weight reads it when read, each time.

    Nothing is kept: a rule reads a layer's weights transiently, so the working copy never
    holds every fused layer's weights (docs/architecture.md, "Memory").
    """
    calls = []
    w = weights(rng, (3, 4), np.float16)

    def read() -> ir.Tensor:
        calls.append(1)
        return ir.Tensor(w)

    source = ir.LazyTensor(read, ir.DataType.FLOAT16, ir.Shape([3, 4]))
    weight = ir.Value(name="W", type=ir.TensorType(ir.DataType.FLOAT16), shape=source.shape)
    weight.const_value = source
    cast = ir.node("Cast", [weight], {"to": int(ir.DataType.FLOAT)})
    transpose = ir.node("Transpose", [cast.outputs[0]], {"perm": [1, 0]})
    identity = ir.node("Identity", [transpose.outputs[0]])
    graph = ir.Graph(
        [], identity.outputs, nodes=[cast, transpose, identity], opset_imports={"": OPSET}
    )
    graph.register_initializer(weight)
    assert FoldWeightLayoutPass()(ir.Model(graph, ir_version=10)).modified
    assert not calls
    (folded,) = [v for v in graph.initializers.values() if v.name != "W"]
    np.testing.assert_array_equal(folded.const_value.numpy(), w.astype(np.float32).T)
    assert len(calls) == 1
    np.testing.assert_array_equal(folded.const_value.numpy(), w.astype(np.float32).T)
    assert len(calls) == 2
    assert [n.op_type for n in graph] == ["Identity"]


def test_unreadable_external_weight_does_not_raise():
    """A weight whose external data file is missing: the pass runs, reading it still fails."""
    missing = ir.ExternalTensor(
        "missing.bin", 0, 24, ir.DataType.FLOAT, shape=ir.Shape([2, 3]), name="W"
    )
    weight = ir.Value(name="W", type=ir.TensorType(ir.DataType.FLOAT), shape=missing.shape)
    weight.const_value = missing
    transpose = ir.node("Transpose", [weight], {"perm": [1, 0]})
    identity = ir.node("Identity", [transpose.outputs[0]])
    graph = ir.Graph([], identity.outputs, nodes=[transpose, identity], opset_imports={"": OPSET})
    graph.register_initializer(weight)
    model = ir.Model(graph, ir_version=10)
    FoldWeightLayoutPass()(model)
    (folded,) = [v for v in graph.initializers.values() if v.name != "W"]
    assert folded.shape == ir.Shape([3, 2])
    with pytest.raises(OSError):
        folded.const_value.numpy()
