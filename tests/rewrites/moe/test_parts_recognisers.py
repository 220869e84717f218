"""Each part recogniser alone (rewrites/parts): the fact it returns, the failure it names.

Layers come from the spelling generator (``tests/spellings/build.py``, one spelling per part)
and are canonicalised as the pipeline does; each test calls one recogniser at the node or value
where its part ends and checks the fact (form, family, layout, the values it hands on), or that
a broken part raises a :class:`Refusal` naming that part and the node at fault.
"""

from __future__ import annotations

from dataclasses import replace

import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from onnxscript.rewriter._basics import MatchFailureError, MatchResult
from spellings.build import build_case
from spellings.strategies import SMALL_BASE

from onnx_moe_fuse.pipeline.canonicalise import canonicalise
from onnx_moe_fuse.rewrites.graph.refusals import NearMiss, Refusal, part, refusal_of
from onnx_moe_fuse.rewrites.moe.analysis import expert_weights
from onnx_moe_fuse.rewrites.moe.parts.activation import recognise_activation
from onnx_moe_fuse.rewrites.moe.parts.combine import recognise_combine
from onnx_moe_fuse.rewrites.moe.parts.layer import recognise_layer
from onnx_moe_fuse.rewrites.moe.parts.projections import (
    recognise_fc2,
    recognise_projection,
    recognise_token_rows,
)
from onnx_moe_fuse.rewrites.moe.parts.routing import recognise_routing

BASE = SMALL_BASE


def layer(**changes) -> ir.Model:
    """The canonicalised working copy of a generated layer (input ``x``, output ``y``)."""
    model = ir.from_proto(build_case(replace(BASE, **changes)).model)
    canonicalise(model)
    return model


def root(model: ir.Model) -> ir.Node:
    """The node computing the layer output ``y`` (the combine's last node)."""
    node = model.graph.outputs[0].producer()
    assert node is not None
    return node


def named(model: ir.Model, value: str) -> ir.Value:
    for node in model.graph:
        for out in node.outputs:
            if out.name == value:
                return out
    raise KeyError(value)


# -- combine -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("experts", "combine", "form"),
    [
        ("gather_expand", "mul_reducesum", "reduce_sum"),
        ("gather_expand", "matmul_row", "matmul_squeeze"),
        ("gather_expand", "einsum", "matmul_squeeze"),  # canonicalised to MatMul + Squeeze
        ("rows_gathernd", "mul_reducesum", "reshape_reduce_sum"),
        ("rows_gathernd", "matmul_row", "matmul_squeeze"),
    ],
)
def test_combine_form_and_what_it_hands_on(experts: str, combine: str, form: str) -> None:
    model = layer(experts=experts, combine=combine)
    fact = recognise_combine(root(model))
    assert fact.form == form
    assert fact.root is root(model)
    assert fact.weights.name == "routing_weights"
    assert fact.reads_rows == (form == "reshape_reduce_sum")
    assert root(model) in fact.nodes


def test_combine_failure_names_the_node() -> None:
    model = layer()
    topk = next(n for n in model.graph if n.op_type == "TopK")
    with pytest.raises(Refusal) as info:
        recognise_combine(topk)
    assert info.value.part == "combine"
    assert info.value.node is topk
    assert info.value.message().startswith("combine: TopK")


# -- routing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("routing", "form"),
    [
        ("softmax_topk_div", "renorm_div"),
        ("softmax_topk_reciprocal", "renorm_div"),  # canonicalised Reciprocal + Mul -> Div
        ("topk_softmax", "softmax_k"),
        ("softmax_topk_raw", "as_is"),
    ],
)
def test_routing_form_back_to_the_topk(routing: str, form: str) -> None:
    model = layer(routing=routing)
    weights = recognise_combine(root(model)).weights
    fact = recognise_routing(weights)
    assert fact.form == form
    assert fact.topk.op_type == "TopK"
    assert fact.indices is fact.topk.outputs[1]
    assert fact.bindings["weight_form"] == form
    assert fact.bindings["topk_values"] is fact.topk.outputs[0]


