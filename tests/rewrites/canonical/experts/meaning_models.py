"""Hand-built MoE layers in spellings no exporter-form pass was written for (meaning tests).

:func:`flat_layer` writes the plain decomposition a person writes: the token rows repeated per
slot in one of several layouts (:data:`ROWS`), each expert weight gathered by the flat ids,
FC1 of the rows, an activation, FC2, and one of several combines (:data:`COMBINES`: the weighted
rows reshaped and summed, or scatter-added at each row's token as ``index_add_`` does).
:func:`loop_layer` writes mistral-inference's loop over the experts as torch.onnx's dynamo
exporter writes it: ``Equal(ids, e)``, ``NonZero``, the rows' token and slot indices, GatherND of
the tokens and of the weights, each expert's own ``Gemm`` weights, the accumulator read at the
rows' tokens, added to and written back with ``ScatterND``. ``trap`` makes the layer compute
something else (see :data:`FLAT_TRAPS`, :data:`LOOP_TRAPS`); each must be refused.
Tokens ``x [T, H]`` are the graph input (T symbolic), ``out`` the output.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

H, INTER, EXPERTS = 16, 8, 4

ROWS = ("expand_reshape", "tile", "gather_range")
COMBINES = ("reshape_sum", "scatter_nd", "scatter_elements")
FLAT_TRAPS = (
    "rows_by_slot",  # the rows gathered at Range(T*k) % k: the slot, not the token
    "scatter_overwrite",  # ScatterND without reduction at k = 2: a token's slots overwrite
    "sum_over_tokens",  # the weighted rows summed over the tokens, not the slots
    "weights_other_slot",  # the routing weights reversed along the slots
)
LOOP_TRAPS = (
    "missing_expert",  # the last expert's branch is not there
    "weights_swapped",  # the routing weight gathered at (slot, token)
    "start_from_tokens",  # the accumulator starts from the tokens, not zeros
)


class _G:
    def __init__(self, seed: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0
        self.rng = np.random.default_rng(seed)

    def c(self, array) -> str:  # noqa: ANN001
        self.n += 1
        name = f"c{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def w(self, *shape: int) -> str:
        return self.c((self.rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32))

    def op(self, op: str, inputs: list[str], n_out: int = 1, **attrs) -> str | list[str]:  # noqa: ANN003
        self.n += 1
        outs = [f"v{self.n}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=f"{op}_{self.n}", **attrs))
        return outs[0] if n_out == 1 else outs

    def model(self, out: str, opset: int = 18) -> onnx.ModelProto:
        self.nodes[-1].output[0] = "out"
        for n in self.nodes:
            for i, name in enumerate(n.input):
                if name == out:
                    n.input[i] = "out"
        graph = helper.make_graph(
            self.nodes,
            "moe",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H])],
            [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", H])],
            self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 9
        onnx.checker.check_model(model)
        return model


def _router(g: _G, k: int) -> tuple[str, str]:
    logits = g.op("MatMul", ["x", g.w(H, EXPERTS)])
    probs = g.op("Softmax", [logits], axis=-1)
    vals, ids = g.op("TopK", [probs, g.c(np.array([k]))], 2)
    total = g.op("ReduceSum", [vals, g.c(np.array([-1]))], keepdims=1)
    return g.op("Div", [vals, total]), ids


def _silu_by_hand(g: _G, v: str) -> str:
    """SiLU in the spelling the rules take, ``x * Sigmoid(x)``: these tests are about layout.

    Activations written out (``x / (1 + exp(-x))``) are the activation recogniser's tests.
    """
    return g.op("Mul", [v, g.op("Sigmoid", [v])])


def flat_layer(
    rows: str = "expand_reshape",
    combine: str = "reshape_sum",
    k: int = 2,
    bias: bool = False,
    trap: str | None = None,
    seed: int = 0,
) -> onnx.ModelProto:
    """The plain decomposition over ``[T*k, 1, H]`` rows (see the module)."""
    g = _G(seed)
    w, ids = _router(g, k)
    if trap == "weights_other_slot":
        w = g.op(
            "Slice",
            [
                w,
                g.c(np.array([-1])),
                g.c(np.array([-(2**62)])),
                g.c(np.array([1])),
                g.c(np.array([-1])),
            ],
        )
    flat_ids = g.op("Reshape", [ids, g.c(np.array([-1]))])
    shape_x = g.op("Shape", ["x"])
    tokens = g.op("Gather", [shape_x, g.c(np.array([0]))], axis=0)
    if rows == "expand_reshape":
        target = g.op("Concat", [tokens, g.c(np.array([k])), g.c(np.array([H]))], axis=0)
        grown = g.op("Expand", [g.op("Unsqueeze", ["x", g.c(np.array([1]))]), target])
        flat = g.op("Reshape", [grown, g.c(np.array([-1, H]))])
    elif rows == "tile":
        tiled = g.op(
            "Tile", [g.op("Unsqueeze", ["x", g.c(np.array([1]))]), g.c(np.array([1, k, 1]))]
        )
        flat = g.op("Reshape", [tiled, g.c(np.array([-1, H]))])
    else:
        count = g.op("Squeeze", [g.op("Mul", [tokens, g.c(np.array([k]))])])
        r = g.op("Range", [g.c(np.array(0)), count, g.c(np.array(1))])
        op = "Mod" if trap == "rows_by_slot" else "Div"
        flat = g.op("Gather", ["x", g.op(op, [r, g.c(np.array(k))])], axis=0)
    x3 = g.op("Unsqueeze", [flat, g.c(np.array([1]))])  # [T*k, 1, H]
    h = g.op("MatMul", [x3, g.op("Gather", [g.w(EXPERTS, H, 2 * INTER), flat_ids], axis=0)])
    if bias:
        b1 = g.c(g.rng.standard_normal((EXPERTS, 1, 2 * INTER)).astype(np.float32))
        h = g.op("Add", [h, g.op("Gather", [b1, flat_ids], axis=0)])
    gate, up = g.op("Split", [h, g.c(np.array([INTER, INTER]))], 2, axis=-1)
    a = g.op("Mul", [_silu_by_hand(g, gate), up])
    y = g.op("MatMul", [a, g.op("Gather", [g.w(EXPERTS, INTER, H), flat_ids], axis=0)])
    if bias:
        b2 = g.c(g.rng.standard_normal((EXPERTS, H)).astype(np.float32))
        y = g.op(
            "Add",
            [y, g.op("Unsqueeze", [g.op("Gather", [b2, flat_ids], axis=0), g.c(np.array([1]))])],
        )
    weighted = g.op("Mul", [y, g.op("Reshape", [w, g.c(np.array([-1, 1, 1]))])])
    if combine == "reshape_sum":
        per_slot = g.op("Reshape", [weighted, g.c(np.array([-1, k, H]))])
        axis = 0 if trap == "sum_over_tokens" else 1
        out = g.op("ReduceSum", [per_slot, g.c(np.array([axis]))], keepdims=0)
        if trap == "sum_over_tokens":
            out = g.op("Expand", [out, g.op("Shape", ["x"])])
    else:
        flat_rows = g.op("Reshape", [weighted, g.c(np.array([-1, H]))])
        count = g.op("Squeeze", [g.op("Mul", [tokens, g.c(np.array([k]))])])
        r = g.op("Range", [g.c(np.array(0)), count, g.c(np.array(1))])
        token_of_row = g.op("Div", [r, g.c(np.array(k))])
        zeros = g.op(
            "ConstantOfShape", [shape_x], value=numpy_helper.from_array(np.zeros(1, np.float32))
        )
        reduction = "none" if trap == "scatter_overwrite" else "add"
        if combine == "scatter_nd":
            index = g.op("Unsqueeze", [token_of_row, g.c(np.array([-1]))])
            out = g.op("ScatterND", [zeros, index, flat_rows], reduction=reduction)
        else:
            index = g.op(
                "Expand",
                [
                    g.op("Unsqueeze", [token_of_row, g.c(np.array([-1]))]),
                    g.op("Shape", [flat_rows]),
                ],
            )
            out = g.op("ScatterElements", [zeros, index, flat_rows], axis=0, reduction=reduction)
    return g.model(out, opset=18)


def loop_layer(trap: str | None = None, seed: int = 0, k: int = 2) -> onnx.ModelProto:
    """mistral-inference's loop over the experts, as torch.onnx dynamo writes it."""
    g = _G(seed)
    w, ids = _router(g, k)
    w3 = g.op("Unsqueeze", [w, g.c(np.array([-1]))])
    start = "x" if trap == "start_from_tokens" else None
    acc = start or g.op("Expand", [g.c(np.array(0.0, np.float32)), g.op("Shape", ["x"])])
    experts = EXPERTS - 1 if trap == "missing_expert" else EXPERTS
    for e in range(experts):
        mask = g.op("Equal", [ids, g.c(np.array(e))])
        pairs = g.op("Transpose", [g.op("NonZero", [mask])], perm=[1, 0])
        t = g.op(
            "Squeeze",
            [
                g.op("Slice", [pairs, g.c(np.array([0])), g.c(np.array([1])), g.c(np.array([1]))]),
                g.c(np.array([1])),
            ],
        )
        j = g.op(
            "Squeeze",
            [
                g.op("Slice", [pairs, g.c(np.array([1])), g.c(np.array([2])), g.c(np.array([1]))]),
                g.c(np.array([1])),
            ],
        )
        t1, j1 = (
            g.op("Unsqueeze", [t, g.c(np.array([1]))]),
            g.op("Unsqueeze", [j, g.c(np.array([1]))]),
        )
        order = [j1, t1] if trap == "weights_swapped" else [t1, j1]
        pair = g.op("Concat", order, axis=-1)
        current = g.op("GatherND", [acc, t1])
        weight = g.op("GatherND", [w3, pair])
        rows = g.op("GatherND", ["x", t1])
        gate = g.op("Gemm", [rows, g.w(INTER, H)], transB=1)
        up = g.op("Gemm", [rows, g.w(INTER, H)], transB=1)
        a = g.op("Mul", [_silu_by_hand(g, gate), up])
        y = g.op("Gemm", [a, g.w(H, INTER)], transB=1)
        acc = g.op("ScatterND", [acc, t1, g.op("Add", [current, g.op("Mul", [weight, y])])])
    return g.model(acc, opset=18)


