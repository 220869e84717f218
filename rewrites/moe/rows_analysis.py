"""The proofs behind the flattened-rows MoE layer rules (torch.onnx ``batched_mm`` exports).

transformers' ``batched_mm`` experts, exported by torch.onnx (dynamo), compute a layer on
``R = T*k`` flattened (token, slot) rows instead of ``[T, k, ...]`` slots::

    rows     = Reshape(Expand(Unsqueeze(x, [1]), [1, k, 1]), [-1, H])     (or Tile: [1, k, 1])
    ids      = Unsqueeze(Reshape(topk_indices, [-1]), [-1])                [R, 1]
    fc(a)    = Squeeze(MatMul(GatherND(W[E, N, K], ids), Unsqueeze(a, [-1])), [-1])
             | Squeeze(MatMul(Unsqueeze(a, [1]), GatherND(W[E, K, N], ids)), [1])
               (+ GatherND(b[E, N], ids), then maybe Squeeze(Unsqueeze(_, [1]), [1]))
    out      = ReduceSum(Reshape(Mul(fc2(act(fc1(rows))), Unsqueeze(Reshape(w, [-1]), [-1])),
                                 [-1, k, H]), [1], keepdims=0)

:func:`analyse_rows_layer` proves each of these structural constants (row ``t*k + j`` is token
``t``'s slot ``j`` everywhere: in the repeated tokens, the flattened ids, the flattened weights
and the un-flattening before the sum), then reuses the per-slot analysis for everything else:
the routing form (:func:`~.analysis.routing_form`), the weights and biases
(:func:`~.analysis.expert_weights`, which reads ``[E, N, K]`` weights as their K-major
transpose), sizes, activation, target and escapes (:func:`~.analysis.finish_layer`).
Like :func:`~.analysis.analyse_layer`, it is a pure function of the graph and the bindings
and raises a :class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` with a plain-words reason.

The token count ``T`` is a symbol (the proofs hold for every ``T``) unless the graph fixes it
(a static export: the tokens, router scores or top-k values have a concrete first dim); then it
is that number, and a concrete Reshape target, Expand shape or row count is accepted exactly when
it equals what the proof needs (``[16]`` flattens the ``[8, 2]`` top-k ids, ``[12]`` does not).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.dims import Dim, reshape_dims
from onnx_moe_fuse.rewrites.graph.facts import (
    attr_int,
    const_ints,
    default_opset,
    label,
    node_axes,
    normalize_axes,
    static_rank,
    value_label,
)
from onnx_moe_fuse.rewrites.graph.refusals import Refusal, part
from onnx_moe_fuse.rewrites.graph.symbolic_dims import value_dims
from onnx_moe_fuse.rewrites.moe.analysis import (
    FC1_PROJECTIONS,
    ExpertWeights,
    LayerPlan,
    bound_node,
    combine_step,
    expert_bias,
    expert_weights,
    finish_layer,
    routing_form,
    with_bias,
)
from onnx_moe_fuse.rewrites.moe.quantize import Quantization
from onnx_moe_fuse.rewrites.moe.selected_weights import same_indices

__all__ = ["analyse_rows_layer"]

#: The symbolic token count of the proofs (any value: every proof holds for all of them).
_T = Dim.sym("T")


def _token_count(b: Mapping[str, Any]) -> Dim:
    """``T``: the first dim of the tokens, router scores or top-k values where the graph fixes it.

    All three have ``T`` rows (the routing proof ties the scores to the tokens), so a concrete
    size of any of them is the layer's token count; otherwise ``T`` stays a symbol.
    """
    for name in ("tokens", "router_scores", "topk_values"):
        dims = value_dims(b.get(name))
        if dims and not dims[0].syms:
            return dims[0]
    return _T


def _reshape_to(node: ir.Node, dims_in: list[Dim], want: list[Dim], what: str) -> None:
    """Prove that Reshape ``node`` maps a ``dims_in`` tensor to ``want``; refuse otherwise.

    An ``Unsqueeze`` counts as the Reshape it is (shape folding writes a Reshape that only
    inserts unit axes, ``[T*1, H] -> [T, 1, H]`` at k = 1, as one): its axes insert ones.
    """
    if node.op_type == "Unsqueeze":
        axes = node_axes(node)
        rank = len(dims_in) + len(axes or [])
        norm = normalize_axes(axes, rank) if axes else None
        got = None
        if norm is not None:
            rest = iter(dims_in)
            got = [Dim.of(1) if i in norm else next(rest) for i in range(rank)]
        if got != want:
            raise Refusal(
                f"Unsqueeze '{label(node)}' (axes {axes}) does not {what} (from "
                f"{_dims(dims_in)} it must make {_dims(want)}{_got(got)})",
                node,
            )
        return
    shape = const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
    got = None
    if shape is not None:
        got = reshape_dims(dims_in, shape, attr_int(node, "allowzero", 0) or 0)
    if got != want:
        raise Refusal(
            f"Reshape '{label(node)}' (shape {shape}) does not {what} (from {_dims(dims_in)} "
            f"it must make {_dims(want)}{_got(got)})",
            node,
        )


def _dims(dims: list[Dim]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _got(got: list[Dim] | None) -> str:
    return "" if got is None else f", not {_dims(got)}"


def _axes_are(node: ir.Node, rank: int, want: list[int], what: str) -> None:
    """Prove that the Unsqueeze/Squeeze/ReduceSum ``node`` has exactly the axes ``want``."""
    axes = node_axes(node)
    if axes is None or normalize_axes(axes, rank) != want:
        raise Refusal(f"{node.op_type} '{label(node)}' does not {what} (axes {axes})", node)


def _require(b: Mapping[str, Any], name: str) -> ir.Node:
    node = bound_node(b, name)
    assert node is not None, f"the pattern binds {name}"
    return node


# -- ranks, token rows, expert ids -------------------------------------------------------------


def _rows_rank(b: Mapping[str, Any]) -> None:
    """The tokens are ``[T, H]`` and the router scores ``[T, E]``: both provably rank 2."""
    tokens: ir.Value = b["tokens"]
    scores: ir.Value = b["router_scores"]
    score_rank = static_rank(scores)
    if score_rank is None:
        score_rank = static_rank(b.get("topk_values"))
    if score_rank is None:  # a router that masks or gathers: its dims as the graph fixes them
        dims = value_dims(scores)
        score_rank = len(dims) if dims is not None else None
    for value, rank, what in (
        (tokens, static_rank(tokens), "the tokens the rows repeat, [T, H]"),
        (scores, score_rank, "the router scores, [T, E]"),
    ):
        if rank != 2:
            found = "is not fixed by the graph" if rank is None else f"is {rank}"
            raise Refusal(
                f"the flattened-rows (batched_mm) layer needs rank 2 for {what}, and the rank "
                f"of '{value_label(value)}' {found}",
                value,
            )


def _token_rows(b: Mapping[str, Any], t: Dim, k: int, hidden: int) -> None:
    """``rows = Reshape(Expand|Tile(Unsqueeze(x, [1]), ...), [-1, H])``: each token k times.

    With k = 1 the repeat is a no-op that canonicalisation drops: ``Reshape(Unsqueeze(x))``.
    """
    h = Dim.of(hidden)
    # a static export writes the token count into the Expand shape: [T, k, H] with T = 8
    token_sizes = (1,) if t.syms else (1, t.coef)
    unsq = _require(b, "token_repeat_unsq")
    _axes_are(unsq, 3, [1], "add the slot axis to the tokens [T, H] -> [T, 1, H]")
    repeat = bound_node(b, "token_repeat")
    if repeat is None:
        if k != 1:
            raise Refusal(
                f"the token rows '{value_label(b.get('token_rows'))}' are the tokens once each, "
                f"not repeated over the k = {k} slots",
                _require(b, "token_rows"),
            )
    else:
        values = const_ints(repeat.inputs[1]) if len(repeat.inputs) > 1 else None
        if repeat.op_type == "Tile":
            ok = values == [1, k, 1]
        else:  # Expand: broadcast [T, 1, H] against the (right-aligned) shape
            padded = None if values is None or len(values) > 3 else [1] * (3 - len(values)) + values
            ok = padded is not None and padded[0] in token_sizes and padded[1] == k
            ok = ok and padded[2] in (1, hidden)
        if not ok:
            raise Refusal(
                f"{repeat.op_type} '{label(repeat)}' ({values}) does not repeat each token exactly "
                f"k = {k} times (T = {t} tokens [T, 1, H])",
                repeat,
            )
    _reshape_to(
        _require(b, "token_rows"), [t, Dim.of(k), h], [t * Dim.of(k), h], "flatten [T, k, H]"
    )


def _expert_ids(
    b: Mapping[str, Any], tag: str, role: str, t: Dim, k: int, topk_idx: ir.Value
) -> None:
    """``ids = Unsqueeze(Reshape(topk_indices, [-1]), [-1])``: ``[T*k, 1]`` in row order."""
    idx = b.get(f"{tag}_indices")
    if not same_indices(idx, topk_idx):
        raise Refusal(
            f"{role} selects experts with '{value_label(idx)}', not the routing TopK's indices "
            f"'{value_label(topk_idx)}'",
            idx,
        )
    flat = _require(b, f"{tag}_expert_ids_flat")
    _reshape_to(flat, [t, Dim.of(k)], [t * Dim.of(k)], "flatten the top-k ids [T, k]")
    _axes_are(
        _require(b, f"{tag}_expert_ids"), 2, [1], "make the flat ids [T*k, 1] GatherND indices"
    )


# -- projections -------------------------------------------------------------------------------


def _gather_nd(node: ir.Node, role: str) -> None:
    if attr_int(node, "batch_dims", 0) != 0:
        raise Refusal(
            f"{role}: GatherND '{label(node)}' has batch_dims "
            f"{attr_int(node, 'batch_dims', 0)}; the expert selection needs 0",
            node,
        )


def _row_expert(
    b: Mapping[str, Any], tag: str, role: str, t: Dim, k: int, topk_idx: ir.Value
) -> ExpertWeights:
    """Prove one projection ``[T*k, K] -> [T*k, N]`` of the rows' experts; its weights."""
    rows = t * Dim.of(k)
    _expert_ids(b, tag, role, t, k, topk_idx)
    gather = _require(b, f"{tag}_gather")
    _gather_nd(gather, role)
    layout = b.get(f"{tag}_layout")
    ew = expert_weights(role, b.get(f"{tag}_weight"), layout)
    e, _, n = ew.shape
    # nk: [R, N, K] @ [R, K, 1] -> [R, N, 1]; kn: [R, 1, K] @ [R, K, N] -> [R, 1, N]
    unit = 2 if layout == "nk" else 1
    side = "column [rows, K, 1]" if layout == "nk" else "row [rows, 1, K]"
    _axes_are(_require(b, f"{tag}_lhs_unsq"), 3, [unit], f"make each {role} input a {side}")
    drop = _require(b, f"{tag}_drop")
    if drop.op_type == "Squeeze":
        _axes_are(drop, 3, [unit], f"drop the unit axis of the {role} product")
    else:
        mm_dims = [rows, Dim.of(n), Dim.of(1)] if layout == "nk" else [rows, Dim.of(1), Dim.of(n)]
        _reshape_to(drop, mm_dims, [rows, Dim.of(n)], f"drop the unit axis of the {role} product")
    bias = None
    bias_gather = bound_node(b, f"{tag}_bias_gather")
    if bias_gather is not None:
        _gather_nd(bias_gather, role)
        bias = expert_bias(role, b.get(f"{tag}_bias"), e, n, ew.dtype)
    noop = bound_node(b, f"{tag}_noop")
    if noop is not None:
        unsq = _require(b, f"{tag}_noop_unsq")
        axes = node_axes(unsq)
        one = normalize_axes(axes, 3) if axes is not None else None
        if one is None or len(one) != 1:
            raise Refusal(f"{role}: Unsqueeze '{label(unsq)}' (axes {axes}) is not one axis", unsq)
        _axes_are(noop, 3, one, f"undo Unsqueeze '{label(unsq)}' (axes {axes})")
    return with_bias(ew, bias)


