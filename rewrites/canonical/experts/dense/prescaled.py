"""Read Llama4's dense experts, whose router score scales each expert's *input*.

transformers' ``Llama4TextMoe`` runs every expert on every token and routes by scaling the
expert's input rows, not its output::

    vals, idx = TopK(logits [T, E], k)
    S = g(ScatterElements(fill c of [T, E], idx, vals))     g: Sigmoid (Cast, Identity, Relu)
    routed_in = Tile(x, [E, 1]) * Reshape(Transpose(S), [-1, 1])     row e*T + t: x_t * S[t, e]
    Y = FFN(Reshape(routed_in, [E, -1, H]))                 one MLP over stacked [E, K, N]
    out = ReduceSum(Y, [0], keepdims=0)                     [T, H]

With ``g(c) = 0`` (``sigmoid(-inf)``) the experts not selected read zero rows; when every
expert maps a zero row to zero (no biases and an activation that is 0 at 0, evaluated here)
they add nothing, and with ``k = 1`` the layer is ``out_t = FFN_{idx_t}(x_t * S[t, idx_t])``:
the per-slot layer over the scaled tokens ``x' = x * GatherElements(S, idx)`` with the weight
``Softmax(vals)`` over the one slot, which is exactly 1. :func:`read_prescaled` proves that
and returns the layer for :class:`~.emit.Emitter` with :class:`Prescale` telling it to scale
the tokens. With ``k > 1`` a token enters k experts at k different scales, which one input
row per token cannot carry: refused, naming the router. Exact for finite tokens (an infinite
token times a zero score is NaN in the model's unselected experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.dense.combine import Combine
from onnx_moe_fuse.rewrites.canonical.experts.dense.consts import (
    STD,
    const_ints,
    consumers,
    is_op,
    node_axes,
    only_consumer,
    other_operand,
)
from onnx_moe_fuse.rewrites.canonical.experts.dense.ffn import ExpertMLP, read_mlp
from onnx_moe_fuse.rewrites.canonical.experts.dense.mask import DenseWeights, fill_like_scores
from onnx_moe_fuse.rewrites.canonical.experts.dense.routing import Routing, read_routing
from onnx_moe_fuse.rewrites.canonical.experts.dense.zero_rows import maps_zero_to_zero
from onnx_moe_fuse.rewrites.graph.facts import attr_int, attr_str, label
from onnx_moe_fuse.rewrites.graph.refusals import Refusal, part

__all__ = ["Prescale", "read_prescaled"]

#: Element-wise ops allowed between the scatter and the scores S (``g``), with numpy meanings.
_SCORE_MAPS = {
    "Sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)),
    "Relu": lambda v: np.maximum(v, 0),
    "Identity": lambda v: v,
    "Cast": lambda v: v,
}


@dataclass(frozen=True)
class Prescale:
    """The tokens are scaled by ``scores`` gathered at the selection before the experts."""

    scores: ir.Value  # S [T, E], or the scatter before g when ``maps`` holds g
    values: ir.Value  # the TopK's values (softmaxed over the one slot: weight 1)
    sum_type: int | None = None  # the float type a widening Cast before the sum gives it
    # g's element-wise nodes, to apply to the gathered scores: the export transposed before g,
    # so S [T, E] is never computed (only S^T), and g is copied onto the gathered [T, 1]
    maps: tuple[ir.Node, ...] = ()


def _score_chain(scatter: ir.Node) -> tuple[ir.Value, list[ir.Node], ir.Node | None]:
    """Follow the single-use element-wise ops ``g`` from the scatter to the scores.

    ``(scores, g's nodes, transpose)``: transformers transposes the scattered scores *before*
    the sigmoid (``scatter(...).transpose(0, 1)``, then ``sigmoid``); an element-wise ``g``
    commutes with the transpose, so a ``Transpose [1, 0]`` inside the chain is taken too and
    returned apart, and the scores are then ``S^T [E, T]``.
    """
    value, chain, transpose = scatter.outputs[0], [], None
    while True:
        users = consumers(value)
        if len(users) != 1 or users[0].domain not in STD:
            return value, chain, transpose
        user = users[0]
        if transpose is None and is_op(user, "Transpose") and _swaps_axes(user):
            # only mid-chain: a Transpose right before the column is the [T, E] form's
            if consumers(user.outputs[0]) and _continues_chain(user.outputs[0]):
                transpose, value = user, user.outputs[0]
                continue
            return value, chain, transpose
        if user.op_type not in _SCORE_MAPS:
            return value, chain, transpose
        if user.op_type == "Cast" and attr_int(user, "to", 0) not in (1, 10, 11, 16):
            return value, chain, transpose
        chain.append(user)
        value = user.outputs[0]


def _swaps_axes(node: ir.Node) -> bool:
    perm = node.attributes.get("perm")
    return perm is not None and list(perm.as_ints()) == [1, 0]


def _continues_chain(value: ir.Value) -> bool:
    """The one consumer of ``value`` is an element-wise ``g`` op (the chain goes on)."""
    users = consumers(value)
    return len(users) == 1 and users[0].op_type in _SCORE_MAPS and users[0].domain in STD


def _scatter_of_selection(routing: Routing) -> ir.Node | None:
    users = [n for n in consumers(routing.indices) if is_op(n, "ScatterElements")]
    if len(users) != 1:
        return None
    sc = users[0]
    if (
        len(sc.inputs) < 3
        or sc.inputs[1] is not routing.indices
        or sc.inputs[2] is not routing.values
    ):
        return None
    return sc


def _column_of(scores: ir.Value, transposed: bool) -> tuple[ir.Value, list[ir.Node]]:
    """``Reshape(Transpose(S, [1, 0]), [-1, 1])``: S column-major as ``[E*T, 1]``.

    ``transposed``: ``scores`` is ``S^T`` already (the Transpose came before ``g``).
    """
    if transposed:
        col_nodes, scores_t = [], scores
    else:
        tr = only_consumer(scores, "the router scores S")
        if not is_op(tr, "Transpose") or not _swaps_axes(tr):
            raise Refusal(f"{label(tr)}: the scores S are not transposed to [E, T]", tr)
        col_nodes, scores_t = [tr], tr.outputs[0]
    rs = only_consumer(scores_t, "the transposed scores")
    one_token = scores_t.shape is not None and list(scores_t.shape)[1:] == [1]
    if not is_op(rs, "Reshape") and one_token:
        return scores_t, col_nodes  # one token: [1, E] transposed is the column already
    target = const_ints(rs.inputs[1]) if is_op(rs, "Reshape") else None
    # [-1, 1], or [n, 1] with n fixed (a static export): a Reshape of E*T elements to [n, 1]
    # runs only for n = E*T, so on every input the model runs on, it is the column
    if (
        target is None
        or len(target) != 2
        or target[1] != 1
        or not (target[0] == -1 or target[0] > 0)
    ):
        raise Refusal(f"{label(rs)}: the [E, T] scores are not flattened to [E*T, 1]", rs)
    return rs.outputs[0], [*col_nodes, rs]


def _repeated_tokens(value: ir.Value | None, tokens: ir.Value, experts: int) -> list[ir.Node]:
    """``Tile(x, [E, 1])`` (x under a no-op ``Expand(x, [1, 1])``): E copies of the rows."""
    tile = value.producer() if value is not None else None
    if _one_row_expanded(tile, experts):  # one token: the Tile became an Expand
        pass  # Expand of [1, H] to [E, *]: E copies of the row, as Tile [E, 1] makes
    elif not is_op(tile, "Tile") or const_ints(tile.inputs[1]) != [experts, 1]:
        raise Refusal("the scaled rows are not the tokens tiled E times (Tile [E, 1])", value)
    nodes, inner = [tile], tile.inputs[0]
    expand = inner.producer() if inner is not None else None
    if is_op(expand, "Expand") and set(const_ints(expand.inputs[1]) or [0]) == {1}:
        if len(const_ints(expand.inputs[1])) <= 2:
            nodes.append(expand)
            inner = expand.inputs[0]
    if inner is not tokens:
        raise Refusal(
            f"{label(tile)} tiles '{inner.name if inner else None}', not the router's tokens", tile
        )
    return nodes


def _one_row_expanded(node: ir.Node | None, experts: int) -> bool:
    """``Expand(x [1, H], [E, 1 | H])``: what the spelling pass makes of Tile [E, 1] at T = 1."""
    if not is_op(node, "Expand") or node.inputs[0] is None:
        return False
    shape, src = const_ints(node.inputs[1]), node.inputs[0].shape
    if shape is None or src is None or len(src) != 2 or src[0] != 1:
        return False
    return len(shape) == 2 and shape[0] == experts and shape[1] in (1, src[1])


def read_prescaled(
    topk: ir.Node,
) -> tuple[Routing, DenseWeights, Combine, ExpertMLP, Prescale] | None:
    """The input-scaled dense layer routed by ``topk``; None when ``topk`` routes no such layer.

    Recognised by its mask: the selection scattered into a fill ``c`` of the scores' shape,
    mapped by ``g`` with ``g(c) = 0``, scaling E tiled copies of the tokens. Once that is seen,
    every other failure is a :class:`Refusal` naming the part.
    """
    if topk.op_type != "TopK" or topk.domain not in STD or len(topk.outputs) < 2:
        return None
    try:
        routing = read_routing(topk)
    except Refusal:
        return None
    scatter = _scatter_of_selection(routing)
    if scatter is None or attr_str(scatter, "reduction", "none") != "none":
        return None
    if attr_int(scatter, "axis", 0) not in (1, -1):
        return None
    fill = fill_like_scores(scatter.inputs[0], routing)
    if fill is None:
        return None
    scores, chain, transpose = _score_chain(scatter)
    g_fill = np.asarray(fill, dtype=np.float32)
    with np.errstate(over="ignore"):
        for n in chain:
            g_fill = _SCORE_MAPS[n.op_type](g_fill)
    if not np.all(g_fill == 0):
        return None
    users = consumers(scores)
    next_op = "Reshape" if transpose is not None else "Transpose"
    if len(users) != 1 or not is_op(users[0], next_op):
        return None
    gathered = (scatter.outputs[0], tuple(chain)) if transpose is not None else (scores, ())
    return _prove(routing, scores, transpose is not None, gathered)


def _prove(
    routing: Routing,
    scores: ir.Value,
    transposed: bool,
    gathered: tuple[ir.Value, tuple[ir.Node, ...]],
):
    e = routing.experts
    with part("routing"):
        routing.require_selection()
        if routing.k != 1:
            raise Refusal(
                f"the router scores scale each expert's input and TopK '{label(routing.topk)}' "
                f"selects k = {routing.k}: a token enters k experts at k different scales, "
                "which a fused node (one input row per token) cannot express",
                routing.topk,
            )
        if routing.tokens is None:
            raise Refusal(
                f"cannot read the router behind TopK '{label(routing.topk)}'", routing.topk
            )
    with part("combine"):
        column, col_nodes = _column_of(scores, transposed)
        mul = only_consumer(column, "the scores column")
        if not is_op(mul, "Mul"):
            raise Refusal(f"{label(mul)}: the scores column does not scale the tokens", mul)
        tiled = other_operand(mul, column)
        tile_nodes = _repeated_tokens(tiled, routing.tokens, e)
        view = only_consumer(mul.outputs[0], "the scaled rows")
        shape = const_ints(view.inputs[1]) if is_op(view, "Reshape") else None
        if is_op(view, "Unsqueeze") and node_axes(view) in ([1], [-2]) and e > 1:
            # one token: the Reshape to [E, 1, H] became an Unsqueeze ([E*T, 1, H] batches
            # against [E, H, N] weights run only for E*T = E when E > 1)
            shape = [e, 1, -1]
        # [E, -1, H], or [E, n, H] with n fixed: it runs only for n = T (the rows are E*T)
        if (
            shape is None
            or len(shape) != 3
            or shape[0] != e
            or not (shape[1] == -1 or shape[1] > 0)
        ):
            raise Refusal(f"{label(view)}: the scaled rows are not regrouped to [E, T, H]", view)
        root = _sum_over_experts(view.outputs[0])
    y = root.inputs[0]
    combine_nodes = [root]
    inner = y.producer() if y is not None else None
    sum_type = None
    if is_op(inner, "Cast") and _widens(inner):  # a half-precision export sums in float32
        sum_type = attr_int(inner, "to", 0)
        combine_nodes.append(inner)
        y = inner.inputs[0]
        inner = y.producer() if y is not None else None
    regroup = None  # the target of the Reshape nearest the sum, if any
    while is_op(inner, "Reshape"):  # TorchScript: view(-1, H), then reshape(E, -1, H)
        regroup = const_ints(inner.inputs[1]) if regroup is None else regroup
        combine_nodes.append(inner)
        y = inner.inputs[0]
        inner = y.producer() if y is not None else None
    mlp = read_mlp(y, rank=3)
    with part("combine"):
        _check_regroup(regroup, e, mlp, root)
    with part("fc1"):
        for p in mlp.fc1:
            if p.lhs is not view.outputs[0]:
                raise Refusal("an FC1 projection does not read the scaled token rows", p.nodes[0])
            if len(p.weight.shape) != 3 or p.weight.shape[0] != e:
                raise Refusal(
                    f"stacked weights {p.weight.shape} are not [E = {e}, K, N]", p.nodes[0]
                )
    with part("fc2"):
        if len(mlp.fc2.weight.shape) != 3 or mlp.fc2.weight.shape[0] != e:
            raise Refusal(
                f"stacked weights {mlp.fc2.weight.shape} are not [E, K, N]", mlp.fc2.nodes[0]
            )
    with part("activation"):
        if not maps_zero_to_zero(mlp):
            raise Refusal(
                "the unselected experts read zero rows, and an expert does not map a zero row "
                "to zero (a bias, or an activation that is not 0 at 0): they would add to the "
                "output, which a fused node does not compute",
                mlp.fc2.nodes[0],
            )
    mask = DenseWeights(routing.values, None, None, [*col_nodes, mul, *tile_nodes, view])
    combine = Combine(root, None, y, combine_nodes)
    return routing, mask, combine, mlp, Prescale(gathered[0], routing.values, sum_type, gathered[1])


def _check_regroup(regroup: list[int] | None, experts: int, mlp: ExpertMLP, root: ir.Node):
    """The Reshapes between the experts' ``[E, T, N]`` output and the sum give it back.

    A Reshape keeps the elements' row-major order, so a chain of them is the identity when
    the last target is ``[E, -1 | n, N]`` with the experts' E and N (the middle is then T).
    """
    if regroup is None:
        return
    n = mlp.fc2.weight.shape[-1]
    if (
        len(regroup) != 3
        or regroup[0] != experts
        or regroup[2] != n
        or not (regroup[1] == -1 or regroup[1] > 0)
    ):
        raise Refusal(
            f"{label(root)}: the experts' outputs are not regrouped to [E, T, N] before the sum",
            root,
        )


_WIDER = {ir.DataType.FLOAT16: {1, 11}, ir.DataType.BFLOAT16: {1, 11}, ir.DataType.FLOAT: {11}}


def _widens(cast: ir.Node) -> bool:
    """A Cast to a float type that holds every value of its input's (float16 -> float32)."""
    src = cast.inputs[0]
    return src is not None and attr_int(cast, "to", 0) in _WIDER.get(src.dtype, set())


def _sum_over_experts(grouped: ir.Value) -> ir.Node:
    """The ``ReduceSum(Y, [0], keepdims=0)`` after the MLP of ``grouped`` (found downstream)."""
    todo, seen = [grouped], set()
    while todo:
        v = todo.pop()
        for user in consumers(v):
            if id(user) in seen:
                continue
            seen.add(id(user))
            if is_op(user, "ReduceSum") and node_axes(user) == [0]:
                if attr_int(user, "keepdims", 1) != 0:
                    raise Refusal(
                        f"{label(user)}: the sum over experts keeps the expert axis", user
                    )
                return user
            todo.extend(user.outputs)
    raise Refusal("no sum over the expert axis after the experts", grouped)
