"""What the FoldWeightLayoutPass tests build: small models around one weight, and how they run.

Each test builds ``y = Mul(x, layout(weight))`` (the Mul keeps the folded value off the graph
outputs, as a MoE's Gather would), runs the pass on a clone with :func:`fold`, and compares in
ONNX Runtime CPU (optimisations off) on fresh random inputs; hypothesis strategies draw random
layouts through DequantizeLinear.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
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
