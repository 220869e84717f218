"""Hand-written MoE layers that repeat the token rows, or combine them, in other ways.

Part of the "meaning" set (:mod:`onnx_moe_fuse.samples.handwritten_meaning`, issue 18). Every
layer works on flat rows ``r = t * k + j`` (token ``t``, slot ``j``): each row's expert weight is
gathered by the flattened ids, the SwiGLU experts run row by row (``[T*k, 1, H] @ [T*k, H, I]``),
and only the piece under test changes:

* :func:`rows_layout`: the token rows repeated k times by ``Tile(x, [1, k])`` + Reshape, by a
  Gather of ``Range(T*k) // k``, by a Concat of k copies + Reshape, or by Expand of ``[T, 1, H]``
  + Reshape ``[T*k, H]``;
* :func:`scatter_combine`: the weighted rows summed into their tokens by
  ``ScatterElements(zeros, token_of_row, rows, reduction="add")`` or by ``ScatterND(...,
  reduction="add")`` (what ``index_add_`` exports to);
* :func:`top1_squeezed`: k = 1 with the slot axis squeezed away (ids ``[T]``, weights ``[T, 1]``);
  its ``split`` twin routes ``[B, S, H]`` tokens as they are (ids ``[B, S]``).

Traps: :func:`trap_rows_wrong_token` (rows gathered by ``Range(T*k) % T``, so slot j of token t
reads another token), :func:`trap_scatter_wrong_token` (each row added into the next token) and
:func:`trap_top1_one_minus` (the k = 1 output weighted by ``1 - p``).
"""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from onnx_moe_fuse.samples.handwritten_graph import Fused, Graph, HandwrittenLayer, Refused, normal
from onnx_moe_fuse.samples.handwritten_meaning_act import moe_attrs

__all__ = [
    "ROW_LAYOUTS",
    "SCATTERS",
    "rows_layout",
    "scatter_combine",
    "split_router_flat_experts",
    "top1_split",
    "top1_squeezed",
    "trap_rows_wrong_token",
    "trap_scatter_wrong_token",
    "trap_split_router_swapped",
    "trap_top1_one_minus",
    "trap_top1_split_one_minus",
    "trap_top1_split_reversed",
]

#: The ways :func:`rows_layout` repeats the token rows.
ROW_LAYOUTS = ("tile", "gather_range", "concat", "expand")
#: The scatter ops :func:`scatter_combine` sums the rows with.
SCATTERS = ("scatter_elements", "scatter_nd")


def _row_count(g: Graph, x: str, k: int, p: str = "") -> str:
    """``[T * k]`` as a 1-element int64 tensor, from ``Shape(x)`` (``p``: a name prefix)."""
    t = g.op("Shape", [x], f"{p}n_tokens", start=0, end=1)
    return g.op("Mul", [t, g.const(f"{p}k_1d", [k])], f"{p}n_rows")


def _token_of_row(g: Graph, x: str, k: int, shift: int = 0) -> str:
    """``Range(T*k) // k`` (``shift``: add it mod T, a trap), int64 ``[T*k]``."""
    n = g.op("Squeeze", [_row_count(g, x, k, "tok_")], "n_rows_scalar")
    zero, one = g.const("r_start", np.array(0, np.int64)), g.const("r_step", np.array(1, np.int64))
    r = g.op("Range", [zero, n, one], "row_index")
    tok = g.op("Div", [r, g.const("k_scalar", np.array(k, np.int64))], "token_of_row")
    if shift:
        t = g.op("Shape", [x], "n_tok_for_mod", start=0, end=1)
        tok = g.op("Add", [tok, g.const("shift", np.array(shift, np.int64))], "token_shifted")
        tok = g.op("Mod", [tok, t], "token_wrapped")
    return tok