DENSE_TRAPS = (
    "first_slot_only",  # the dense weights of slot 0 alone: the other slots' experts dropped
    "sum_over_tokens",  # the weighted outputs summed over the tokens, not the experts
)


def dense_layer(trap: str | None = None, seed: int = 0, k: int = 2) -> onnx.ModelProto:
    """Every expert on every token (a stacked ``[E, H, N]`` MatMul), masked by one-hot weights."""
    g = _G(seed)
    w, ids = _router(g, k)
    h = g.op("MatMul", ["x", g.w(EXPERTS, H, 2 * INTER)])  # [E, T, 2I]
    gate, up = g.op("Split", [h, g.c(np.array([INTER, INTER]))], 2, axis=-1)
    y = g.op("MatMul", [g.op("Mul", [_silu_by_hand(g, gate), up]), g.w(EXPERTS, INTER, H)])
    onehot = g.op("OneHot", [ids, g.c(np.array(EXPERTS)), g.c(np.array([0.0, 1.0], np.float32))])
    masked = g.op("Mul", [onehot, g.op("Unsqueeze", [w, g.c(np.array([-1]))])])  # [T, k, E]
    if trap == "first_slot_only":
        c = g.op("Gather", [masked, g.c(np.array(0))], axis=1)  # slot 0's weight alone
    else:
        c = g.op("ReduceSum", [masked, g.c(np.array([1]))], keepdims=0)  # [T, E]
    per_expert = g.op("Unsqueeze", [g.op("Transpose", [c], perm=[1, 0]), g.c(np.array([-1]))])
    weighted = g.op("Mul", [y, per_expert])  # [E, T, H]
    axis = 1 if trap == "sum_over_tokens" else 0
    out = g.op("ReduceSum", [weighted, g.c(np.array([axis]))], keepdims=0)
    if trap == "sum_over_tokens":
        out = g.op("Expand", [g.op("Unsqueeze", [out, g.c(np.array([0]))]), g.op("Shape", ["x"])])
        out = g.op("Identity", [out])
    return g.model(out, opset=18)
