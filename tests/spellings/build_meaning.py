"""The spellings issue 18 names, for the generator (split out of ``build.py``/``build_experts.py``).

* activations written out by hand in elementary ops (``silu_exp``, ``swiglu_exp``,
  ``gelu_tanh_hand``) and their mutation ``silu_off`` (``Exp(-1.1 h)``);
* the ``T*k`` token rows repeated by Tile, by a Gather of ``Range(T*k) // k`` or by a Concat of
  k copies (``rows_tile``, ``rows_range``, ``rows_concat``), and the mutation
  ``rows_other_token`` (rows gathered by ``Range(T*k) % T``);
* scatter combines of the weighted rows (``scatter_elements``, ``scatter_nd``, reduction add),
  and the mutation ``scatter_other_token`` (each token's last slot added into the next token);
* per-expert FC1/FC2 biases of three ranks (``axes.BIASES``) and the mutation
  ``bias_other_ids`` (the biases gathered by ``(ids + 1) mod E``);
* k = 1 with the slot axis squeezed away (``top1_squeezed``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from onnx import numpy_helper

if TYPE_CHECKING:
    from .build import _Layer


# -- activations --------------------------------------------------------------------------------


def _exp_silu(layer: _Layer, v: str, sig_in: str) -> str:
    """``v / (1 + Exp(-sig_in))`` (``silu_off``: ``Exp(-1.1 sig_in)``).

    The offset is 10 %: 1.01 moved the output by about 0.4 %, under the 8 float16 ulp (0.8 %)
    that the behaviour check allows a float16 layer, whose twin then fused as SiLU.
    """
    g = layer.g
    neg = g.node("Neg", [sig_in], "silu_neg")
    if layer.mutation == "silu_off":
        neg = g.node("Mul", [neg, g.f32(1.1)], "silu_neg_off")
    den = g.node("Add", [g.f32(1.0), g.node("Exp", [neg], "silu_exp")], "silu_den")
    return g.node("Div", [v, den], "silu")


def activation(layer: _Layer, h: str) -> str:
    """The hand-written activations of :data:`~.axes.ACTIVATIONS` on FC1's output ``h``."""
    c, g = layer.case, layer.g
    if c.activation == "silu_exp":
        return _exp_silu(layer, h, h)
    if c.activation == "swiglu_exp":
        i = c.inter
        gate, up = g.node("Split", [h, g.i64(i, i)], "fc1_half", outputs=2, axis=-1)
        x = up if layer.mutation == "swap_gate_up" else gate  # up * sigmoid(gate) * up
        return g.node("Mul", [_exp_silu(layer, x, gate), up], "act")
    assert c.activation == "gelu_tanh_hand", c.activation
    cube = g.node("Pow", [h, g.f32(3.0)], "gelu_cube")
    inner = g.node("Add", [h, g.node("Mul", [cube, g.f32(0.044715)], "gelu_c3")], "gelu_inner")
    arg = g.node("Mul", [inner, g.f32(math.sqrt(2.0 / math.pi))], "gelu_arg")
    one_plus = g.node("Add", [g.node("Tanh", [arg], "gelu_tanh"), g.f32(1.0)], "gelu_1p")
    return g.node("Mul", [g.node("Mul", [h, g.f32(0.5)], "gelu_half"), one_plus], "act")


# -- token rows ------------------------------------------------------------------------------


def _range_rows(layer: _Layer, tokens: str, hint: str) -> str:
    """``Range(0, T*k)`` (int64), T read from ``Shape(tokens)``."""
    g, k = layer.g, layer.case.top_k
    t = g.node("Shape", [tokens], f"{hint}_t", start=0, end=1)
    n = g.node("Squeeze", [g.node("Mul", [t, g.i64(k)], f"{hint}_n1")], f"{hint}_n")
    zero = g.init(f"{hint}_start", np.array(0, np.int64))
    one = g.init(f"{hint}_step", np.array(1, np.int64))
    return g.node("Range", [zero, n, one], f"{hint}_r")