def test_routing_mul_reciprocal_without_canonicalisation() -> None:
    model = ir.from_proto(build_case(replace(BASE, routing="softmax_topk_reciprocal")).model)
    fact = recognise_routing(named(model, "routing_weights"))
    assert fact.form == "renorm_reciprocal"


def test_routing_failure_names_the_weights() -> None:
    model = layer()
    x = model.graph.inputs[0]
    with pytest.raises(Refusal) as info:
        recognise_routing(x)
    assert info.value.part == "routing"
    assert info.value.value is x
    assert "not the values of a TopK" in info.value.reason


def test_routing_by_the_topk_indices_is_refused() -> None:
    model = layer()
    topk = next(n for n in model.graph if n.op_type == "TopK")
    with pytest.raises(Refusal) as info:
        recognise_routing(topk.outputs[1])
    assert info.value.part == "routing"
    assert "indices" in info.value.reason


# -- projections ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("experts", "combine", "layout", "glue"),
    [
        ("gather_expand", "mul_reducesum", "slots", False),
        ("gather_reshape", "mul_reducesum", "slots", False),
        ("rows_gathernd", "mul_reducesum", "rows", False),
        ("rows_gathernd", "matmul_row", "rows", True),  # rows un-flattened into slots
    ],
)
def test_fc2_layout(experts: str, combine: str, layout: str, glue: bool) -> None:
    model = layer(experts=experts, combine=combine)
    combine_fact = recognise_combine(root(model))
    fc2, extra, nodes = recognise_fc2(combine_fact.expert_out, combine_fact.reads_rows)
    assert fc2.layout == layout
    assert fc2.tag == "fc2"
    assert fc2.input.name == "act"
    assert fc2.weight is not None and fc2.weight.name.startswith("fc2_weight")
    assert ("fc2_slots" in extra) == glue and bool(nodes) == glue


def test_fc1_projection_of_the_tokens() -> None:
    model = layer()
    gate = recognise_projection(named(model, "fc1_gate_out"), "fc1_gate", "tokens", "fc1")
    assert gate.spelling == "gather_matmul"
    assert gate.input is model.graph.inputs[0]
    assert gate.indices is next(n for n in model.graph if n.op_type == "TopK").outputs[1]
    assert "fc1_gate_expand" in gate.bindings


def test_projection_failure_names_the_part_and_node() -> None:
    model = layer()
    sigmoid = next(n for n in model.graph if n.op_type == "Sigmoid")
    with pytest.raises(Refusal) as info:
        recognise_projection(sigmoid.outputs[0], "fc2", "slots", "fc2")
    assert info.value.part == "fc2"
    assert info.value.node is sigmoid
    assert "not a projection of the per-slot activations" in info.value.reason


def test_token_rows_of_flattened_layers() -> None:
    for k in (2, 1):  # k = 1: canonicalisation drops the no-op repeat
        model = layer(experts="rows_gathernd", top_k=k)
        tokens, bindings, nodes = recognise_token_rows(named(model, "rows"))
        assert tokens is model.graph.inputs[0]
        assert ("token_repeat" in bindings) == (k > 1)
        assert bindings["token_rows"].name == "rows" and nodes


def test_token_rows_failure() -> None:
    model = layer(experts="rows_gathernd")
    with pytest.raises(Refusal) as info:
        recognise_token_rows(model.graph.inputs[0])
    assert info.value.part == "fc1"
    assert "repeated over the k slots" in info.value.reason


# -- activation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("activation", "family", "kind", "operands"),
    [
        ("swiglu_separate", "gated", "swiglu", ("fc1_gate_out", "fc1_up_out")),
        ("swiglu_split", "fused_gated", "swiglu", ("fc1_out",)),
        ("swiglu_strided", "fused_gated", "swiglu", ("fc1_out",)),
        ("swiglu_oss", "fused_gated", "swiglu", ("fc1_out",)),
        ("relu", "elementwise", "relu", ("fc1_out",)),
        ("gelu_tanh", "elementwise", "gelu", ("fc1_out",)),
        ("silu_sigmoid_x", "elementwise", "silu_mul_r", ("fc1_out",)),
    ],
)
def test_activation_family(activation: str, family: str, kind: str, operands: tuple) -> None:
    model = layer(activation=activation)
    fact = recognise_activation(named(model, "act"))
    assert (fact.family, fact.kind) == (family, kind)
    assert tuple(v.name for v in fact.fc1_outputs) == operands
    assert fact.bindings["act"] is fact.output


