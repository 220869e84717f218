"""One layer from its parts: combine -> routing -> FC2 -> activation -> FC1, as one fact.

:func:`recognise_layer` starts at the node a combine ends in and recognises each part from the
value the previous one hands over (the combine's weights lead to the routing TopK, its expert
output to FC2, FC2's input to the activation, the activation's operands to FC1), so a spelling
is one part's business and any combination of known part spellings composes. It returns a
:class:`~.facts.LayerParts` or raises the first part's
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal`. What the
parts mean (axes, shapes, constants, the same indices everywhere, dtypes, ...) is proved by
the layer proofs that read :attr:`~.facts.LayerParts.bindings`.
"""

from __future__ import annotations

from collections.abc import Collection

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import escape_from, escape_where, label, value_label
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.moe.parts.activation import (
    FAMILIES,
    identity_activation,
    recognise_activation,
)
from onnx_moe_fuse.rewrites.moe.parts.combine import recognise_combine
from onnx_moe_fuse.rewrites.moe.parts.facts import (
    ActivationFact,
    CombineFact,
    LayerParts,
    ProjectionFact,
    RoutingFact,
)
from onnx_moe_fuse.rewrites.moe.parts.projections import (
    recognise_fc2,
    recognise_projection,
    recognise_token_rows,
)
from onnx_moe_fuse.rewrites.moe.parts.routing import recognise_routing, selected_routing

__all__ = ["FC1_TAGS", "escaping_value", "recognise_layer"]

#: The FC1 projections of each activation family, by binding prefix.
FC1_TAGS = {"gated": ("fc1_gate", "fc1_up"), "fused_gated": ("fc1",), "elementwise": ("fc1",)}


#: The ops an FC1 projection's output comes out of (its patterns' roots), a cheap pre-filter.
_PROJECTION_ROOTS = frozenset({"Squeeze", "Reshape", "Add", "GroupedMatMul", "MatMul"})


def _is_fc1(source: str):
    """Whether a value is an FC1 projection's output (for the activation's region walk)."""

    def is_fc1(value: ir.Value) -> bool:
        node = value.producer()
        if node is None or node.op_type not in _PROJECTION_ROOTS:
            return False
        try:
            recognise_projection(value, "fc1", source, "fc1")
        except Refusal:
            return False
        return True

    return is_fc1


def _activation_and_fc1(
    act: ir.Value, source: str, families: tuple[str, ...]
) -> tuple[ActivationFact, tuple[ProjectionFact, ...]]:
    """The activation FC2 reads and the FC1 projection(s) it is made of."""
    try:
        activation = recognise_activation(act, families, _is_fc1(source))
    except Refusal as no_activation:
        if "elementwise" not in families:
            raise
        try:  # FC2 may read FC1 directly (identity)
            fc1 = recognise_projection(act, "fc1", source, "fc1")
        except Refusal:
            raise no_activation from None
        return identity_activation(act), (fc1,)
    tags = FC1_TAGS[activation.family]
    fc1 = tuple(
        recognise_projection(v, tag, source, "fc1")
        for v, tag in zip(activation.fc1_outputs, tags, strict=True)
    )
    return activation, fc1


def recognise_layer(
    root: ir.Node, combine_form: str | None = None, families: tuple[str, ...] = FAMILIES
) -> LayerParts:
    """The layer whose combine ends at ``root`` (in ``combine_form``, or any form)."""
    combine = recognise_combine(root, combine_form)
    try:
        routing = recognise_routing(combine.weights)
    except Refusal as not_topk_values:
        # weights made some other way (gathered scores, a routing factor): the selection is
        # the TopK whose indices FC2 gathers its experts by; its proof is the weights' walk
        try:
            fc2, _, _ = recognise_fc2(combine.expert_out, combine.reads_rows)
        except Refusal:
            raise not_topk_values from None
        routing = selected_routing(combine.weights, fc2.indices, not_topk_values)
    try:
        return _parts_after_routing(combine, routing, families)
    except Refusal as refusal:
        if refusal.topk is None:  # the layer's TopK, for the near miss
            refusal.topk = routing.topk
        raise


def _parts_after_routing(
    combine: CombineFact, routing: RoutingFact, families: tuple[str, ...]
) -> LayerParts:
    """FC2, the activation and FC1 of the layer whose combine and routing are recognised."""
    fc2, extra, extra_nodes = recognise_fc2(combine.expert_out, combine.reads_rows)
    source = "rows" if fc2.layout == "rows" else "tokens"
    activation, fc1 = _activation_and_fc1(fc2.input, source, families)
    reads = fc1[0].input
    for p in fc1[1:]:
        if p.input is not reads:
            raise Refusal(
                f"the FC1 projections read different values: '{value_label(reads)}' and "
                f"'{value_label(p.input)}' ({p.tag})",
                p.input,
                part="fc1",
            )
    tokens = reads
    extra = dict(extra)
    nodes = tuple(extra_nodes)
    if source == "rows":
        tokens, row_bindings, row_nodes = recognise_token_rows(reads)
        extra.update(row_bindings)
        nodes += row_nodes
    return LayerParts(
        combine=combine,
        routing=routing,
        fc2=fc2,
        activation=activation,
        fc1=fc1,
        layout=fc2.layout,
        tokens=tokens,
        extra=extra,
        extra_nodes=nodes,
    )


def escaping_value(parts: LayerParts, inside: Collection[ir.Node]) -> Refusal | None:
    """A failure naming a value of the layer's parts used outside ``inside`` (None if none).

    For a rule used alone: its small pattern matches the combine only, so the rewriter cannot
    see that an intermediate of FC1, the activation or FC2 feeds something else; replacing the
    layer output would then leave that part computed twice. The combine's output is the layer's.
    """
    escape = escape_from(parts.nodes, inside, skip=parts.combine.root)
    if escape is not None:
        node, out, user = escape
        return Refusal(
            f"an intermediate value escapes the layer: '{value_label(out)}' "
            f"({node.op_type} '{label(node)}') is also {escape_where(user)}",
            out,
            part="region",
        )
    return None
