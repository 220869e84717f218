"""Hand-built expert loops (optimum-onnx's loop over all experts) for the expert-loop pass tests.

:func:`build_loop` writes the loop the way torch.onnx exports optimum's patched Qwen3-MoE
forward, in the TorchScript spelling (OneHot mask, Cast to bool, Split + Squeeze coordinates,
``Gather(Unsqueeze(x, 0), t, axis=1)`` rows, the flattened weight gathered at ``s + t * k``,
``ScatterElements`` into zeros + ``Add``) or the dynamo one (Equal/Cast mask, Slice + Squeeze,
GatherND rows and weights, ``ScatterND`` with ``reduction='add'``, ``Transpose``d Linear
weights), with a SwiGLU or Relu expert; ``plain_rows`` reads the rows as ``Gather(x, t_e)``. ``mutation`` breaks one link of the proof (see
:data:`MUTATIONS`). Tokens ``x [T, H]`` are the graph input (T symbolic), ``out`` the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

H, INTER = 16, 8
INT64_MAX = 2**63 - 1

#: Mutations that make the loop something else; each must be refused.
MUTATIONS = (
    "missing_expert",  # the last expert's iteration is not there
    "repeated_expert",  # the last iteration takes the slice of the expert before it
    "shared_weight",  # expert 1 reads expert 0's FC1 weight
    "weight_swapped",  # the routing weight gathered at (s, t) instead of (t, s)
    "rows_by_slots",  # the rows gathered by the slot ids
    "other_topk",  # the mask is built from a second router's TopK
    "nonzero_start",  # the accumulation starts from ones
    "graph_output",  # expert 0's output is also a graph output
    "squeeze_slot_axis",  # Squeeze(axes=[0]) of each [k, T] slice (torch.onnx's no-op squeeze)
)


@dataclass(frozen=True)
class LoopSpec:
    """One hand-built loop."""

    experts: int = 4
    k: int = 2
    spelling: str = "torchscript"  # or "dynamo"
    activation: str = "swiglu"  # or "relu"
    mutation: str | None = None
    seed: int = 0
    plain_rows: bool = False  # rows as Gather(x, t_e) (axis 0, no Reshape)
    biases: bool = False  # every projection a Linear with bias: MatMul + Add of a row [N]


class _G:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0

    def c(self, array, name: str | None = None) -> str:
        self.n += 1
        name = name or f"c{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int = 1, **attrs) -> list[str]:
        self.n += 1
        outs = [f"{op_type.lower()}{self.n}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=f"n{self.n}", **attrs))
        return outs

    def one(self, op_type: str, inputs: list[str], **attrs) -> str:
        return self.op(op_type, inputs, **attrs)[0]


def _router(g: _G, x: str, w_router: np.ndarray, k: int) -> tuple[str, str]:
    probs = g.one("Softmax", [g.one("MatMul", [x, g.c(w_router)])], axis=-1)
    vals, ids = g.op("TopK", [probs, g.c(np.array([k], np.int64))], outputs=2, axis=-1)
    total = g.one("ReduceSum", [vals, g.c(np.array([-1], np.int64))], keepdims=1)
    return g.one("Div", [vals, total]), ids


def _mask(g: _G, ids: str, experts: int, spelling: str) -> str:
    if spelling == "torchscript":
        depth, values = g.c(np.array(experts, np.int64)), g.c(np.array([0, 1], np.int64))
        hot = g.one("OneHot", [ids, depth, values], axis=-1)
    else:
        unsq = g.one("Unsqueeze", [ids, g.c(np.array([-1], np.int64))])
        eq = g.one("Equal", [unsq, g.c(np.arange(experts, dtype=np.int64))])
        hot = g.one("Cast", [eq], to=TensorProto.INT64)
    return g.one("Transpose", [hot], perm=[2, 1, 0])


def _coords(g: _G, mask: str, e: int, spelling: str, squeeze: bool) -> tuple[str, str]:
    m = g.one("Gather", [mask, g.c(np.array(e, np.int64))], axis=0)
    if squeeze:
        m = g.one("Squeeze", [m, g.c(np.array([0], np.int64))])
    if spelling == "torchscript":
        m = g.one("Cast", [m], to=TensorProto.BOOL)
    pairs = g.one("Transpose", [g.one("NonZero", [m])], perm=[1, 0])
    one = g.c(np.array([1], np.int64))
    if spelling == "torchscript":
        a, b = g.op("Split", [pairs, g.c(np.array([1, 1], np.int64))], outputs=2, axis=1)
    else:
        a = g.one("Slice", [pairs, g.c(np.array([0], np.int64)), one, one])
        b = g.one("Slice", [pairs, one, g.c(np.array([2], np.int64)), one])
    return g.one("Squeeze", [a, one]), g.one("Squeeze", [b, one])


def _weight(g: _G, source: str, spelling: str) -> str:
    """The MatMul operand: the initializer, or (dynamo) a Transpose of its ``[N, K]`` layout."""
    if spelling == "dynamo":  # a Linear through Transpose (NormalizeSpellings' Gemm spelling)
        return g.one("Transpose", [source], perm=[1, 0])
    return source


def _mlp(g: _G, rows: str, ws: list[str], spec: LoopSpec, bs: list[str] | None) -> str:
    def linear(x: str, j: int) -> str:
        y = g.one("MatMul", [x, ws[j]])
        if bs is None:
            return y
        # the TorchScript export adds the bias after, dynamo's Gemm lowering before the product
        return g.one("Add", [y, bs[j]] if spec.spelling == "torchscript" else [bs[j], y])

    if spec.activation == "swiglu":
        gate, up = linear(rows, 0), linear(rows, 1)
        act = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])
    else:
        act = g.one("Relu", [linear(rows, 0)])
    return linear(act, len(ws) - 1)


def build_loop(spec: LoopSpec) -> onnx.ModelProto:
    """The loop model of ``spec`` (float32, opset 18, checked by the ONNX checker)."""
    rng = np.random.default_rng(spec.seed)
    g, E, k, ts = _G(), spec.experts, spec.k, spec.spelling == "torchscript"
    shapes = [(H, INTER), (H, INTER), (INTER, H)] if spec.activation == "swiglu" else [
        (H, INTER), (INTER, H)
    ]  # fmt: skip
    experts = [[rng.standard_normal(s).astype(np.float32) * 0.3 for s in shapes] for _ in range(E)]
    layout = (lambda w: w) if ts else (lambda w: np.ascontiguousarray(w.T))
    sources = [[g.c(layout(w)) for w in ws] for ws in experts]
    if spec.mutation == "shared_weight":  # expert 1's FC1 reads expert 0's initializer
        sources[1][0] = sources[0][0]
    names = [[_weight(g, w, spec.spelling) for w in ws] for ws in sources]
    biases = [
        [g.c(rng.standard_normal(s[1]).astype(np.float32) * 0.3) for s in shapes]
        for _ in range(E)
    ] if spec.biases else None  # fmt: skip
    router = rng.standard_normal((H, E)).astype(np.float32)
    w, ids = _router(g, "x", router, k)
    w_mask = w
    if spec.mutation == "other_topk":
        w_mask, ids = _router(g, "x", rng.standard_normal((H, E)).astype(np.float32), k)
    mask = _mask(g, ids, E, spec.spelling)
    axis0 = g.c(np.array([0], np.int64))
    w3 = g.one("Unsqueeze", [w, g.c(np.array([2], np.int64))])
    if ts:
        x3 = g.one("Unsqueeze", ["x", axis0])
        flat = g.one("Flatten", [w3], axis=2)
        width = g.one("Gather", [g.one("Shape", [w3]), g.c(np.array([1], np.int64))], axis=0)
        zeros = g.one("ConstantOfShape", [g.one("Shape", ["x"])])
    else:
        x3 = g.one("Transpose", [g.one("Unsqueeze", ["x", axis0])], perm=[1, 0, 2])
        zeros = g.one("Expand", [g.c(np.array(0.0, np.float32)), g.one("Shape", ["x"])])
    if spec.mutation == "nonzero_start":
        zeros = g.one("Expand", [g.c(np.array(1.0, np.float32)), g.one("Shape", ["x"])])
    acc = zeros
    shared_with = {E - 1: E - 2} if spec.mutation == "repeated_expert" else {}
    count = E - 1 if spec.mutation == "missing_expert" else E
    graph_outputs = []
    for e in range(count):
        squeeze = spec.mutation == "squeeze_slot_axis"
        s, t = _coords(g, mask, shared_with.get(e, e), spec.spelling, squeeze)
        by = s if spec.mutation == "rows_by_slots" else t
        first, second = (t, s) if spec.mutation == "weight_swapped" else (s, t)
        if spec.plain_rows:
            rows = g.one("Gather", ["x", by], axis=0)
        elif ts:
            rows = g.one("Reshape", [g.one("Gather", [x3, by], axis=1), g.c(np.array([-1, H]))])
        if ts:
            index = g.one("Add", [first, g.one("Mul", [second, width])])
            gw = g.one("Gather", [flat, index], axis=0)
            gw = g.one("Reshape", [gw, g.c(np.array([-1, 1], np.int64))])
        else:
            if not spec.plain_rows:
                by_u = g.one("Unsqueeze", [by, g.c(np.array([-1], np.int64))])
                gnd = g.one("GatherND", [x3, by_u])
                rows = g.one("Transpose", [gnd], perm=[1, 0, 2])
                rows = g.one("Reshape", [rows, g.c(np.array([-1, H], np.int64))])
            pair = [g.one("Unsqueeze", [v, g.c(np.array([-1], np.int64))]) for v in (t, s)]
            pair = pair[::-1] if spec.mutation == "weight_swapped" else pair
            gw = g.one("GatherND", [w3, g.one("Concat", pair, axis=-1)])
        y = _mlp(g, rows, names[e], spec, biases[e] if biases else None)
        if spec.mutation == "graph_output" and e == 0:
            graph_outputs.append(y)
        v = g.one("Mul", [y, gw])
        if ts:
            first_row = g.one(
                "Slice",
                [acc, g.c(np.array([0, 0])), g.c(np.array([1, INT64_MAX])), g.c(np.array([0, 1]))],
            )
            upd = g.one("Expand", [v, g.one("Shape", [first_row])])
            idx = g.one("Unsqueeze", [t, g.c(np.array([1], np.int64))])
            idx = g.one("Expand", [idx, g.one("Shape", [upd])])
            blank = g.one("ConstantOfShape", [g.one("Shape", [acc])])
            acc = g.one("Add", [acc, g.one("ScatterElements", [blank, idx, upd], axis=0)])
        else:
            t_u = g.one("Unsqueeze", [t, g.c(np.array([-1], np.int64))])
            acc = g.one("ScatterND", [acc, t_u, v], reduction="add")
    g.nodes.append(helper.make_node("Identity", [acc], ["out"], name="out"))
    float_out = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", H]) for n in graph_outputs
    ]
    graph = helper.make_graph(
        g.nodes,
        "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", H]), *float_out],
        g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return model