# -- combine -----------------------------------------------------------------------------------


def _combine(b: Mapping[str, Any], t: Dim, k: int, hidden: int) -> None:
    """``ReduceSum(Reshape(Mul(out, Unsqueeze(Reshape(w, [-1]), [-1])), [-1, k, H]), [1])``."""
    kd, h = Dim.of(k), Dim.of(hidden)
    _reshape_to(_require(b, "weights_flat"), [t, kd], [t * kd], "flatten the routing weights")
    _axes_are(_require(b, "weights_col"), 2, [1], "make the flat routing weights [T*k, 1]")
    _reshape_to(
        _require(b, "combine_unflat"),
        [t * kd, h],
        [t, kd, h],
        "restore the [T, k, H] slots of the weighted rows",
    )
    root = _require(b, "layer_out")
    _axes_are(root, 3, [1], "sum over the k slots")
    if attr_int(root, "keepdims", 1) != 0:
        raise Refusal(f"ReduceSum '{label(root)}' keeps the k axis (keepdims=1)", root)


# -- the whole layer ---------------------------------------------------------------------------


def analyse_rows_layer(
    b: Mapping[str, Any],
    *,
    family: str,
    emit: frozenset[str],
    matched: Collection[ir.Node] | None = None,
    opset: int | None = None,
    combine: str = "reshape_reduce_sum",
    quantize: Quantization | None = None,
) -> LayerPlan:
    """Prove that a recognised flattened-rows layer equals one fused node; raise otherwise.

    Arguments as :func:`~.analysis.analyse_layer`. ``combine`` is ``reshape_reduce_sum``
    (the weighted rows un-flattened and summed) or a slot combine of FC2's rows un-flattened
    into ``[T, k, H]`` slots (bound ``fc2_slots``). The tokens must be ``[T, H]`` (rank 2) and
    so is the fused node's input.
    """
    root = b["layer_out"].producer()
    graph = root.graph if root is not None else None
    opset = opset if opset is not None else default_opset(graph)
    with part("tokens"):
        _rows_rank(b)
    routing = routing_form(b, 2, opset)
    k = routing.k
    t = _token_count(b)
    topk_idx = routing.topk.outputs[1]
    with part("fc1"):
        fc1 = tuple(
            _row_expert(b, tag, role, t, k, topk_idx) for tag, role in FC1_PROJECTIONS[family]
        )
    with part("fc2"):
        fc2 = _row_expert(b, "fc2", "FC2", t, k, topk_idx)
    hidden = fc2.shape[2]
    with part("fc1"):
        _token_rows(b, t, k, hidden)
    with part("combine"):
        if combine == "reshape_reduce_sum":
            _combine(b, t, k, hidden)
        else:
            kd, h = Dim.of(k), Dim.of(hidden)
            _reshape_to(
                _require(b, "fc2_slots"),
                [t * kd, h],
                [t, kd, h],
                "restore the [T, k, H] slots of FC2's rows",
            )
            combine_step(b, 2, combine, hidden)
    return finish_layer(
        b,
        family=family,
        emit=emit,
        matched=matched,
        rank=2,
        routing=routing,
        fc1=fc1,
        fc2=fc2,
        fc1_last_axis=1,
        quantize=quantize,
    )
