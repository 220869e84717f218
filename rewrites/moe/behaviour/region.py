"""The element-wise region behind a value: its nodes, its sources, the constants it reads.

:func:`elementwise_region` walks back from a value (what FC2 reads, or the weights a combine
multiplies by) through the ops a behaviour check may evaluate, stopping at *sources*: the values
``is_source`` accepts (FC1's projections, the router logits), constants (initializers,
``Constant`` nodes), and nothing else. A value made by another op (a MatMul that is no
projection, a graph input) makes the region fail with a :class:`Refusal` naming it, as does a
``Cast`` from or to a half-precision type (a layer fuses in one float type) and a region of more
than :data:`MAX_NODES` nodes. The nodes come back in topological order (a depth-first walk, at
most :data:`MAX_NODES` deep), the sources in the order the walk meets them (first input first, so
``Mul(silu(gate), up)`` gives gate, then up).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
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
    """An element-wise region: ``nodes`` (topological) compute ``output`` from ``sources``.

    ``constants``: the constant values the nodes read, read once (the checks read them often).
    """

    output: ir.Value
    nodes: tuple[ir.Node, ...]
    sources: tuple[ir.Value, ...]
    constants: Mapping[ir.Value, np.ndarray] = field(default_factory=dict)


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
    kinds: dict[ir.Value, str] = {}  # "const" | "source" | "node"
    constants: dict[ir.Value, np.ndarray] = {}
    done: set[ir.Node] = set()

    def kind(value: ir.Value) -> str:
        if value not in kinds:
            kinds[value] = _classify(value)
        return kinds[value]

    def _classify(value: ir.Value) -> str:
        arr = const_array(value)
        if arr is not None:
            constants[value] = np.asarray(arr)
            return "const"
        if value is not output and is_source(value):
            sources.append(value)
            return "source"
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
        return "node"

    def visit(node: ir.Node) -> None:  # post-order: a node after every producer it reads
        if node in done:
            return
        done.add(node)
        for value in node.inputs:
            if value is not None and kind(value) == "node":
                visit(value.producer())  # type: ignore[arg-type]
        order.append(node)
        if len(order) > MAX_NODES:
            raise Refusal(
                f"{what} '{value_label(output)}' is a region of more than {MAX_NODES} "
                "element-wise nodes",
                node,
            )

    if kind(output) == "node":
        visit(output.producer())  # type: ignore[arg-type]
    return Region(output, tuple(order), tuple(sources), constants)
