"""The router's softmax and the top-k weights' normalisation recognised by behaviour.

A softmax over the experts written out in element-wise ops (with or without the max, ``Div``
or ``Mul(Reciprocal)``) and a renormalisation or softmax over k written any way fuse with the
router inside the fused node (``router_probs`` = the logits); a softmax over another axis, or
off by a constant, is named with the closest candidate.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from activation_layers import Ops, fuse_and_compare, with_region
from onnx import TensorProto, helper

from onnx_moe_fuse import fuse
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.moe.behaviour.routing import softmax_logits, weights_form

ROUTER = ("router_probs", ("router_logits",))
WEIGHTS = ("routing_weights", ("topk_0",))


def _softmax_max(o, x, axis=-1):
    e = o.Exp(o.Sub(x, o.ReduceMax(x, o.i64(axis), keepdims=1)))
    return o.Div(e, o.ReduceSum(e, o.i64(axis), keepdims=1))


def _softmax_plain(o, x):  # no max, Mul(Reciprocal)
    e = o.Exp(x)
    return o.Mul(o.Reciprocal(o.ReduceSum(e, o.i64(1), keepdims=1)), e)


def _softmax_neg_max(o, x):  # exp(x + (-max)), the sum broadcast back with a Div of its inverse
    e = o.Exp(o.Add(o.Neg(o.ReduceMax(x, o.i64(-1), keepdims=1)), x))
    return o.Div(e, o.ReduceSum(e, o.i64(-1), keepdims=1))


def _renorm_reciprocal(o, v):
    return o.Mul(v, o.Reciprocal(o.ReduceSum(v, o.i64(-1), keepdims=1)))


def _renorm_mean(o, v):  # v / (k * mean(v)) with k = 2
    return o.Div(o.Div(v, o.ReduceMean(v, o.i64(-1), keepdims=1)), o.c(2.0))


def _router_input(model) -> str:
    (node,) = [n for n in model.graph.node if n.domain == "com.microsoft"]
    return node.input[1]


@pytest.mark.parametrize(
    ("target", "write", "changes"),
    [
        (ROUTER, _softmax_max, {}),
        (ROUTER, _softmax_plain, {}),
        (ROUTER, _softmax_neg_max, {"rank": 3, "token_dims": (2, 3)}),
        (WEIGHTS, _renorm_reciprocal, {}),
        (WEIGHTS, _renorm_mean, {}),
    ],
    ids=["softmax with max", "softmax without max", "softmax exp(x + -max), rank 3",
         "renorm Mul(Reciprocal)", "renorm by the mean"],
)  # fmt: skip
def test_written_out_router_fuses_with_the_router_inside(target, write, changes) -> None:
    model = with_region(write, target[0], target[1], **changes)
    got = fuse_and_compare(model, scale=2.0)
    assert got.ops == ["MoE"], got.reasons
    assert got.attributes["normalize_routing_weights"] == 1
    assert got.error < 1e-5, got.error
    # the fused node softmaxes the router logits itself (not fed as a selection): the written
    # softmax or normalisation is gone with the layer
    fused = fuse(model).model
    assert not [n for n in fused.graph.node if n.op_type in ("Exp", "Reciprocal", "ReduceMean")]
    if not changes:
        assert _router_input(fused) == "router_logits"


def test_a_softmax_over_the_tokens_is_named() -> None:
    got = fuse_and_compare(with_region(lambda o, x: _softmax_max(o, x, 0), *ROUTER))
    assert got.ops == [] and got.unchanged
    assert any("computes the softmax over the tokens" in r for r in got.reasons), got.reasons


# -- unit level ----------------------------------------------------------------------------------


def _standalone(write, width: int = 6, topk: int | None = None) -> ir.Value:
    o = Ops()
    src = "s"
    if topk is not None:
        src, _ = o.node("TopK", "s", o.i64(topk), outputs=2)
    out = write(o, src)
    o.nodes.append(helper.make_node("Identity", [out], ["y"]))
    graph = helper.make_graph(
        o.nodes, "g", [helper.make_tensor_value_info("s", TensorProto.FLOAT, ["T", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], o.inits,
    )  # fmt: skip
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    return model.graph.outputs[0]


@pytest.mark.parametrize("write", [_softmax_max, _softmax_plain, _softmax_neg_max])
def test_softmax_spellings_give_their_logits(write) -> None:
    scores = _standalone(write)
    logits, region = softmax_logits(scores, 2)
    assert logits.name == "s" and region.nodes


@pytest.mark.parametrize(
    ("write", "closest"),
    [
        (lambda o, x: _softmax_max(o, x, 0), "computes the softmax over the tokens"),
        (lambda o, x: o.Div(o.Exp(x), o.Add(o.ReduceSum(o.Exp(x), o.i64(-1), keepdims=1), o.c(1e-3))), "the closest, the softmax over the experts"),
        (lambda o, x: o.Sigmoid(x), "computes the sigmoid"),
    ],
    ids=["over the tokens", "off by a constant", "sigmoid"],
)  # fmt: skip
def test_softmax_near_misses_name_the_closest(write, closest: str) -> None:
    with pytest.raises(Refusal) as info:
        softmax_logits(_standalone(write), 2)
    assert closest in info.value.reason, info.value.reason


@pytest.mark.parametrize(
    ("write", "form"),
    [
        (_renorm_reciprocal, "renorm"),
        (_renorm_mean, "renorm"),
        (lambda o, v: _softmax_max(o, v), "softmax_k"),
        (lambda o, v: o.Mul(v, o.c(1.0)), "as_is"),
    ],
)
def test_weights_forms(write, form: str) -> None:
    found = weights_form(_standalone(write, topk=2), 2)
    assert found is not None and found[1] == form


def test_weights_near_miss_names_the_closest() -> None:
    eps = lambda o, v: o.Div(v, o.Add(o.ReduceSum(v, o.i64(-1), keepdims=1), o.c(1e-3)))  # noqa: E731
    with pytest.raises(Refusal) as info:
        weights_form(_standalone(eps, topk=3), 2)
    assert "the closest, renorm" in info.value.reason, info.value.reason


def test_logits_probes_stay_where_a_softmax_without_max_is_finite() -> None:
    from onnx_moe_fuse.rewrites.moe.behaviour.routing import logits_probes

    x = logits_probes(8)
    assert np.isfinite(np.exp(x.astype(np.float32))).all() and np.abs(x).max() > 30