def _repeat_rows(g: Graph, x: str, h: int, k: int, layout: str) -> str:
    """The token rows repeated k times, row ``t*k + j`` = ``x[t]``: ``[T*k, H]``."""
    if layout == "tile":
        tiled = g.op("Tile", [x, g.const("tile_reps", [1, k])], "x_tiled")  # [T, k*H]
        return g.op("Reshape", [tiled, g.const("rows_shape", [-1, h])], "rows")
    if layout == "gather_range":
        return g.op("Gather", [x, _token_of_row(g, x, k)], "rows", axis=0)
    if layout == "concat":
        copies = g.op("Concat", [x] * k, "x_copies", axis=1)  # [T, k*H]
        return g.op("Reshape", [copies, g.const("rows_shape", [-1, h])], "rows")
    if layout == "expand":
        x3 = g.op("Unsqueeze", [x, g.const("slot_axis_1", [1])], "x_t1h")
        t = g.op("Shape", [x], "t_dim", start=0, end=1)
        target = g.op("Concat", [t, g.const("k_h", [k, h])], "tkh_shape", axis=0)
        xe = g.op("Expand", [x3, target], "x_tkh")
        return g.op("Reshape", [xe, _row_count_shape(g, x, k, h)], "rows")
    if layout == "wrong_token":  # the trap: row r reads x[r % T]
        n = g.op("Squeeze", [_row_count(g, x, k)], "n_rows_scalar")
        zero = g.const("r_start", np.array(0, np.int64))
        r = g.op("Range", [zero, n, g.const("r_step", np.array(1, np.int64))], "row_index")
        t = g.op("Shape", [x], "n_tok_for_mod", start=0, end=1)
        return g.op("Gather", [x, g.op("Mod", [r, t], "row_token_mod")], "rows", axis=0)
    raise ValueError(f"unknown row layout {layout!r}; choose among {ROW_LAYOUTS}")


def _row_count_shape(g: Graph, x: str, k: int, h: int) -> str:
    """``[T*k, H]`` computed from ``Shape(x)``: the Reshape target a dynamic exporter writes."""
    return g.op("Concat", [_row_count(g, x, k), g.const("h_dim", [h])], "rows_2d_shape", axis=0)


def _row_experts(g: Graph, rng, rows: str, flat_ids: str, dims) -> str:
    """SwiGLU experts on flat rows, each row's weights gathered by its id: ``[T*k, H]``."""
    h, i, e, _ = dims
    r3 = g.op("Unsqueeze", [rows, g.const("row_mid_axis", [1])], "rows_r1h")

    def project(lhs: str, name: str, shape) -> str:
        w = g.init(f"moe.experts.{name}", normal(rng, shape, shape[1]))
        sel = g.op("Gather", [w, flat_ids], f"{name}_per_row", axis=0)
        return g.op("MatMul", [lhs, sel], f"{name}_r1n")

    gate, up = project(r3, "gate", (e, h, i)), project(r3, "up", (e, h, i))
    act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate], "gs")], "gact"), up], "act")
    down = project(act, "down", (e, i, h))
    return g.op("Squeeze", [down, g.const("row_mid_axis_sq", [1])], "expert_rows")


def _router(g: Graph, rng, x: str, dims, renorm: bool = True) -> tuple[str, str]:
    h, _, e, k = dims
    logits = g.op("MatMul", [x, g.init("moe.gate.weight", normal(rng, (h, e), h))], "gate_logits")
    probs = g.op("Softmax", [logits], "gate_probs", axis=1)
    vals, ids = g.op_multi("TopK", [probs, g.const("topk_k", [k])], ["top_vals", "top_ids"])
    if not renorm:
        return vals, ids
    total = g.op("ReduceSum", [vals, g.const("last_axis", [1])], "top_total", keepdims=1)
    return g.op("Div", [vals, total], "top_weights"), ids


def _sum_slots(g: Graph, rows: str, weights: str, h: int, k: int) -> str:
    slots = g.op("Reshape", [rows, g.const("tkh", [-1, k, h])], "slots_out")
    w3 = g.op("Unsqueeze", [weights, g.const("w_last", [2])], "weights_tk1")
    prod = g.op("Mul", [slots, w3], "slots_weighted")
    return g.op("ReduceSum", [prod, g.const("slot_dim", [1])], "y", keepdims=0)