def token_of_row(layer: _Layer, tokens: str) -> str:
    """``Range(T*k) // k``: the token of every flat row."""
    g, k = layer.g, layer.case.top_k
    return g.node("Div", [_range_rows(layer, tokens, "rows"), g.i64(k)], "token_of_row")


def _scatter_token_of_row(layer: _Layer, tokens: str) -> str:
    """The token each weighted row is added into: its own (``token_of_row``).

    ``scatter_other_token``: the token of the next row, ``((r + 1) mod T*k) // k``, so each
    token's last slot goes into the next token (the last token's into token 0) and its other
    slots stay. Shifting whole tokens instead (``r // k + 1 mod T``) would only roll the
    finished per-token sums: the layer, then a permutation of its rows, which one fused node
    followed by the scatter computes (at k = 1 the rows before the scatter are the whole layer,
    and the fuser rightly fused it so); a slot moved alone is no layer of one node.
    """
    if layer.mutation != "scatter_other_token":
        return token_of_row(layer, tokens)
    g, k = layer.g, layer.case.top_k
    t = g.node("Shape", [tokens], "rows_tokens", start=0, end=1)
    rows = g.node("Mul", [t, g.i64(k)], "rows_count")
    r = _range_rows(layer, tokens, "rows")
    nxt = g.node("Mod", [g.node("Add", [r, g.i64(1)], "row_next"), rows], "row_wrapped")
    return g.node("Div", [nxt, g.i64(k)], "token_of_next_row")


def repeat_rows(layer: _Layer, tokens: str) -> str:
    """The tokens ``[T, H]`` repeated k times as rows ``t*k + j``: ``[T*k, H]``."""
    c, g = layer.case, layer.g
    k, h = c.top_k, c.hidden
    if layer.mutation == "rows_other_token":  # row r reads token r mod T
        t = g.node("Shape", [tokens], "rows_t_mod", start=0, end=1)
        picked = g.node("Mod", [_range_rows(layer, tokens, "rows_all"), t], "rows_token_mod")
        return g.node("Gather", [tokens, picked], "rows", axis=0)
    if c.experts == "rows_tile":
        return g.node("Reshape", [g.node("Tile", [tokens, g.i64(1, k)], "tiled"), g.i64(-1, h)],
                      "rows")  # fmt: skip
    if c.experts == "rows_range":
        return g.node("Gather", [tokens, token_of_row(layer, tokens)], "rows", axis=0)
    if c.experts == "rows_concat":
        copies = g.node("Concat", [tokens] * k, "copies", axis=1)
        return g.node("Reshape", [copies, g.i64(-1, h)], "rows")
    rep = g.node(
        "Expand", [g.node("Unsqueeze", [tokens, g.i64(1)], "tokens_3d"), g.i64(1, k, 1)],
        "tokens_rep",
    )  # fmt: skip
    return g.node("Reshape", [rep, g.i64(-1, h)], "rows")


def scatter_combine(layer: _Layer, tokens: str, y: str, weights: str) -> str:
    """The rows ``y [T*k, H]`` times their weights, summed into their tokens by a scatter."""
    c, g = layer.case, layer.g
    w_rows = g.node("Reshape", [weights, g.i64(-1, 1)], "weights_rows")
    weighted = g.node("Mul", [y, w_rows], "weighted_rows")
    zeros = g.node(
        "ConstantOfShape",
        [g.node("Shape", [tokens], "out_shape")],
        "zeros",
        value=numpy_helper.from_array(np.zeros(1, np.float32)),
    )
    tok = _scatter_token_of_row(layer, tokens)
    if c.combine == "scatter_elements":
        col = g.node("Unsqueeze", [tok, g.i64(1)], "token_col")
        index = g.node("Expand", [col, g.node("Shape", [weighted], "rows_shape")], "token_index")
        return g.node(
            "ScatterElements", [zeros, index, weighted], "moe_out", axis=0, reduction="add"
        )
    index = g.node("Unsqueeze", [tok, g.i64(-1)], "token_nd")
    return g.node("ScatterND", [zeros, index, weighted], "moe_out", reduction="add")