def test_a_biased_up_projection_is_the_linear_operand_not_an_offset() -> None:
    # up + its gathered bias: the shifted spelling would read the bias as beta (not a constant)
    model = layer(bias="after_reshape")
    fact = recognise_activation(named(model, "act"))
    assert (fact.family, fact.kind) == ("gated", "swiglu")
    assert fact.bindings["beta_form"] == "plain"
    up = fact.bindings["fc1_up_out"]
    assert up.name == "fc1_up_biased" and up.producer().op_type == "Add"


def test_a_constant_offset_stays_beta() -> None:
    model = layer(activation="swiglu_oss")
    fact = recognise_activation(named(model, "act"))
    assert fact.bindings["beta_form"] == "shifted"
    assert fact.bindings["swiglu_beta"].const_value is not None


def test_exact_gelu_is_recognised_for_the_proof_to_refuse() -> None:
    model = layer(activation="gelu_tanh", mutation="erf_gelu")
    assert recognise_activation(named(model, "act")).kind == "erf_gelu"


@pytest.mark.parametrize("activation", ["swiglu_separate", "swiglu_oss"])
def test_swapped_gate_and_up_names_the_sigmoid(activation: str) -> None:
    model = layer(activation=activation, mutation="swap_gate_up")
    with pytest.raises(Refusal) as info:
        recognise_activation(named(model, "act"))
    assert info.value.part == "activation"
    assert info.value.node is not None and info.value.node.op_type == "Sigmoid"
    assert "gate and up may be swapped" in info.value.reason


def test_activation_failure_for_an_unknown_op() -> None:
    model = layer()
    x = model.graph.inputs[0]
    with pytest.raises(Refusal) as info:
        recognise_activation(x)
    assert info.value.part == "activation"
    assert "graph input" in info.value.reason


# -- the layer -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "family", "layout", "fc1_tags"),
    [
        ({}, "gated", "slots", ("fc1_gate", "fc1_up")),
        (
            {"activation": "swiglu_slice", "rank": 3, "token_dims": (2, 3)},
            "fused_gated",
            "slots",
            ("fc1",),
        ),
        (
            {"experts": "rows_gathernd", "activation": "relu", "combine": "matmul_row"},
            "elementwise",
            "rows",
            ("fc1",),
        ),
        ({"experts": "rows_gathernd", "top_k": 1}, "gated", "rows", ("fc1_gate", "fc1_up")),
    ],
)
def test_layer_parts_compose(changes: dict, family: str, layout: str, fc1_tags: tuple) -> None:
    model = layer(**changes)
    parts = recognise_layer(root(model))
    assert (parts.family, parts.layout) == (family, layout)
    assert tuple(p.tag for p in parts.fc1) == fc1_tags
    assert parts.tokens is model.graph.inputs[0]
    b = parts.bindings
    assert b["tokens"] is parts.tokens and b["layer_out"] is model.graph.outputs[0]
    assert parts.routing.topk in parts.nodes and root(model) in parts.nodes


def test_identity_activation_when_fc2_reads_fc1() -> None:
    """A hand-written identity layer: FC2 reads FC1's projection directly."""
    model = layer(activation="relu")
    relu = next(n for n in model.graph if n.op_type == "Relu")
    relu.outputs[0].replace_all_uses_with(relu.inputs[0])
    model.graph.remove(relu, safe=True)
    parts = recognise_layer(root(model))
    assert (parts.family, parts.activation.kind) == ("elementwise", "identity")


def test_layer_failure_is_the_first_broken_part() -> None:
    model = layer(mutation="swap_gate_up")
    with pytest.raises(Refusal) as info:
        recognise_layer(root(model))
    assert info.value.part == "activation"


