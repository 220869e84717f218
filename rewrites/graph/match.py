"""Match one small onnxscript pattern at a given node: the one home of a private-API use.

The part recognisers (:mod:`.routing`, :mod:`.projections`, :mod:`.activation`,
:mod:`.combine`) each describe their part with a few small onnxscript patterns and match them at
the node where the part must end. onnxscript 0.7 has no public call for "match this pattern at
this node" outside a rewrite rule, so this module builds the pattern graph with
``onnxscript.rewriter._pattern_ir._to_graph_pattern`` and matches it with
``SimplePatternMatcher`` (``tests/rewrites/graph/test_parts_match.py`` pins both). Matching only reads
the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import _pattern_ir, pattern

__all__ = ["PartMatch", "PartPattern", "first_match", "spellings"]


@dataclass(frozen=True)
class PartMatch:
    """A successful match: the bindings (variable and output names) and the matched nodes."""

    bindings: dict[str, Any]
    nodes: tuple[ir.Node, ...]


class PartPattern:
    """One small pattern, built once from ``build(op)`` and matched at a given root node.

    ``build`` takes the opset pattern builder and returns the pattern's output value; its
    variables are created inside with :class:`onnxscript.rewriter.pattern.Var`. The output must
    be a node's output (onnxscript cannot root a search at an ``OrValue``), so a part with
    several root spellings is a list of patterns (:func:`first_match`).
    """

    def __init__(self, name: str, build: Callable[[Any], Any]) -> None:
        """Compile the pattern ``build`` describes; ``name`` is for debugging only."""
        self.name = name

        def constructor(op):  # _to_graph_pattern reads the parameters: only ``op`` here
            return build(op)

        self._graph = _pattern_ir._to_graph_pattern(constructor)
        self._matcher = pattern.SimplePatternMatcher(self._graph)

    def match(self, node: ir.Node | None) -> PartMatch | None:
        """Match at ``node`` (the pattern's output node); None when it does not match."""
        if node is None or node.graph is None:
            return None
        result = self._matcher.match(None, node.graph, node, remove_nodes=False)  # type: ignore[arg-type]
        if not result:
            return None
        return PartMatch(dict(result.bindings), tuple(result.nodes))

    def __repr__(self) -> str:
        return f"PartPattern({self.name!r})"


def spellings(patterns: Iterable[tuple[str, PartPattern]]) -> str:
    """The names of ``patterns``, ``" | "``-joined: the spellings a refusal says were expected."""
    return " | ".join(pat.name for _, pat in patterns)


def first_match(
    patterns: Iterable[tuple[str, PartPattern]], node: ir.Node | None
) -> tuple[str, PartMatch] | None:
    """The first ``(tag, pattern)`` that matches at ``node``, with its match; None if none."""
    for tag, pat in patterns:
        found = pat.match(node)
        if found is not None:
            return tag, found
    return None