# -- biases --------------------------------------------------------------------------------------


def _bias_ids(layer: _Layer, idx: str) -> str:
    if layer.mutation != "bias_other_ids":
        return idx
    g = layer.g
    shifted = g.node("Add", [idx, g.i64(1)], "bias_ids_shifted")
    return g.node("Mod", [shifted, g.i64(layer.case.experts_count)], "bias_ids")


def _bias(layer: _Layer, tag: str, n: int) -> np.ndarray:
    b = layer.normal((layer.case.experts_count, n), 0.1)
    layer.params[f"{tag}_bias"] = b
    return b


def bias_before_drop(layer: _Layer, mm: str, idx: str, n: int, tag: str, a: int) -> str:
    """Add a ``[*, k, 1, N]`` bias to the per-slot MatMul (biases ``en_unsqueeze``, ``e1n``)."""
    c, g = layer.case, layer.g
    if c.bias not in ("en_unsqueeze", "e1n"):
        return mm
    b = _bias(layer, tag, n)
    ids = _bias_ids(layer, idx)
    if c.bias == "en_unsqueeze":
        sel = g.node("Gather", [g.init(f"{tag}_bias", b), ids], f"{tag}_bias_sel", axis=0)
        sel = g.node("Unsqueeze", [sel, g.i64(a + 1)], f"{tag}_bias_4d")
    else:
        sel = g.node("Gather", [g.init(f"{tag}_bias", b[:, None, :]), ids], f"{tag}_bias_4d",
                     axis=0)  # fmt: skip
    return g.node("Add", [mm, sel], f"{tag}_biased")


def bias_after_drop(layer: _Layer, out: str, idx: str, n: int, tag: str) -> str:
    """Add a ``[*, k, N]`` bias after the unit axis is dropped (bias ``after_reshape``)."""
    c, g = layer.case, layer.g
    if c.bias != "after_reshape":
        return out
    b = _bias(layer, tag, n)
    sel = g.node("Gather", [g.init(f"{tag}_bias", b), _bias_ids(layer, idx)], f"{tag}_bias_sel",
                 axis=0)  # fmt: skip
    return g.node("Add", [out, sel], f"{tag}_biased")


# -- k = 1, the slot axis squeezed ------------------------------------------------------------


def top1_squeezed(layer: _Layer, tokens, weights, idx, idx2, fc1, fc2_logical, fc1_outputs) -> str:
    """k = 1: ids ``Squeeze``-d to ``[T]``, weights gathered ``[T, K, N]``, output times ``w``."""
    g = layer.g
    ids = g.node("Squeeze", [idx, g.i64(1)], "expert_of_token")
    ids2 = ids if idx2 == idx else g.node("Squeeze", [idx2, g.i64(1)], "fc2_expert_of_token")

    def project(x: str, w: str, sel_ids: str, tag: str) -> str:
        sel = g.node("Gather", [w, sel_ids], f"{tag}_selected", axis=0)  # [T, K, N]
        row = g.node("Unsqueeze", [x, g.i64(1)], f"{tag}_row")  # [T, 1, K]
        return g.node("Squeeze", [g.node("MatMul", [row, sel], f"{tag}_mm"), g.i64(1)],
                      f"{tag}_out")  # fmt: skip

    act = layer.activation(fc1_outputs(layer, fc1, lambda w, n, tag: project(tokens, w, ids, tag)))
    y = project(act, layer.weights_kn("fc2_weight", fc2_logical, False), ids2, "fc2")
    return g.node("Mul", [y, weights], "moe_out")  # [T, H] * [T, 1]
