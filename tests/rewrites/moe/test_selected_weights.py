"""The proofs behind the router-agnostic routing: token rows, per-slot weights, non-negativity.

Each graph is a small router written with onnx.helper; the proofs run on its onnx-ir form. A
proof passes silently or raises a ``Refusal`` of part ``routing`` naming the node that departs.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.graph.token_rows import prove_token_rows
from onnx_moe_fuse.rewrites.moe.selected_weights import nonnegative, prove_selected_weights

H, E, K = 8, 6, 2


def _model(nodes: list, inits: dict[str, np.ndarray], rank: int = 2) -> ir.Model:
    shape = ["T", H] if rank == 2 else ["B", "S", H]
    tensors = [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()]
    tensors.append(numpy_helper.from_array(np.full((H, E), 0.1, np.float32), "W"))
    tensors.append(numpy_helper.from_array(np.array([K], np.int64), "k"))
    graph = helper.make_graph(
        nodes,
        "router",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("w", TensorProto.FLOAT, None)],
        initializer=tensors,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model = onnx.shape_inference.infer_shapes(model)
    return ir.serde.deserialize_model(model)


def _values(model: ir.Model) -> dict[str, ir.Value]:
    out = {v.name: v for v in model.graph.inputs}
    for node in model.graph:
        out.update((v.name, v) for v in node.outputs)
    return out


def _topk(model: ir.Model, name: str = "sel") -> ir.Node:
    return next(n for n in model.graph if n.op_type == "TopK" and n.name == name)


ROUTER = [helper.make_node("MatMul", ["x", "W"], ["logits"])]
SELECT = [helper.make_node("TopK", ["scores", "k"], ["vals", "idx"], name="sel")]


def _prove_weights(nodes: list, inits: dict | None = None, rank: int = 2) -> None:
    model = _model(ROUTER + nodes, inits or {}, rank)
    v = _values(model)
    prove_selected_weights(v["w"], _topk(model), v["x"], rank - 1)


def test_sigmoid_topk_renormalised_and_scaled_is_per_selected() -> None:
    _prove_weights(
        [
            helper.make_node("Sigmoid", ["logits"], ["scores"]),
            *SELECT,
            helper.make_node("ReduceSum", ["vals", "ax"], ["total"], keepdims=1),
            helper.make_node("Div", ["vals", "total"], ["norm"]),
            helper.make_node("Mul", ["norm", "factor"], ["w"]),
        ],
        {"ax": np.array([-1], np.int64), "factor": np.array(2.5, np.float32)},
    )


def test_weights_gathered_at_the_selection_from_unbiased_scores() -> None:
    _prove_weights(
        [
            helper.make_node("Sigmoid", ["logits"], ["probs"]),
            helper.make_node("Add", ["probs", "bias"], ["scores"]),
            *SELECT,
            helper.make_node("GatherElements", ["probs", "idx"], ["w"], axis=1),
        ],
        {"bias": np.linspace(-0.1, 0.1, E).astype(np.float32)},
    )


def test_rank3_tokens_flattened_before_the_router() -> None:
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["x2"]),
        helper.make_node("MatMul", ["x2", "W"], ["logits2"]),
        helper.make_node("Softmax", ["logits2"], ["scores"], axis=-1),
        *SELECT,
        helper.make_node("Identity", ["vals"], ["w"]),
    ]
    model = _model(nodes, {"flat": np.array([-1, H], np.int64)}, rank=3)
    v = _values(model)
    prove_selected_weights(v["w"], _topk(model), v["x"], 1)


@pytest.mark.parametrize(
    "nodes, inits, words",
    [
        (  # weights gathered at the experts of another TopK
            [
                helper.make_node("Sigmoid", ["logits"], ["scores"]),
                *SELECT,
                helper.make_node("Neg", ["scores"], ["other"]),
                helper.make_node("TopK", ["other", "k"], ["ov", "oidx"], name="other"),
                helper.make_node("GatherElements", ["scores", "oidx"], ["w"], axis=1),
            ],
            {},
            "not at the experts",
        ),
        (  # a Softmax over the tokens
            [
                helper.make_node("Softmax", ["logits"], ["scores"], axis=0),
                *SELECT,
                helper.make_node("Identity", ["vals"], ["w"]),
            ],
            {},
            "token axis",
        ),
        (  # raw logits may be negative
            [
                helper.make_node("Identity", ["logits"], ["scores"]),
                *SELECT,
                helper.make_node("Identity", ["vals"], ["w"]),
            ],
            {},
            "negative",
        ),  # fmt: skip
        (  # the values of the selection minus a constant
            [
                helper.make_node("Sigmoid", ["logits"], ["scores"]),
                *SELECT,
                helper.make_node("Sub", ["vals", "half"], ["w"]),
            ],
            {"half": np.array(0.5, np.float32)},
            "negative",
        ),
        (  # a factor per token from its position among the tokens (a CumSum over them)
            [
                helper.make_node("Softmax", ["logits"], ["scores"], axis=-1),
                *SELECT,
                helper.make_node("CumSum", ["scores", "zero"], ["running"]),
                helper.make_node("GatherElements", ["running", "idx"], ["w"], axis=1),
            ],
            {"zero": np.array(0, np.int64)},
            "token axis",
        ),
    ],
    ids=["other_experts", "softmax_over_tokens", "raw_logits", "minus_half", "cumsum_tokens"],
)
def test_traps_are_refused_naming_the_node(nodes: list, inits: dict, words: str) -> None:
    with pytest.raises(Refusal) as refused:
        _prove_weights(nodes, inits)
    assert refused.value.part == "routing"
    assert words in refused.value.reason, refused.value.reason
    assert refused.value.node is not None or refused.value.value is not None


def test_router_reading_another_input_is_refused() -> None:
    nodes = [
        helper.make_node("Softmax", ["logits"], ["scores"], axis=-1),
        helper.make_node("TopK", ["scores", "k"], ["vals", "idx"], name="sel"),
    ]
    model = _model(ROUTER + nodes, {})
    other = ir.Value(name="y")
    with pytest.raises(Refusal, match="not the token rows"):
        prove_token_rows(_values(model)["scores"], other, 1, "the selection")


@pytest.mark.parametrize(
    "node, inits, want",
    [
        (helper.make_node("Sigmoid", ["logits"], ["w"]), {}, True),
        (helper.make_node("Relu", ["logits"], ["w"]), {}, True),
        (helper.make_node("Clip", ["logits", "zero"], ["w"]), {"zero": np.float32(0)}, True),
        (helper.make_node("Clip", ["logits", "neg"], ["w"]), {"neg": np.float32(-1)}, False),
        (helper.make_node("Identity", ["logits"], ["w"]), {}, False),
        (helper.make_node("Max", ["logits", "zero"], ["w"]), {"zero": np.float32(0)}, True),
    ],
    ids=["sigmoid", "relu", "clip0", "clip-1", "identity", "max0"],
)
def test_nonnegative(node, inits: dict, want: bool) -> None:
    model = _model([*ROUTER, node], inits)
    assert nonnegative(_values(model)["w"]) is want


def _mixer(first_at: str, second_at: str) -> list:
    """PhiMoE-style rounds: r0 = TopK(logits, 1), r1 = TopK of logits with r0 at -inf.

    The selection ``sel`` is TopK(logits, 2) (what the spelling pass makes of the rounds); the
    weights are softmaxes gathered at ``first_at`` / ``second_at``, concatenated.
    """
    return [
        helper.make_node("TopK", ["logits", "one"], ["v0", "r0"], name="round0"),
        helper.make_node("Shape", ["r0"], ["r0_shape"]),
        helper.make_node(
            "ConstantOfShape",
            ["r0_shape"],
            ["minus_inf"],
            value=numpy_helper.from_array(np.array([-np.inf], np.float32)),
        ),
        helper.make_node("ScatterElements", ["logits", "r0", "minus_inf"], ["masked"], axis=-1),
        helper.make_node("TopK", ["masked", "one"], ["v1", "r1"], name="round1"),
        helper.make_node("Softmax", ["logits"], ["p0"], axis=-1),
        helper.make_node("Softmax", ["masked"], ["p1"], axis=-1),
        helper.make_node("GatherElements", ["p0", first_at], ["w0"], axis=-1),
        helper.make_node("GatherElements", ["p1", second_at], ["w1"], axis=-1),
        helper.make_node("Concat", ["w0", "w1"], ["w"], axis=-1),
        helper.make_node("TopK", ["logits", "k"], ["vals", "idx"], name="sel"),
    ]


def test_top1_rounds_gathered_at_their_own_column_are_per_selected() -> None:
    _prove_weights(_mixer("r0", "r1"), {"one": np.array([1], np.int64)})


def test_top1_rounds_gathered_at_each_others_column_are_refused() -> None:
    with pytest.raises(Refusal, match="not at the experts"):
        _prove_weights(_mixer("r1", "r0"), {"one": np.array([1], np.int64)})


def _group_limited(group_rows: list) -> list:
    """DeepSeek-V2's group-limited top-k as dynamo exports it at a dynamic token count.

    The group mask ``[T, G]`` is a scatter into ``zeros_like``, unsqueezed to ``[T, G, 1]`` and
    expanded to ``[T, G, E/G]`` by a target computed from ``Shape(x)[0] * Shape(x)[1]``; the
    declared shapes do not relate the two row counts. ``group_rows`` makes the ``[*, G]`` group
    scores the mask is built from.
    """
    return [
        helper.make_node("Reshape", ["x", "flat"], ["x2"]),
        helper.make_node("MatMul", ["x2", "W"], ["logits2"]),
        helper.make_node("Softmax", ["logits2"], ["scores"], axis=-1),
        helper.make_node("Reshape", ["scores", "grouped_shape"], ["grouped"]),
        *group_rows,
        helper.make_node("TopK", ["group_scores", "one"], ["_", "group_idx"]),
        helper.make_node("Shape", ["group_scores"], ["group_shape"]),
        helper.make_node("Expand", ["zero_f", "group_shape"], ["zeros_like"]),
        helper.make_node("Shape", ["group_idx"], ["idx_shape"]),
        helper.make_node("ConstantOfShape", ["idx_shape"], ["ones"], value=_ONE),
        helper.make_node("ScatterElements", ["zeros_like", "group_idx", "ones"], ["gmask"], axis=1),
        helper.make_node("Unsqueeze", ["gmask", "minus_one"], ["gmask3"]),
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Gather", ["x_shape", "zero_i"], ["batch"], axis=0),
        helper.make_node("Gather", ["x_shape", "one_i"], ["seq"], axis=0),
        helper.make_node("Mul", ["batch", "seq"], ["rows"]),
        helper.make_node("Unsqueeze", ["rows", "zero"], ["rows1"]),
        helper.make_node("Concat", ["rows1", "group_tail"], ["mask_target"], axis=0),
        helper.make_node("Expand", ["gmask3", "mask_target"], ["mask_e"], name="mask_expand"),
        helper.make_node("Reshape", ["mask_e", "flat_e"], ["mask"]),
        helper.make_node("Cast", ["mask"], ["keep"], to=TensorProto.BOOL),
        helper.make_node("Not", ["keep"], ["drop"]),
        helper.make_node("Where", ["drop", "zero_f", "scores"], ["masked"]),
        helper.make_node("TopK", ["masked", "k"], ["vals", "idx"], name="sel"),
        helper.make_node("Identity", ["vals"], ["w"]),
    ]


_ONE = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
GROUPS = 3
_GROUP_INITS = {
    "flat": np.array([-1, H], np.int64),
    "grouped_shape": np.array([-1, GROUPS, E // GROUPS], np.int64),
    "group_tail": np.array([GROUPS, E // GROUPS], np.int64),
    "flat_e": np.array([-1, E], np.int64),
    "one": np.array([1], np.int64),
    "zero": np.array([0], np.int64),
    "minus_one": np.array([-1], np.int64),
    "zero_i": np.array(0, np.int64),
    "one_i": np.array(1, np.int64),
    "zero_f": np.array(0.0, np.float32),
}


def test_group_mask_expanded_to_a_computed_row_count_keeps_the_rows() -> None:
    rows = [helper.make_node("ReduceMax", ["grouped", "minus_one"], ["group_scores"], keepdims=0)]
    model = _model(_group_limited(rows), dict(_GROUP_INITS), rank=3)
    v = _values(model)
    prove_selected_weights(v["w"], _topk(model), v["x"], 1)


def test_group_mask_of_one_row_for_every_token_is_refused_at_the_expand() -> None:
    # the group scores of all tokens at once ([1, G]): every row gets the same mask
    rows = [
        helper.make_node("ReduceMax", ["grouped", "minus_one"], ["per_row"], keepdims=0),
        helper.make_node("ReduceMax", ["per_row", "zero"], ["group_scores"], keepdims=1),
    ]
    model = _model(_group_limited(rows), dict(_GROUP_INITS), rank=3)
    v = _values(model)
    with pytest.raises(Refusal) as refused:
        prove_selected_weights(v["w"], _topk(model), v["x"], 1)
    assert refused.value.part == "routing"
    assert "'mask_expand' regroups the token rows" in refused.value.reason, refused.value.reason
