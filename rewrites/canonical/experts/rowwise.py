"""The activation between the two grouped projections of a sorted-experts block: row-wise proof.

In the grouped_mm form the activation runs on the FC1 rows in sorted order, ``[N, F]``. Moving it
to the per-slot form ``[T, k, F]`` is exact when every op on the way treats each row on its own:
elementwise ops whose other operands are constants that broadcast along the feature axis only,
and ``Split`` / ``Slice`` along the feature axis. :func:`rowwise_region` proves that and returns
the nodes in graph order; :func:`clone_rowwise` rebuilds them on a rank-3 input with the feature
axis written as ``-1``.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.value_proofs import const_shape
from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_ints, label

__all__ = ["RowwiseRegion", "clone_rowwise", "per_slot_operands", "rowwise_region"]

#: Elementwise ops (all operands broadcast elementwise; no axis attribute).
ELEMENTWISE = frozenset(
    {
        "Abs", "Add", "Cast", "Ceil", "Clip", "Div", "Elu", "Erf", "Exp", "Floor", "Gelu",
        "HardSigmoid", "HardSwish", "Identity", "LeakyRelu", "Log", "Max", "Min", "Mish", "Mul",
        "Neg", "Pow", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Softplus",
        "Sqrt", "Sub", "Tanh", "Where",
    }
)  # fmt: skip
_FEATURE_AXES = (1, -1)


class RowwiseRegion:
    """The activation nodes (graph order), its input rows and its output rows."""

    def __init__(self, nodes: list[ir.Node], start: ir.Value, end: ir.Value) -> None:
        """Hold the region."""
        self.nodes = nodes
        self.start = start
        self.end = end


def _broadcasts_per_feature(value: ir.Value) -> bool:
    """A constant operand that is the same for every row of a ``[N, F]`` tensor."""
    shape = const_shape(value)
    if shape is None:
        return False
    return len(shape) <= 1 or (len(shape) == 2 and shape[0] == 1)


def _feature_axis_op(node: ir.Node) -> bool:
    if node.op_type == "Split":
        return attr_int(node, "axis", 0) in _FEATURE_AXES
    if node.op_type == "Slice":
        axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else None
        consts = all(const_ints(v) is not None for v in node.inputs[1:] if v is not None)
        return consts and axes is not None and all(a in _FEATURE_AXES for a in axes)
    return False


def _why_not_rowwise(node: ir.Node, inside: Callable[[ir.Value], bool]) -> str | None:
    if node.domain not in ("", "ai.onnx"):
        return f"{label(node)} ({node.domain}.{node.op_type}) is not a known row-wise op"
    if node.op_type in ELEMENTWISE:
        for v in node.inputs:
            if v is not None and not inside(v) and not _broadcasts_per_feature(v):
                return (
                    f"{label(node)} combines the sorted rows with {v.name!r}, which is not a "
                    "constant shared by every row"
                )
        return None
    if _feature_axis_op(node):
        if not inside(node.inputs[0]):
            return f"{label(node)} cuts a value that is not the sorted rows"
        return None
    return f"{label(node)} ({node.op_type}) is not proved to treat each row on its own"


def rowwise_region(
    start: ir.Value, is_end_use: Callable[[ir.Node], bool]
) -> tuple[RowwiseRegion | None, str | None]:
    """Walk forward from ``start`` to the value whose uses are all ``is_end_use``; prove row-wise.

    Returns ``(region, None)`` or ``(None, reason)``. Every value on the way must stay inside the
    region (an escaping sorted-order value would be left without a producer in the per-slot
    form).
    """
    produced: set[int] = {id(start)}
    nodes: list[ir.Node] = []
    end: ir.Value | None = None
    frontier = [start]
    while frontier:
        value = frontier.pop()
        if value.is_graph_output():
            return None, f"{value.name!r} (rows in sorted order) is a graph output"
        uses = [use.node for use in value.uses()]
        if uses and all(is_end_use(n) for n in uses):
            if end is not None and end is not value:
                return None, f"both {end.name!r} and {value.name!r} feed the second projection"
            end = value
            continue
        for node in uses:
            if is_end_use(node):
                return None, f"{value.name!r} feeds the second projection and other nodes too"
            if node in nodes:
                continue
            nodes.append(node)
            for out in node.outputs:
                produced.add(id(out))
                frontier.append(out)
    if end is None:
        return None, f"no second projection is reached from {start.name!r}"
    # Operands are checked once the whole region is known: a node may combine two branches.
    for node in nodes:
        why = _why_not_rowwise(node, lambda v: id(v) in produced)
        if why is not None:
            return None, why
    graph = next(iter(nodes)).graph if nodes else None
    if graph is not None:
        order = {id(n): i for i, n in enumerate(graph)}
        nodes.sort(key=lambda n: order.get(id(n), 0))
    return RowwiseRegion(nodes, start, end), None


def per_slot_operands(
    node: ir.Node, mapping: dict[int, ir.Value], new_const: Callable[[list[int]], ir.Value]
) -> tuple[list[ir.Value | None], list[ir.Attr]]:
    """The inputs (remapped) and attributes of ``node``'s clone on per-slot ``[T, k, F]`` values.

    A feature axis (``Split``'s ``axis``, ``Slice``'s ``axes``) becomes ``-1``: the same axis of
    the per-slot tensor whatever the rank the node had.
    """
    inputs = [mapping.get(id(v), v) if v is not None else None for v in node.inputs]
    attributes = [a for a in node.attributes.values() if a.name != "axis"]
    if node.op_type == "Split":
        attributes.append(ir.AttrInt64("axis", -1))
    elif "axis" in node.attributes:
        attributes.append(node.attributes["axis"])
    if node.op_type == "Slice":
        inputs[3] = new_const([-1] * len(const_ints(node.inputs[3]) or []))
    return inputs, attributes


def clone_rowwise(
    region: RowwiseRegion,
    new_start: ir.Value,
    fresh: Callable[[str], str],
    new_const: Callable[[list[int]], ir.Value],
    leading_dims: list,
) -> tuple[list[ir.Node], ir.Value]:
    """Rebuild the region's nodes on ``new_start`` (rank 3); returns the nodes and the new end.

    Attributes are copied; a feature axis (``Split``'s ``axis``, ``Slice``'s ``axes``) becomes
    ``-1``, which is the same axis of the rank-3 per-slot tensor. New values keep the old
    types; their shapes are ``leading_dims`` (``[T, k]``) and the old feature dim.
    """
    mapping: dict[int, ir.Value] = {id(region.start): new_start}
    built: list[ir.Node] = []
    for node in region.nodes:
        inputs, attributes = per_slot_operands(node, mapping, new_const)
        outputs = [
            ir.Value(name=fresh(o.name or "act"), type=o.type, shape=_per_slot(o, leading_dims))
            for o in node.outputs
        ]
        clone = ir.Node(
            node.domain,
            node.op_type,
            inputs,
            attributes,
            outputs=outputs,
            version=node.version,
            name=f"{node.name}__per_slot" if node.name else None,
        )
        for old, new in zip(node.outputs, clone.outputs, strict=True):
            mapping[id(old)] = new
        built.append(clone)
    return built, mapping[id(region.end)]


def _per_slot(value: ir.Value, leading_dims: list) -> ir.Shape | None:
    """The per-slot shape of a sorted-rows value ``[N, F]``: ``[*leading_dims, F]``."""
    if value.shape is None or len(value.shape) != 2:
        return None
    return ir.Shape([*leading_dims, value.shape[1]])
