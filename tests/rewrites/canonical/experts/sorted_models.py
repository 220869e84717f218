"""Hand-written grouped_mm (sorted rows) experts blocks for the sorted-experts pass tests.

:func:`build_block` writes ``y = x + moe(x)`` with the experts in the exported grouped_mm form
(argsort TopK of the routed ids, token rows gathered in sorted order, a Less/ReduceSum histogram
and CumSum segment ends, one MatMul per expert segment, Concat, un-sort) in the spellings a
:class:`BlockSpec` picks; every weight comes from a seeded generator. Split out of
``test_sorted_experts.py`` so that the tests stay readable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["BlockSpec", "build_block"]


@dataclass(frozen=True)
class BlockSpec:
    """One hand-written grouped_mm block; every random tensor comes from ``seed``."""

    experts: int = 4
    k: int = 2
    hidden: int = 8
    inner: int = 6
    activation: str = "swiglu"  # swiglu (Split of FC1), relu, gelu_tanh, bias_relu
    transposed: bool = False  # stacked weights [E, N, K], each used through Transpose
    floor_div: str = "torch"  # torch's Div/Mod/And spelling, or a plain integer Div
    unsort: str = "gathernd"  # gathernd / gather (ScatterElements inverse) / scatter_rows
    weight_first: bool = True  # routing weights applied before the un-sort
    bias: bool = False  # per-expert biases, added as Gather(bias, sorted ids)
    seed: int = 0


class _Graph:
    """Nodes and initializers of a hand-written graph, with generated value names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def const(self, array) -> str:
        self.count += 1
        name = f"c{self.count}"
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int = 1, **attrs) -> list[str]:
        self.count += 1
        names = [f"{op_type.lower()}{self.count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, **attrs))
        return names

    def one(self, op_type: str, inputs: list[str], **attrs) -> str:
        return self.op(op_type, inputs, **attrs)[0]


def _unsqueeze_last(g: _Graph, v: str) -> str:
    return g.one("Unsqueeze", [v, g.const(np.array([-1]))])


def build_block(spec: BlockSpec) -> onnx.ModelProto:
    """``y = x + moe(x)`` with the experts in the grouped_mm (sorted rows) form."""
    rng = np.random.default_rng(spec.seed)
    e, k, h, i = spec.experts, spec.k, spec.hidden, spec.inner
    n1 = 2 * i if spec.activation == "swiglu" else i
    g = _Graph()
    logits = g.one("MatMul", ["x", g.const(rng.standard_normal((h, e), dtype=np.float32))])
    probs = g.one("Softmax", [logits], axis=-1)
    vals, ids = g.op("TopK", [probs, g.const(np.array([k]))], 2, axis=-1)
    weights = g.one("Div", [vals, g.one("ReduceSum", [vals, g.const(np.array([-1]))])])
    flat = g.one("Reshape", [ids, g.const(np.array([-1]))])
    n = g.one(
        "Reshape",
        [g.one("Gather", [g.one("Shape", [flat]), g.const(np.array(-1))]), g.const(np.array([1]))],
    )
    sorted_ids, perm = g.op("TopK", [flat, n], 2, axis=-1, largest=0, sorted=1)
    kc = g.const(np.array(k))
    quotient = g.one("Div", [perm, kc])
    if spec.floor_div == "torch":
        negative = g.one(
            "Equal", [g.one("Less", [perm, g.const(np.array(0))]), g.const(np.array(True))]
        )
        inexact = g.one("Cast", [g.one("Mod", [perm, kc], fmod=0)], to=TensorProto.BOOL)
        fix = g.one("Cast", [g.one("And", [negative, inexact])], to=TensorProto.INT64)
        quotient = g.one("Sub", [quotient, fix])
    rows = g.one("GatherND", ["x", _unsqueeze_last(g, quotient)])
    # torch.histc(ids, bins=E, min=0, max=E-1) as the exporter writes it.
    f = g.one("Cast", [sorted_ids], to=TensorProto.FLOAT)
    ok = g.one(
        "And",
        [
            g.one("GreaterOrEqual", [f, g.const(np.float32(0))]),
            g.one("LessOrEqual", [f, g.const(np.float32(e - 1))]),
        ],
    )
    ok = g.one("And", [ok, g.one("Not", [g.one("IsNaN", [f])])])
    v = g.one("Where", [ok, f, g.const(np.float32(-1))])
    edges = np.linspace(0, e - 1, e + 1, dtype=np.float32)
    edges[-1] = np.nextafter(edges[-1], np.float32(np.inf))
    below = g.one(
        "Less", [g.one("Unsqueeze", [v, g.const(np.array([0]))]), g.const(edges[:, None])]
    )
    cnt = g.one(
        "ReduceSum",
        [g.one("Cast", [below], to=TensorProto.FLOAT), g.const(np.array([1]))],
        keepdims=0,
    )
    hi = g.one(
        "Slice", [cnt, g.const(np.array([1])), g.const(np.array([e + 1])), g.const(np.array([0]))]
    )
    lo = g.one(
        "Slice", [cnt, g.const(np.array([0])), g.const(np.array([-1])), g.const(np.array([0]))]
    )
    counts = g.one("Cast", [g.one("Sub", [hi, lo])], to=TensorProto.INT32)
    ends = g.one("Cast", [g.one("CumSum", [counts, g.const(np.array(0))])], to=TensorProto.INT64)
    zero, one, axis0 = g.const(np.array(0)), g.const(np.array(1)), g.const(np.array([0]))
    scalars = [
        g.one("Squeeze", [p, axis0]) for p in g.op("Split", [ends], e, axis=0, num_outputs=e)
    ]
    segments = [
        g.one("Range", [zero if j == 0 else scalars[j - 1], scalars[j], one]) for j in range(e)
    ]

    def grouped(lhs: str, stack: np.ndarray) -> str:
        n_out = stack.shape[2]
        if spec.transposed:
            stack = np.ascontiguousarray(stack.transpose(0, 2, 1))
        parts = g.op("Split", [g.const(stack)], e, axis=0, num_outputs=e)
        outs = []
        for j, part in enumerate(parts):
            w = g.one("Squeeze", [part, axis0])
            if spec.transposed:
                w = g.one("Transpose", [w], perm=[1, 0])
            outs.append(g.one("MatMul", [g.one("Gather", [lhs, segments[j]], axis=0), w]))
        out = g.one("Concat", outs, axis=0)
        if spec.bias:
            bias = rng.standard_normal((e, n_out), dtype=np.float32)
            out = g.one("Add", [out, g.one("Gather", [g.const(bias), sorted_ids], axis=0)])
        return out

    fc1 = grouped(rows, rng.standard_normal((e, h, n1), dtype=np.float32) * 0.5)
    if spec.activation == "swiglu":
        gate, up = g.op("Split", [fc1], 2, axis=1, num_outputs=2)
        act = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])
    elif spec.activation == "gelu_tanh":
        act = g.one("Gelu", [fc1], approximate="tanh")
    elif spec.activation == "bias_relu":
        act = g.one(
            "Relu", [g.one("Add", [fc1, g.const(rng.standard_normal((1, n1), dtype=np.float32))])]
        )
    else:
        act = g.one("Relu", [fc1])
    out = grouped(act, rng.standard_normal((e, i, h), dtype=np.float32) * 0.5)

    flat_w = g.one("Reshape", [weights, g.const(np.array([-1]))])
    if spec.weight_first:
        sorted_w = g.one("GatherND", [flat_w, _unsqueeze_last(g, perm)])
        out = g.one("Mul", [out, g.one("Unsqueeze", [sorted_w, g.const(np.array([-1]))])])
    if spec.unsort == "scatter_rows":
        blank = g.one("Expand", [g.const(np.float32(0)), g.one("Shape", [out])])
        out = g.one("ScatterND", [blank, _unsqueeze_last(g, perm), out])
    else:
        count = g.one("Squeeze", [g.one("Shape", [perm]), axis0])
        arange = g.one("Range", [zero, count, one])
        blank = g.one("Expand", [zero, g.one("Shape", [perm])])
        if spec.unsort == "gather":
            inverse = g.one("ScatterElements", [blank, perm, arange], axis=0)
            out = g.one("Gather", [out, inverse], axis=0)
        else:
            inverse = g.one("ScatterND", [blank, _unsqueeze_last(g, perm), arange])
            out = g.one("GatherND", [out, _unsqueeze_last(g, inverse)])
    if not spec.weight_first:
        out = g.one("Mul", [out, g.one("Unsqueeze", [flat_w, g.const(np.array([-1]))])])
    slots = g.one("Reshape", [out, g.const(np.array([-1, k, h]))])
    g.nodes.append(
        helper.make_node("ReduceSum", [slots, g.const(np.array([1]))], ["moe_out"], keepdims=0)
    )
    g.nodes.append(helper.make_node("Add", ["x", "moe_out"], ["y"]))
    graph = helper.make_graph(
        g.nodes,
        "sorted_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", h])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", h])],
        g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)
