"""Constant and graph readers for :mod:`.dense_experts` and its helpers.

The constant readers are ``_graph_facts``' readers, which take a ``Constant`` attribute as it is
(onnx-ir's ``get_const_tensor`` would rename the tensor, which the working copy shares with the
original model), plus :func:`is_const`. The graph readers (:func:`is_op`, :func:`consumers`,
:func:`only_consumer`, :func:`other_operand`, :func:`axes_are`) are the few questions every part
reader of the dense layer asks about a node and its neighbours. :func:`part` tags a refusal with
the layer part it is about, as the layer rules' ``_moe_analysis.part`` does; it is not imported
from there because the layer rules read the dense pass's refusals (an import cycle otherwise),
and it tags in place, so a refusal keeps its type and nodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import (
    Refusal,
    const_array,
    const_ints,
    node_axes,
    normalize_axes,
)

__all__ = [
    "DENSE_PARTS",
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
    "part",
    "refusal_part",
]

#: The default ONNX domain's spellings.
STD = ("", "ai.onnx")
#: The layer parts a dense refusal names: a subset of the layer rules' parts
#: (``_moe_analysis.PARTS``), so a near miss carries them as the rules' own.
DENSE_PARTS = ("routing", "fc1", "activation", "fc2", "combine", "weights", "region")


@contextmanager
def part(name: str) -> Iterator[None]:
    """Tag a :class:`Refusal` raised inside with the layer part ``name`` (innermost tag wins)."""
    assert name in DENSE_PARTS, name
    try:
        yield
    except Refusal as refusal:
        if getattr(refusal, "part", None) is None:
            refusal.part = name  # type: ignore[attr-defined]
        raise


def refusal_part(refusal: Refusal) -> str | None:
    """The layer part a refusal names (None for one raised outside any :func:`part`)."""
    return getattr(refusal, "part", None)


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
