"""The experts and combine parts of a generated MoE layer (split out of ``build.py``).

Three layouts: per slot (``[*, k, N]`` projections from gathered expert weights, the tokens
broadcast to the k slots), flattened rows (torch ``batched_mm`` exports: ``T*k`` rows,
``GatherND`` by the flat ids), and dense (every expert on every token, the combine masked by
the routing). Each combine spelling is written for each layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import build_meaning
from .axes import PER_SLOT_EXPERTS, ROW_EXPERTS, SCATTERS

if TYPE_CHECKING:
    from .build import _Layer


def experts_and_combine(layer: _Layer, tokens: str, rank: int, weights: str, idx: str) -> str:
    """Write FC1, the activation, FC2 and the combine; returns the layer output."""
    c, g = layer.case, layer.g
    fc2_logical = layer.normal((c.experts_count, c.inter, c.hidden), 1.0 / np.sqrt(c.inter))
    fc1 = layer.fc1_weights()
    idx2 = idx
    if layer.mutation == "fc2_other_indices":
        shifted = g.node("Add", [idx, g.i64(1)], "ids_shifted")
        idx2 = g.node("Mod", [shifted, g.i64(c.experts_count)], "fc2_ids")
    if c.experts in PER_SLOT_EXPERTS:
        return _per_slot(layer, tokens, rank, weights, idx, idx2, fc1, fc2_logical)
    if c.experts in ROW_EXPERTS:
        return _rows(layer, tokens, weights, idx, idx2, fc1, fc2_logical)
    if c.experts == "top1_squeezed":
        return build_meaning.top1_squeezed(
            layer, tokens, weights, idx, idx2, fc1, fc2_logical, _fc1_outputs
        )
    return _dense(layer, tokens, weights, idx, fc1, fc2_logical)


def _fc1_outputs(layer: _Layer, fc1, project) -> str | tuple[str, str]:
    outs = []
    for key, w in fc1:
        outs.append(project(layer.weights_kn(f"{key}_weight", w, True), w.shape[2], key))
    return (outs[0], outs[1]) if len(outs) == 2 else outs[0]


# -- per slot ------------------------------------------------------------------------------


def _per_slot(layer: _Layer, tokens, rank, weights, idx, idx2, fc1, fc2_logical) -> str:
    c, g = layer.case, layer.g
    a = rank - 1  # the number of token axes
    ax = "t" if a == 1 else "bs"
    k = c.top_k

    def drop(mm: str, n: int, tag: str) -> str:
        if c.experts == "gather_reshape":
            return g.node("Reshape", [mm, g.i64(*([0] * (a + 1)), n)], f"{tag}_out")
        return g.node("Squeeze", [mm, g.i64(a + 1)], f"{tag}_out")

    def project_tokens(w: str, n: int, tag: str) -> str:
        sel = g.node("Gather", [w, idx], f"{tag}_selected", axis=0)  # [*, k, H, n]
        if c.experts == "einsum":
            return g.node("Einsum", [tokens, sel], f"{tag}_out", equation=f"{ax}h,{ax}khn->{ax}kn")
        lhs = g.node("Unsqueeze", [tokens, g.i64(a, a + 1)], f"{tag}_tokens")  # [*, 1, 1, H]
        lhs = g.node("Expand", [lhs, g.i64(*([1] * a), k, 1, 1)], f"{tag}_lhs")  # [*, k, 1, H]
        mm = g.node("MatMul", [lhs, sel], f"{tag}_matmul")
        mm = build_meaning.bias_before_drop(layer, mm, idx, n, tag, a)
        return build_meaning.bias_after_drop(layer, drop(mm, n, tag), idx, n, tag)

    act = layer.activation(_fc1_outputs(layer, fc1, project_tokens))
    w2 = layer.weights_kn("fc2_weight", fc2_logical, False)
    sel2 = g.node("Gather", [w2, idx2], "fc2_selected", axis=0)  # [*, k, I, H]
    if c.experts == "einsum":
        y = g.node("Einsum", [act, sel2], "fc2_out", equation=f"{ax}ki,{ax}kih->{ax}kh")
    else:
        lhs = g.node("Unsqueeze", [act, g.i64(a + 1)], "fc2_lhs")  # [*, k, 1, I]
        mm = g.node("MatMul", [lhs, sel2], "fc2_matmul")
        mm = build_meaning.bias_before_drop(layer, mm, idx2, c.hidden, "fc2", a)
        y = drop(mm, c.hidden, "fc2")
        y = build_meaning.bias_after_drop(layer, y, idx2, c.hidden, "fc2")
    return _combine_slots(layer, y, weights, a)


def _combine_slots(layer: _Layer, y: str, weights: str, a: int) -> str:
    """Combine per-slot outputs ``[*, k, H]`` with the weights ``[*, k]``."""
    c, g = layer.case, layer.g
    ax = "t" if a == 1 else "bs"
    if c.combine == "mul_reducesum":
        w3 = g.node("Unsqueeze", [weights, g.i64(-1)], "weights_3d")
        weighted = g.node("Mul", [y, w3], "weighted")
        return g.node("ReduceSum", [weighted, g.i64(a)], "moe_out", keepdims=0)
    if c.combine == "matmul_row":
        row = g.node("Unsqueeze", [weights, g.i64(a)], "weights_row")  # [*, 1, k]
        return g.node("Squeeze", [g.node("MatMul", [row, y], "combined"), g.i64(a)], "moe_out")
    if c.combine == "split_rows":
        return _slots_split_rows(layer, y, weights)
    return g.node("Einsum", [weights, y], "moe_out", equation=f"{ax}k,{ax}kh->{ax}h")


def _batch_dims(layer: _Layer) -> str:
    """``[B, S]`` of the layer input: constants in a static export, else ``Shape(x)[0:2]``."""
    c, g = layer.case, layer.g
    if c.shapes == "static":
        return g.i64(*c.token_dims)
    return g.node("Shape", ["x"], "x_batch_dims", start=0, end=2)


def _slots_split_rows(layer: _Layer, y: str, weights: str) -> str:
    """Flat per-slot outputs ``[T, k, H]`` mixed as ``[B, S, k, H]``, summed over ``k``."""
    c, g = layer.case, layer.g
    k, h = c.top_k, c.hidden
    bs = _batch_dims(layer)
    split_y = g.node("Concat", [bs, g.i64(k), g.i64(h)], "split_y_shape", axis=0)
    split_w = g.node("Concat", [bs, g.i64(k)], "split_w_shape", axis=0)
    y4 = g.node("Reshape", [y, split_y], "fc2_split")  # [B, S, k, H]
    w3 = g.node("Reshape", [weights, split_w], "weights_split")  # [B, S, k]
    w4 = g.node("Unsqueeze", [w3, g.i64(3)], "weights_split_1")  # [B, S, k, 1]
    weighted = g.node("Mul", [w4, y4], "weighted")  # the weights first, as some write it
    return g.node("ReduceSum", [weighted, g.i64(2)], "moe_out", keepdims=0)


# -- flattened rows (torch batched_mm) ------------------------------------------------------


def _rows(layer: _Layer, tokens, weights, idx, idx2, fc1, fc2_logical) -> str:
    c, g = layer.case, layer.g
    k, h = c.top_k, c.hidden

    def flat_ids(ids: str, tag: str) -> str:
        return g.node(
            "Unsqueeze", [g.node("Reshape", [ids, g.i64(-1)], f"{tag}_flat"), g.i64(-1)], tag
        )

    ids = flat_ids(idx, "row_ids")  # [T*k, 1]
    ids2 = ids if idx2 == idx else flat_ids(idx2, "fc2_row_ids")
    rows = build_meaning.repeat_rows(layer, tokens)  # [T*k, H], as the experts axis spells it

    def project(x: str, w: str, sel_ids: str, tag: str) -> str:
        sel = g.node("GatherND", [w, sel_ids], f"{tag}_selected")  # [T*k, K, N]
        mm = g.node(
            "MatMul", [g.node("Unsqueeze", [x, g.i64(1)], f"{tag}_row"), sel], f"{tag}_matmul"
        )
        return g.node("Squeeze", [mm, g.i64(1)], f"{tag}_out")  # [T*k, N]

    act = layer.activation(_fc1_outputs(layer, fc1, lambda w, n, tag: project(rows, w, ids, tag)))
    y = project(act, layer.weights_kn("fc2_weight", fc2_logical, False), ids2, "fc2")
    if c.combine in SCATTERS:
        return build_meaning.scatter_combine(layer, tokens, y, weights)
    if c.combine == "mul_reducesum":
        w_rows = g.node(
            "Unsqueeze",
            [g.node("Reshape", [weights, g.i64(-1)], "weights_flat"), g.i64(-1)],
            "weights_rows",
        )
        weighted = g.node(
            "Reshape", [g.node("Mul", [y, w_rows], "weighted_rows"), g.i64(-1, k, h)], "weighted"
        )
        return g.node("ReduceSum", [weighted, g.i64(1)], "moe_out", keepdims=0)
    slots = g.node("Reshape", [y, g.i64(-1, k, h)], "fc2_slots")
    return _combine_slots(layer, slots, weights, 1)


# -- dense: every expert on every token ----------------------------------------------------


def _dense(layer: _Layer, tokens, weights, idx, fc1, fc2_logical) -> str:
    c, g = layer.case, layer.g
    e = c.experts_count

    def project(w: str, n: int, tag: str) -> str:
        return g.node("MatMul", [tokens, w], f"{tag}_out")  # [T, H] @ [E, H, n] -> [E, T, n]

    act = layer.activation(_fc1_outputs(layer, fc1, project))
    w2 = layer.weights_kn("fc2_weight", fc2_logical, False)
    y = g.node("MatMul", [act, w2], "fc2_out")  # [E, T, H]
    if c.experts == "dense_onehot":
        values = g.init("onehot_values", np.array([0.0, 1.0], dtype=np.float32))
        mask = g.node("OneHot", [idx, g.i64(e), values], "expert_mask", axis=-1)  # [T, k, E]
    else:
        hit = g.node(
            "Equal",
            [
                g.node("Unsqueeze", [idx, g.i64(-1)], "ids_3d"),
                g.init("expert_range", np.arange(e, dtype=np.int64)),
            ],
            "expert_hit",
        )
        mask = g.node("Cast", [hit], "expert_mask", to=1)
    w3 = g.node("Unsqueeze", [weights, g.i64(-1)], "weights_3d")
    dense = g.node(
        "ReduceSum", [g.node("Mul", [mask, w3], "masked"), g.i64(1)], "dense_weights", keepdims=0
    )
    if c.combine == "mul_reducesum":
        per_expert = g.node(
            "Unsqueeze",
            [g.node("Transpose", [dense], "dense_et", perm=[1, 0]), g.i64(-1)],
            "dense_et1",
        )
        return g.node(
            "ReduceSum",
            [g.node("Mul", [y, per_expert], "weighted"), g.i64(0)],
            "moe_out",
            keepdims=0,
        )
    if c.combine == "matmul_row":
        row = g.node("Unsqueeze", [dense, g.i64(1)], "dense_row")  # [T, 1, E]
        y_t = g.node("Transpose", [y], "fc2_by_token", perm=[1, 0, 2])  # [T, E, H]
        return g.node("Squeeze", [g.node("MatMul", [row, y_t], "combined"), g.i64(1)], "moe_out")
    if c.combine == "split_rows":
        return _dense_split_rows(layer, y, dense)
    return g.node("Einsum", [dense, y], "moe_out", equation="te,eth->th")


def _dense_split_rows(layer: _Layer, y: str, dense: str) -> str:
    """optimum's dense gpt-oss mix: over ``[E, B, S, H]``, targets from ``Shape(x)`` or static.

    ``y [E, T, H]`` and the transposed weights ``[E, T]`` are split into ``[E, B, -1, ...]``,
    the batch ``B`` read from the layer input (a constant in a static export), then multiplied
    and summed over the experts: ``[B, S, H]``.
    """
    c, g = layer.case, layer.g
    e, h = c.experts_count, c.hidden
    if c.shapes == "static":
        batch = g.i64(c.token_dims[0])
    else:
        index = g.init("batch_index", np.array(0, dtype=np.int64))  # a scalar: B, not [B]
        first = g.node("Gather", [g.node("Shape", ["x"], "x_dims"), index], "batch", axis=0)
        batch = g.node("Unsqueeze", [first, g.i64(0)], "batch_1d")
    split_y = g.node("Concat", [g.i64(e), batch, g.i64(-1), g.i64(h)], "split_y_shape", axis=0)
    split_w = g.node("Concat", [g.i64(e), batch, g.i64(-1)], "split_w_shape", axis=0)
    y4 = g.node("Reshape", [y, split_y], "fc2_split")  # [E, B, S, H]
    per_expert = g.node("Transpose", [dense], "dense_et", perm=[1, 0])  # [E, T]
    w3 = g.node("Reshape", [per_expert, split_w], "dense_split")  # [E, B, S]
    w4 = g.node("Unsqueeze", [w3, g.i64(3)], "dense_split_1")  # [E, B, S, 1]
    weighted = g.node("Mul", [y4, w4], "weighted")
    return g.node("ReduceSum", [weighted, g.i64(0)], "moe_out", keepdims=0)
