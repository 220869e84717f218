"""Constant and graph readers for :mod:`.dense_experts` and its helpers.

The constant readers are ``graph.facts``' readers, which take a ``Constant`` attribute as it is
(onnx-ir's ``get_const_tensor`` would rename the tensor, which the working copy shares with the
original model), plus :func:`is_const`. The graph readers (:func:`is_op`, :func:`consumers`,
:func:`only_consumer`, :func:`other_operand`, :func:`axes_are`) are the few questions every part
reader of the dense layer asks about a node and its neighbours. Refusals are
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal`, tagged with their part by
:func:`~onnx_moe_fuse.rewrites.graph.refusals.part`, as the layer rules' are.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import (
    const_array,
    const_ints,
    node_axes,
    normalize_axes,
)
from onnx_moe_fuse.rewrites.graph.refusals import Refusal

__all__ = [
    "STD",
    "axes_are",
    "const_array",
    "const_ints",
    "consumers",
    "is_const",
    "is_op",
    "node_axes",
    "only_consumer",
    "other_operand",
]

#: The default ONNX domain's spellings.
STD = ("", "ai.onnx")


def is_const(value: ir.Value | None) -> bool:
    """True when ``value`` holds a readable constant."""
    return const_array(value) is not None


def is_op(node: ir.Node | None, op: str) -> bool:
    """True when ``node`` is the default-domain ``op``."""
    return node is not None and node.op_type == op and node.domain in STD


def consumers(value: ir.Value) -> list[ir.Node]:
    """The nodes that read ``value``, each once, in use order."""
    return list(dict.fromkeys(value.consumers()))


def only_consumer(value: ir.Value, what: str) -> ir.Node:
    """The one node reading ``value`` (``what`` names it in the refusal otherwise)."""
    users = consumers(value)
    if len(users) != 1 or value.is_graph_output():
        uses = len(users) + value.is_graph_output()
        raise Refusal(
            f"{value.name}: {what} has {uses} uses (a graph output counts), not one", value
        )
    return users[0]


def other_operand(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The operand of the two-input ``node`` that is not ``value``."""
    a, b = node.inputs[0], node.inputs[1]
    return b if a is value else a


def axes_are(node: ir.Node, rank: int, want: list[int]) -> bool:
    """True when ``node``'s axes (input or attribute), normalised for ``rank``, are ``want``."""
    axes = node_axes(node)
    return axes is not None and normalize_axes(axes, rank) == want