def test_half_precision_cast_names_the_dtype() -> None:
    """A float16 layer cast to float32 for the combine: the failure says float16."""
    nodes = [
        helper.make_node("Cast", ["h"], ["y32"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Relu", ["y32"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT16, [4, 2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2, 8])],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    with pytest.raises(Refusal) as info:
        recognise_projection(named(model, "y32"), "fc2", "slots", "fc2")
    assert info.value.part == "target" and "float16" in info.value.reason


# -- the one failure type ------------------------------------------------------------------------


def test_part_tags_failures_and_converts_plain_refusals() -> None:
    model = layer()
    x = model.graph.inputs[0]
    with pytest.raises(Refusal) as info:
        with part("fc2"), part("routing"):
            raise Refusal("inner", x, None)  # an absent source is skipped
    assert info.value.part == "routing"  # the innermost tag wins
    assert info.value.failure_sources == (x,)
    with pytest.raises(Refusal) as info:
        with part("weights"):
            raise Refusal("plain", x)
    assert info.value.part == "weights" and info.value.value is x
    assert info.value.message() == "weights: plain"
    assert info.value.where() == "value 'x'"
    with pytest.raises(Refusal) as info:  # onnxscript's own failure becomes the one type
        with part("fc1"):
            raise MatchFailureError("onnxscript's", x)
    assert type(info.value) is Refusal and info.value.message() == "fc1: onnxscript's"


def test_a_failed_match_carries_its_refusal_and_reads_part_reason() -> None:
    """What a rule's ``check`` returns: onnxscript sees ``"part: reason"``, a tracer the type."""
    model = layer()
    x = model.graph.inputs[0]
    refusal = Refusal("the weights are not constant", x, part="fc1", expected="Gather | GMM")
    result = refusal.fail()
    assert not result and result.reason == "fc1: the weights are not constant"
    assert result.failure_nodes_and_values == [x]
    assert refusal_of(result) is refusal
    assert refusal_of(MatchResult().fail("plain text")) is None
    miss = NearMiss.of(refusal, rule="R", root="root")
    assert miss.to_dict() == {
        "rule": "R",
        "part": "fc1",
        "node": "x",
        "reason": "the weights are not constant",
        "root": "root",
        "topk": None,
        "router": None,
        "values": ["x"],
    }
    assert miss.value == "x" and miss.expected == "Gather | GMM"
    assert list(miss.to_dict()) == [
        "rule",
        "part",
        "node",
        "reason",
        "root",
        "topk",
        "router",
        "values",
    ]


def test_a_kept_refusal_keeps_no_frames() -> None:
    """A tracer keeps every refusal: a kept one must not keep the proof's locals (weights)."""
    x = layer().graph.inputs[0]
    try:
        try:
            raise ValueError("inner")
        except ValueError:
            raise Refusal("outer", x) from None
    except Refusal as caught:
        refusal = caught
    assert refusal.__traceback__ is not None and refusal.__context__ is not None
    refusal_of(refusal.fail())
    assert refusal.__traceback__ is None and refusal.__context__ is None


def test_model_stays_valid_after_recognition() -> None:
    """Recognition only reads the graph."""
    model = layer()
    before = ir.to_proto(model).SerializeToString()
    recognise_layer(root(model))
    assert ir.to_proto(model).SerializeToString() == before
    onnx.checker.check_model(ir.to_proto(model))


def test_weights_through_a_transpose_of_a_graph_input_are_named() -> None:
    """fc2: the reason names the Transpose and the graph input the weights come from."""
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["w2"], ["w2_t"], perm=[0, 2, 1], name="w2_transpose")],
        "g",
        [helper.make_tensor_value_info("w2", TensorProto.FLOAT, [4, 16, 8])],
        [helper.make_tensor_value_info("w2_t", TensorProto.FLOAT, [4, 8, 16])],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    with pytest.raises(Refusal) as info, part("fc2"):
        expert_weights("FC2", named(model, "w2_t"))
    assert info.value.message() == (
        "fc2: FC2 expert weights not constant: they reach the projection through a Transpose "
        "'w2_transpose' of graph input 'w2', so they cannot be repacked into the fused layout at "
        "fusion time"
    )
    assert info.value.node is model.graph.node("w2_transpose")