def _rows_graph(name: str, seed: int, layout: str, dims) -> tuple[Graph, str, str, str]:
    rng = np.random.default_rng(seed)
    h, _, _, k = dims
    g = Graph(name)
    x = g.input("hidden_states", ["num_tokens", h])
    weights, ids = _router(g, rng, x, dims)
    flat_ids = g.op("Reshape", [ids, g.const("flat", [-1])], "ids_flat")
    rows = _repeat_rows(g, x, h, k, layout)
    return g, weights, _row_experts(g, rng, rows, flat_ids, dims), x


def rows_layout(layout: str, seed: int = 190) -> HandwrittenLayer:
    """Token rows repeated by ``layout`` (one of :data:`ROW_LAYOUTS`), combined by slot sum."""
    dims = (32, 48, 6, 2)
    g, weights, rows, _ = _rows_graph(f"rows_{layout}", seed, layout, dims)
    _sum_slots(g, rows, weights, dims[0], dims[3])
    g.output("y", ["num_tokens", dims[0]])
    how = {
        "tile": "Tile(x, [1, k]) then Reshape [-1, H]",
        "gather_range": "Gather(x, Range(T*k) // k)",
        "concat": "Concat of k copies of x (axis 1) then Reshape [-1, H]",
        "expand": "Expand of Unsqueeze(x) [T, 1, H] to [T, k, H] then Reshape [T*k, H]",
    }[layout]
    return HandwrittenLayer(
        g.model(21),
        f"token rows repeated k times by {how}; per-row expert weights gathered by flat ids",
        Fused("MoE", moe_attrs(dims[3], "swiglu")),
    )


def trap_rows_wrong_token(seed: int = 191) -> HandwrittenLayer:
    """Trap: rows gathered by ``Range(T*k) % T``: slot j of token t runs on another token."""
    dims = (32, 48, 6, 2)
    g, weights, rows, _ = _rows_graph("rows_wrong_token", seed, "wrong_token", dims)
    _sum_slots(g, rows, weights, dims[0], dims[3])
    g.output("y", ["num_tokens", dims[0]])
    return HandwrittenLayer(
        g.model(21),
        "trap: token rows gathered by Range(T*k) % T (row t*k + j reads token (t*k + j) mod T)",
        Refused("tokens", "token"),
    )


def scatter_combine(op: str, seed: int = 192, shift: int = 0) -> HandwrittenLayer:
    """Weighted rows summed into their tokens by ScatterElements or ScatterND, reduction add."""
    dims = (32, 40, 5, 2)
    h, _, _, k = dims
    tag = f"{op}_wrong_token" if shift else op
    g, weights, rows, x = _rows_graph(f"combine_{tag}", seed, "expand", dims)
    w_col = g.op("Reshape", [weights, g.const("w_col", [-1, 1])], "row_weights")
    weighted = g.op("Mul", [rows, w_col], "rows_weighted")  # [T*k, H]
    zeros = g.op(
        "ConstantOfShape",
        [g.op("Shape", [x], "out_shape")],
        "y_zeros",
        value=numpy_helper.from_array(np.zeros(1, np.float32)),
    )
    tok = _token_of_row(g, x, k, shift)
    if op == "scatter_elements":
        tok2 = g.op("Unsqueeze", [tok, g.const("tok_col", [1])], "tok_col_v")
        index = g.op("Expand", [tok2, g.op("Shape", [weighted], "rows_shape_v")], "tok_index")
        g.op("ScatterElements", [zeros, index, weighted], "y", axis=0, reduction="add")
    elif op == "scatter_nd":
        index = g.op("Unsqueeze", [tok, g.const("tok_last", [-1])], "tok_nd_index")
        g.op("ScatterND", [zeros, index, weighted], "y", reduction="add")
    else:
        raise ValueError(f"unknown scatter {op!r}; choose among {SCATTERS}")
    g.output("y", ["num_tokens", h])
    if shift:
        return HandwrittenLayer(
            g.model(21),
            f"trap: {op} add of each weighted row into the next token ((t + {shift}) mod T)",
            Refused("combine", "token"),
        )
    how = (
        "ScatterElements(zeros, token_of_row, rows, axis 0"
        if op == "scatter_elements"
        else ("ScatterND(zeros, token_of_row[:, None], rows")
    )
    return HandwrittenLayer(
        g.model(21),
        f"combine by {how}, reduction add) of the weighted rows, token_of_row = Range(T*k) // k",
        Fused("MoE", moe_attrs(k, "swiglu")),
    )


