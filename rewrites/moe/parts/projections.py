"""Expert projections (FC1, its gate/up halves, FC2): small patterns rooted at their output.

Three sources, two layouts (``tag`` names the projection: ``fc1``, ``fc1_gate``, ``fc1_up``,
``fc2``; every binding is prefixed with it)::

    tokens  (per slot, FC1)   GroupedMatMul(x, W, idx, b?)                       opset 29
                              drop(MatMul(Expand?(Unsqueeze(x, axes)), Gather(W, idx)))
    slots   (per slot, FC2)   Reshape(GroupedMatMul(Reshape(a), W, Reshape(idx), b?))
                              drop(MatMul(Unsqueeze(a, axes), Gather(W, idx)))
    rows    (flattened rows)  drop(MatMul(GatherND(W, ids), Unsqueeze(a))       W [E, N, K]
                                  | MatMul(Unsqueeze(a), GatherND(W, ids)))      W [E, K, N]
                              ids = Unsqueeze(Reshape(idx, [-1]), -1)
            drop = Squeeze(_, axes) | Reshape(_, shape); bias: + Gather(b, idx) / GatherND(b, ids)
            (either order); rows may end in a no-op Squeeze(Unsqueeze(_)) (torch's in-place add)

:func:`recognise_projection` recognises one projection; :func:`recognise_fc2` finds FC2 from
what the combine reads (per-slot slots, flattened rows, or rows un-flattened into slots by a
Reshape); :func:`recognise_token_rows` finds the tokens behind flattened rows (each token
repeated k times). Axes, Reshape targets, constants and indices are proved by the layer proofs.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.rewrites.graph.facts import label, value_label
from onnx_moe_fuse.rewrites.graph.match import PartPattern, first_match, spellings
from onnx_moe_fuse.rewrites.graph.refusals import DENSE_EXPERTS, Refusal
from onnx_moe_fuse.rewrites.moe.parts.facts import (
    ProjectionFact,
    half_precision,
)

__all__ = ["SOURCES", "recognise_fc2", "recognise_projection", "recognise_token_rows"]

#: What a projection multiplies: the tokens (FC1, per slot), per-slot inputs (FC2) or rows.
SOURCES = ("tokens", "slots", "rows")


def _var(name: str, optional: bool = False) -> pattern.Var:
    return pattern.Var(name, can_match_none=optional)


# -- per slot ----------------------------------------------------------------------------------


def _slot_tail(op, lhs, tag: str, root: str) -> Any:
    """Gather + MatMul + unit-axis drop (+ Gather/Add bias); ``root`` picks the output node."""
    selected = op.Gather(_var(f"{tag}_weight"), _var(f"{tag}_indices"), _outputs=[f"{tag}_gather"])
    mm = op.MatMul(lhs, selected, _outputs=[f"{tag}_matmul"])
    if root == "squeeze":
        return op.Squeeze(mm, _var(f"{tag}_drop_axes", True), _outputs=[f"{tag}_drop"])
    if root == "reshape":
        return op.Reshape(mm, _var(f"{tag}_drop_shape"), _outputs=[f"{tag}_drop"])
    drop = pattern.OrValue(
        [
            op.Squeeze(mm, _var(f"{tag}_drop_axes", True), _outputs=[f"{tag}_drop"]),
            op.Reshape(mm, _var(f"{tag}_drop_shape"), _outputs=[f"{tag}_drop"]),
        ]
    )
    bias_sel = op.Gather(
        _var(f"{tag}_bias", True), _var(f"{tag}_bias_indices"), _outputs=[f"{tag}_bias_gather"]
    )
    return op.Add(drop, bias_sel) if root == "add_bias" else op.Add(bias_sel, drop)


_TAILS = ("add_bias", "bias_add", "squeeze", "reshape")


def _tokens_gmm(op, tag: str) -> Any:
    return op.GroupedMatMul(
        _var(f"{tag}_input"),
        _var(f"{tag}_weight"),
        _var(f"{tag}_indices"),
        _var(f"{tag}_bias", True),
        _outputs=[f"{tag}_gmm"],
    )


def _tokens_lhs(op, tag: str) -> Any:
    unsq = op.Unsqueeze(
        _var(f"{tag}_input"), _var(f"{tag}_lhs_axes", True), _outputs=[f"{tag}_lhs_unsq"]
    )
    return pattern.OrValue(
        [op.Expand(unsq, _var(f"{tag}_expand_shape"), _outputs=[f"{tag}_expand"]), unsq]
    )


def _slots_gmm(op, tag: str) -> Any:
    rows = op.Reshape(_var(f"{tag}_input"), _var(f"{tag}_rows_shape"), _outputs=[f"{tag}_rows"])
    row_idx = op.Reshape(
        _var(f"{tag}_indices"), _var(f"{tag}_row_idx_shape"), _outputs=[f"{tag}_row_idx"]
    )
    grouped = op.GroupedMatMul(
        rows, _var(f"{tag}_weight"), row_idx, _var(f"{tag}_bias", True), _outputs=[f"{tag}_gmm"]
    )
    return op.Reshape(grouped, _var(f"{tag}_unflat_shape"), _outputs=[f"{tag}_unflat"])


def _slots_lhs(op, tag: str) -> Any:
    return op.Unsqueeze(
        _var(f"{tag}_input"), _var(f"{tag}_lhs_axes", True), _outputs=[f"{tag}_lhs_unsq"]
    )


# -- flattened rows ----------------------------------------------------------------------------


def _rows_projection(op, tag: str, root: str) -> Any:
    flat = op.Reshape(
        _var(f"{tag}_indices"), _var(f"{tag}_ids_flat_shape"), _outputs=[f"{tag}_expert_ids_flat"]
    )
    ids = op.Unsqueeze(flat, _var(f"{tag}_ids_axes", True), _outputs=[f"{tag}_expert_ids"])
    selected = op.GatherND(_var(f"{tag}_weight"), ids, _outputs=[f"{tag}_gather"])
    unsq = op.Unsqueeze(
        _var(f"{tag}_input"), _var(f"{tag}_lhs_axes", True), _outputs=[f"{tag}_lhs_unsq"]
    )
    mm = pattern.OrValue(
        [op.MatMul(selected, unsq), op.MatMul(unsq, selected)],
        tag_var=f"{tag}_layout",
        tag_values=["nk", "kn"],
    )

    if root == "squeeze":
        return op.Squeeze(mm, _var(f"{tag}_drop_axes", True), _outputs=[f"{tag}_drop"])
    if root == "reshape":
        return op.Reshape(mm, _var(f"{tag}_drop_shape"), _outputs=[f"{tag}_drop"])
    drop = pattern.OrValue(
        [
            op.Squeeze(mm, _var(f"{tag}_drop_axes", True), _outputs=[f"{tag}_drop"]),
            op.Reshape(mm, _var(f"{tag}_drop_shape"), _outputs=[f"{tag}_drop"]),
        ]
    )
    bias_sel = op.GatherND(_var(f"{tag}_bias"), ids, _outputs=[f"{tag}_bias_gather"])
    if root == "add_bias":
        return op.Add(drop, bias_sel)
    if root == "bias_add":
        return op.Add(bias_sel, drop)
    # torch's in-place bias add leaves a no-op Unsqueeze/Squeeze pair behind (gpt-oss)
    biased = pattern.OrValue([op.Add(drop, bias_sel), op.Add(bias_sel, drop), drop])
    noop_unsq = op.Unsqueeze(biased, _var(f"{tag}_noop_axes", True), _outputs=[f"{tag}_noop_unsq"])
    return op.Squeeze(noop_unsq, _var(f"{tag}_noop_sq_axes", True), _outputs=[f"{tag}_noop"])


_TAGS = ("fc1", "fc1_gate", "fc1_up", "fc2")


def _build(tag: str, source: str) -> tuple[tuple[str, PartPattern], ...]:
    """The root alternatives of one projection, most specific first."""
    out: list[tuple[str, PartPattern]] = []
    if source == "rows":
        for root in ("noop", *_TAILS):
            out.append(("gathernd_matmul", PartPattern(f"{tag}/rows/{root}", _rows(tag, root))))
        return tuple(out)
    gmm = _tokens_gmm if source == "tokens" else _slots_gmm
    lhs = _tokens_lhs if source == "tokens" else _slots_lhs
    out.append(("grouped_matmul", PartPattern(f"{tag}/{source}/gmm", lambda op: gmm(op, tag))))
    for root in _TAILS:
        out.append(
            (
                "gather_matmul",
                PartPattern(
                    f"{tag}/{source}/{root}",
                    lambda op, root=root: _slot_tail(op, lhs(op, tag), tag, root),
                ),
            )
        )
    return tuple(out)


def _rows(tag: str, root: str):
    return lambda op: _rows_projection(op, tag, root)


_PATTERNS = {(tag, source): _build(tag, source) for tag in _TAGS for source in SOURCES}

_WHAT = {
    "tokens": "a projection of the tokens by each token's k experts (GroupedMatMul, or Gather "
    "of the stacked weights + MatMul)",
    "slots": "a projection of the per-slot activations by each slot's expert (GroupedMatMul, or "
    "Gather of the stacked weights + MatMul)",
    "rows": "a projection of flattened (token, slot) rows by each row's expert (GatherND of the "
    "stacked weights by the flat top-k ids + MatMul)",
}


def recognise_projection(out: ir.Value, tag: str, source: str, part: str) -> ProjectionFact:
    """The projection ``tag`` whose output is ``out``, reading ``source`` (see :data:`SOURCES`).

    ``part`` names the layer part in the failure (``fc1`` or ``fc2``).
    """
    node = out.producer()
    found = first_match(_PATTERNS[(tag, source)], node)
    if found is None:
        half = half_precision(part, out)
        if half is not None:
            raise half
        what = "a graph input" if node is None else f"{node.op_type} '{label(node)}'"
        raise Refusal(
            f"'{value_label(out)}' ({what}) is not {_WHAT[source]}",
            node if node is not None else out,
            part=part,
            expected=spellings(_PATTERNS[(tag, source)]),
        )
    spelling, match = found
    b = match.bindings
    layout = "rows" if source == "rows" else "slots"
    return ProjectionFact(
        tag=tag,
        spelling=spelling,
        layout=layout,
        input=b[f"{tag}_input"],
        output=out,
        weight=b.get(f"{tag}_weight"),
        indices=b.get(f"{tag}_indices"),
        bias=b.get(f"{tag}_bias"),
        nodes=match.nodes,
        bindings=b,
    )


def recognise_fc2(
    expert_out: ir.Value, reads_rows: bool
) -> tuple[ProjectionFact, dict[str, Any], tuple[ir.Node, ...]]:
    """FC2 from what the combine reads: (its fact, glue bindings, glue nodes).

    ``reads_rows``: the combine weights flattened rows (FC2 is then a rows projection). A slot
    combine reads a per-slot projection, or flattened rows un-flattened by a ``Reshape``
    (bound ``fc2_slots``; the rows proof checks its target).
    """
    if reads_rows:
        return recognise_projection(expert_out, "fc2", "rows", "fc2"), {}, ()
    try:
        return recognise_projection(expert_out, "fc2", "slots", "fc2"), {}, ()
    except Refusal as slots_failure:
        mask = _dense_mask(expert_out)
        if mask is not None:
            raise mask from None
        node = expert_out.producer()
        if node is None or node.op_type not in ("Reshape", "Unsqueeze") or node.inputs[0] is None:
            raise slots_failure from None  # (an Unsqueeze: the un-flattening Reshape at k = 1)
        try:
            fact = recognise_projection(node.inputs[0], "fc2", "rows", "fc2")
        except Refusal:
            raise slots_failure from None
        return fact, {"fc2_slots": expert_out}, (node,)


_MASK_OPS = frozenset({"OneHot", "Equal"})


def _mask_topk(mask: ir.Node) -> ir.Node | None:
    """The TopK whose ids (output 1) the mask node reads, directly or through an Unsqueeze."""
    for value in mask.inputs:
        node = value.producer() if value is not None else None
        if node is not None and node.op_type == "Unsqueeze" and node.inputs[0] is not None:
            value, node = node.inputs[0], node.inputs[0].producer()
        if node is not None and node.op_type == "TopK" and value is node.outputs[1]:
            return node
    return None


def _dense_mask(value: ir.Value) -> Refusal | None:
    """A refusal for a one-hot mask where FC2's output should be (a dense form left as is).

    The dense-experts pass recognised such a layer from its mask and recorded why it left it;
    the refusal defers to that record (``defer``), which names the part at fault.
    """
    node = value.producer()
    if node is not None and node.op_type == "Cast" and node.inputs[0] is not None:
        node = node.inputs[0].producer()
    if node is None or node.op_type not in _MASK_OPS:
        return None
    topk = _mask_topk(node)
    return Refusal(
        f"the experts are chosen by a one-hot mask of the TopK's indices ({node.op_type} "
        f"'{label(node)}'): a dense all-experts form that the dense-experts canonicalisation "
        "could not prove equal to the selected experts, so the layer is left as it is",
        node,
        part="fc2",
        topk=topk,
        defer=DENSE_EXPERTS if topk is not None else None,
    )


def _token_rows(op, repeat: str) -> Any:
    unsq = op.Unsqueeze(_var("tokens"), _var("repeat_axes", True), _outputs=["token_repeat_unsq"])
    if repeat == "expand":
        src = op.Expand(unsq, _var("repeat_shape"), _outputs=["token_repeat"])
    elif repeat == "tile":
        src = op.Tile(unsq, _var("repeat_reps"), _outputs=["token_repeat"])
    else:  # k = 1: canonicalisation drops the no-op repeat
        src = unsq
    return op.Reshape(src, _var("rows_shape"), _outputs=["token_rows"])


_ROW_PATTERNS = tuple(
    (r, PartPattern(f"token_rows/{r}", lambda op, r=r: _token_rows(op, r)))
    for r in ("expand", "tile", "none")
)


def recognise_token_rows(rows: ir.Value) -> tuple[ir.Value, dict[str, Any], tuple[ir.Node, ...]]:
    """The tokens behind flattened rows ``Reshape(Expand|Tile?(Unsqueeze(x)))``: (x, bindings, nodes).

    The repeat count (k; no repeat only for k = 1) and every axis and shape are proved by the
    rows proof.
    """
    found = first_match(_ROW_PATTERNS, rows.producer())
    if found is None:
        node = rows.producer()
        what = "a graph input" if node is None else f"{node.op_type} '{label(node)}'"
        raise Refusal(
            f"the rows '{value_label(rows)}' FC1 projects ({what}) are not the tokens repeated "
            "over the k slots and flattened (Reshape(Expand(Unsqueeze(x))))",
            node if node is not None else rows,
            part="fc1",
            expected=spellings(_ROW_PATTERNS),
        )
    _, match = found
    b = dict(match.bindings)
    return b.pop("tokens"), b, match.nodes
