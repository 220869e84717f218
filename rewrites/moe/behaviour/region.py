"""The element-wise region behind a value: its nodes, its sources, the constants it reads.

:func:`elementwise_region` walks back from a value (what FC2 reads, or the weights a combine
multiplies by) through the ops a behaviour check may evaluate, stopping at *sources*: the values
``is_source`` accepts (FC1's projections, the router logits), constants (initializers,
``Constant`` nodes), and nothing else. A value made by another op (a MatMul that is no
projection, a graph input) makes the region fail with a :class:`Refusal` naming it, as does a
``Cast`` from or to a half-precision type (a layer fuses in one float type) and a region of more
than :data:`MAX_NODES` nodes. The nodes come back in topological order, the sources in the order
the walk meets them (first input first, so ``Mul(silu(gate), up)`` gives gate, then up).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_array, label, value_label
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.moe.behaviour.interpret import MS_OPS, OPS, numpy_dtype
from onnx_moe_fuse.rewrites.moe.parts.facts import HALF_TYPES, half_precision

__all__ = ["MAX_NODES", "Region", "elementwise_region"]

#: The most nodes a region may hold (a written-out activation or softmax has a handful).
MAX_NODES = 64


@dataclass(frozen=True, eq=False)
class Region:
    """An element-wise region: ``nodes`` (topological) compute ``output`` from ``sources``."""

    output: ir.Value
    nodes: tuple[ir.Node, ...]
    sources: tuple[ir.Value, ...]


def _allowed(node: ir.Node, ops: frozenset[str]) -> bool:
    if node.domain == "com.microsoft":
        return node.op_type in MS_OPS
    return node.domain in ("", "ai.onnx") and node.op_type in ops


def _cast_refusal(node: ir.Node, what: str) -> Refusal | None:
    """A Cast from or to a half type (the half_precision refusal), or to a type not computed."""
    if node.op_type != "Cast":
        return None
    src = node.inputs[0]
    half = half_precision(what, node.outputs[0])
    if half is not None:
        return half
    to = ir.DataType(attr_int(node, "to", 0))
    if to in HALF_TYPES:
        return Refusal(
            f"Cast '{label(node)}' rounds {what} to {to.name.lower()} inside the region: a layer "
            "fuses in one float type",
            node,
            part="target",
        )
    if numpy_dtype(to) is None or (
        src is not None and src.dtype is not None and numpy_dtype(src.dtype) is None
    ):
        return Refusal(f"Cast '{label(node)}' casts {what} to {to.name.lower()}", node)
    return None


def elementwise_region(
    output: ir.Value,
    is_source: Callable[[ir.Value], bool],
    what: str,
    ops: frozenset[str] = OPS,
) -> Region | None:
    """The region computing ``output`` from sources; None when ``output`` is itself a source.

    ``what`` names the part in the reasons ("the activation", "the routing weights").
    """
    if is_source(output):
        return None
    order: list[ir.Node] = []
    sources: list[ir.Value] = []
    seen: set[ir.Value] = set()
    done: set[ir.Node] = set()
    # iterative post-order walk: (node, expanded?) frames
    stack: list[tuple[ir.Node, bool]] = []

    def visit(value: ir.Value) -> None:
        if value in seen:
            return
        seen.add(value)
        if const_array(value) is not None:
            return
        if value is not output and is_source(value):
            sources.append(value)
            return
        node = value.producer()
        if node is None:
            raise Refusal(
                f"{what} '{value_label(output)}' reads the graph input '{value_label(value)}', "
                "which is neither a projection nor a constant",
                value,
            )
        if not _allowed(node, ops):
            raise Refusal(
                f"{what} '{value_label(output)}' reads '{value_label(value)}' "
                f"({node.op_type} '{label(node)}'), which is neither a projection nor an "
                "element-wise op the behaviour check evaluates",
                node,
            )
        refusal = _cast_refusal(node, what)
        if refusal is not None:
            raise refusal
        if node not in done:
            stack.append((node, False))

    visit(output)
    while stack:
        node, expanded = stack.pop()
        if expanded:
            if node not in done:
                done.add(node)
                order.append(node)
                if len(order) > MAX_NODES:
                    raise Refusal(
                        f"{what} '{value_label(output)}' is a region of more than {MAX_NODES} "
                        "element-wise nodes",
                        node,
                    )
            continue
        stack.append((node, True))
        for value in reversed([v for v in node.inputs if v is not None]):
            visit(value)
    # the walk pushed inputs in reverse so the first input's sources are met first; re-order
    # the sources by the first node that reads each (the topological order)
    first_read = {}
    for i, node in enumerate(order):
        for v in node.inputs:
            if v in sources and v not in first_read:
                first_read[v] = i
    sources.sort(key=lambda v: first_read.get(v, 0))
    return Region(output, tuple(order), tuple(sources))