def trap_scatter_wrong_token(seed: int = 193) -> HandwrittenLayer:
    """Trap: the ScatterElements combine adds each row into the next token."""
    return scatter_combine("scatter_elements", seed, shift=1)


def top1_squeezed(
    seed: int = 194, one_minus: bool = False, split: bool = False, reversed_rows: bool = False
) -> HandwrittenLayer:
    """k = 1 with the slot axis squeezed away: ids ``[T]``, output times the top probability.

    ``one_minus`` (the trap): the output is weighted by ``1 - p_top``, no router's weight.
    ``split``: the tokens ``[B, S, H]`` routed and projected as they are, never flattened (ids
    ``[B, S]``, weights gathered ``[B, S, H, I]``); ``reversed_rows`` (a trap, with ``split``):
    the experts run on the sequence reversed, so token ``(b, s)`` gets the experts of
    ``(b, S - 1 - s)``.
    """
    rng = np.random.default_rng(seed)
    h, i, e = 32, 64, 4
    g = Graph(("top1" if not one_minus else "top1_trap") + ("_split" if split else ""))
    token_dims = ["B", "S"] if split else ["T"]
    x = g.input("x", [*token_dims, h])
    slot = len(token_dims)  # the slot axis of the ids, the row axis of the tokens
    probs = g.op(
        "Softmax", [g.op("MatMul", [x, g.init("wg", normal(rng, (h, e), h))], "z")], "p", axis=-1
    )
    p1, id1 = g.op_multi("TopK", [probs, g.init("one", [1])], ["p_top", "id_top"], axis=-1)
    ids = g.op("Squeeze", [id1, g.init("sq_axis", [slot])], "expert_of_token")  # [T]
    if reversed_rows:
        big, axis = np.iinfo(np.int64).min, [1]
        starts, ends = g.init("rev_start", [-1]), g.init("rev_end", [big])
        steps, axes = g.init("rev_step", [-1]), g.init("rev_axis", axis)
        x = g.op("Slice", [x, starts, ends, axes, steps], "x_reversed")
    x3 = g.op("Unsqueeze", [x, g.init("mid", [slot])], "x_t1h")
    w1 = g.op("Gather", [g.init("w1", normal(rng, (e, h, i), h)), ids], "w1_t", axis=0)
    w3 = g.op("Gather", [g.init("w3", normal(rng, (e, h, i), h)), ids], "w3_t", axis=0)
    a = g.op("MatMul", [x3, w1], "a")
    b = g.op("MatMul", [x3, w3], "b")
    act = g.op("Mul", [g.op("Mul", [a, g.op("Sigmoid", [a], "sa")], "silu_a"), b], "ab")
    w2 = g.op("Gather", [g.init("w2", normal(rng, (e, i, h), i)), ids], "w2_t", axis=0)
    out = g.op("Squeeze", [g.op("MatMul", [act, w2], "o3"), g.init("mid_sq", [slot])], "o")
    if one_minus:
        p1 = g.op("Sub", [g.init("one_f", np.array(1.0, np.float32)), p1], "p_rest")
    g.op("Mul", [out, p1], "y")
    g.output("y", [*token_dims, h])
    shape = "[B, S] (tokens [B, S, H] never flattened)" if split else "[T]"
    if reversed_rows:
        return HandwrittenLayer(
            g.model(21),
            f"trap: k = 1 layer (ids {shape}) whose experts run on the sequence reversed",
            Refused("fc1", "slice of the tokens"),
        )
    if one_minus:
        return HandwrittenLayer(
            g.model(21),
            f"trap: k = 1 layer (ids {shape}) whose output is weighted by 1 - p_top",
            Refused("routing", "weight"),
        )
    return HandwrittenLayer(
        g.model(21),
        f"k = 1: TopK(1) ids squeezed to {shape}, weights gathered per token, output times p_top",
        Fused("MoE", moe_attrs(1, "swiglu", normalize=0)),
    )


