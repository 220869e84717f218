"""FoldWeightLayoutPass, rule 1: layout ops on constant weights fold (rule 2: ``test_fold_weight_dq.py``).

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
import onnx_ir as ir
import pytest
from fold_weight_models import (
    FLOAT_CASES,
    OPSET,
    assert_dq_of_constants_feeds,
    assert_unchanged,
    dq_inputs,
    dq_node,
    fold,
    initializer_names,
    model,
    node,
    ops,
    quantized,
    run,
    tensor,
    weights,
)
from onnx import TensorProto, helper

from onnx_moe_fuse.rewrites.canonical.weights.fold_weight_layout import FoldWeightLayoutPass


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


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_float32_weights_cast_to_float16_fold_to_the_casts_values(rng):
    """A mixed-precision export's float32 weight cast down to the float16 layer: folded.

    The folded constant is exactly what ORT's Cast computes (numpy rounds as it does: to
    nearest even, overflow to inf; run here through an Identity, halfway values and overflow
    included). The models then agree within one float16 ulp, not bit for bit: ORT CPU computes
    the original's float16 ``Mul`` in float32 behind casts it inserts and drops the Cast's
    rounding on the way (measured: ``x * Cast(70000.0)`` comes out finite there, and products
    of ordinary weights differ by an ulp), while the folded weight is the Cast's value.
    """
    w = weights(rng, (3, 4))
    f16 = np.float16(1.0)
    w[0, :3] = [
        (float(f16) + float(np.nextafter(f16, np.float16(2)))) / 2,  # halfway: rounds to even
        70000.0,  # overflows float16: inf, as ORT's Cast
        65519.0,  # rounds down to the largest float16
    ]
    cast = [helper.make_node("Cast", ["W"], ["w"], to=TensorProto.FLOAT16)]
    ident = model(
        [*cast, helper.make_node("Identity", ["w"], ["w_out"])],
        [tensor("W", w)],
        [1],
        x_dtype=TensorProto.FLOAT16,
    )
    ident.graph.output.append(helper.make_tensor_value_info("w_out", TensorProto.FLOAT16, None))
    ort_cast = run(ident, {"x": np.ones((1,), np.float16)})[1]
    work = ir.serde.deserialize_model(
        model(cast, [tensor("W", w)], [3, 4], x_dtype=TensorProto.FLOAT16)
    )
    assert FoldWeightLayoutPass()(work).modified
    folded = ir.serde.serialize_model(work)
    assert ops(folded) == Counter({"Mul": 1})
    value = dict(work.graph.initializers)["w"].const_value
    assert value.dtype == ir.DataType.FLOAT16
    np.testing.assert_array_equal(value.numpy(), ort_cast)
    np.testing.assert_array_equal(value.numpy(), w.astype(np.float16))
    x = weights(rng, (3, 4), np.float16)
    (want,) = run(model(cast, [tensor("W", w)], [3, 4], x_dtype=TensorProto.FLOAT16), {"x": x})
    (got,) = run(folded, {"x": x})
    # ORT runs the original's Cast + float16 Mul with its inserted float32 casts, the Cast's
    # rounding dropped (measured: 70000 stays 70000 there, the product finite), so compare
    # where the float16 weight is finite, within one float16 ulp
    finite = np.isfinite(w.astype(np.float16)) & np.isfinite(want)
    ulp = np.spacing(np.abs(want[finite]).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(got[finite].astype(np.float64) - want[finite]) <= ulp)
    assert np.all(np.isinf(got[~np.isfinite(w.astype(np.float16))]))  # ONNX's Cast: inf


def test_float32_weights_cast_to_bfloat16_fold():
    """The same for bfloat16 (ORT 1.32 CPU's Cast measured bit-identical to ml_dtypes')."""
    import ml_dtypes

    from onnx_moe_fuse.rewrites.canonical.weights.layout_ops import exact_cast_target

    cast = ir.node("Cast", [ir.Value(name="w")], {"to": int(ir.DataType.BFLOAT16)})
    assert exact_cast_target(cast, ir.DataType.FLOAT) == ir.DataType.BFLOAT16
    assert exact_cast_target(cast, ir.DataType.DOUBLE) is None  # not measured: left alone
    assert ml_dtypes.bfloat16  # the dtype numpy folds it with


@pytest.mark.parametrize(
    ("source", "target"),
    [(TensorProto.DOUBLE, TensorProto.FLOAT), (TensorProto.FLOAT, TensorProto.INT32)],
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