def trap_top1_one_minus(seed: int = 195) -> HandwrittenLayer:
    """Trap: :func:`top1_squeezed` weighted by ``1 - p_top``."""
    return top1_squeezed(seed, one_minus=True)


def top1_split(seed: int = 196) -> HandwrittenLayer:
    """:func:`top1_squeezed` on ``[B, S, H]`` tokens routed as they are."""
    return top1_squeezed(seed, split=True)


def trap_top1_split_reversed(seed: int = 197) -> HandwrittenLayer:
    """Trap: :func:`top1_split` whose experts run on the sequence reversed."""
    return top1_squeezed(seed, split=True, reversed_rows=True)


def trap_top1_split_one_minus(seed: int = 198) -> HandwrittenLayer:
    """Trap: :func:`top1_split` weighted by ``1 - p_top``."""
    return top1_squeezed(seed, one_minus=True, split=True)


def split_router_flat_experts(seed: int = 199, swapped: bool = False) -> HandwrittenLayer:
    """The router on ``[B, S, H]`` tokens as they are, the experts on their ``[T, H]`` view.

    TopK over ``[B, S, E]`` scores; ids and weights Reshaped to ``[T, k]``, the ReLU experts
    Gather-ed per slot over ``Reshape(x, [-1, H])``, the slot sum Reshaped back to ``Shape(x)``.
    ``swapped`` (the trap): the ids Transposed to ``[S, B, k]`` before the Reshape, so token
    ``b * S + s`` runs the experts chosen for another token.
    """
    rng = np.random.default_rng(seed)
    h, i, e, k = 16, 24, 4, 2
    g = Graph("split_router" + ("_swapped" if swapped else ""))
    x = g.input("x", ["B", "S", h])
    z = g.op("MatMul", [x, g.init("wg", normal(rng, (h, e), h))], "z")
    probs = g.op("Softmax", [z], "p", axis=-1)
    top, chosen = g.op_multi("TopK", [probs, g.init("k", [k])], ["p_top", "id_top"], axis=-1)
    if swapped:
        chosen = g.op("Transpose", [chosen], "id_sb", perm=[1, 0, 2])
    ids = g.op("Reshape", [chosen, g.init("rows_k", [-1, k])], "ids")
    weights = g.op("Reshape", [top, g.init("rows_k_w", [-1, k])], "weights")
    rows = g.op("Reshape", [x, g.init("rows_h", [-1, h])], "rows")
    lhs = g.op("Unsqueeze", [rows, g.init("slot_row_axes", [1, 2])], "rows_t11h")
    w1 = g.op("Gather", [g.init("w1", normal(rng, (e, h, i), h)), ids], "w1_tk", axis=0)
    act = g.op("Relu", [g.op("MatMul", [lhs, w1], "fc1")], "act")
    w2 = g.op("Gather", [g.init("w2", normal(rng, (e, i, h), i)), ids], "w2_tk", axis=0)
    out = g.op("Squeeze", [g.op("MatMul", [act, w2], "fc2"), g.init("row_axis", [2])], "slots")
    w3 = g.op("Unsqueeze", [weights, g.init("w_last", [-1])], "weights_tk1")
    mixed = g.op("ReduceSum", [g.op("Mul", [out, w3], "weighted"), g.init("slot_axis", [1])],
                 "mixed", keepdims=0)  # fmt: skip
    g.op("Reshape", [mixed, g.op("Shape", [x], "x_shape")], "y")
    g.output("y", ["B", "S", h])
    if swapped:
        return HandwrittenLayer(
            g.model(21),
            "trap: the router's [B, S, k] ids Transposed to [S, B, k] before the experts read them",
            Refused("fc1", "align"),
        )
    return HandwrittenLayer(
        g.model(21),
        "router on [B, S, H] tokens as they are (TopK over [B, S, E]), experts on Reshape(x, [-1, H])",
        Fused("MoE", moe_attrs(k, "relu", normalize=0)),
    )


def trap_split_router_swapped(seed: int = 200) -> HandwrittenLayer:
    """Trap: :func:`split_router_flat_experts` with the ids of another token."""
    return split_router_flat_experts(seed, swapped=True)
