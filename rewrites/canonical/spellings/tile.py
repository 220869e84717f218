"""Tile spelling: ``Tile`` that repeats only unit axes -> ``Expand``.

``Tile(x, r)`` makes axis ``i`` ``dim_i * r_i`` long by repeating the whole axis; ``Expand(x, r)``
broadcasts each axis to ``max(dim_i, r_i)`` (a 1 in ``r`` keeps the axis). Where every axis with
``r_i != 1`` has ``dim_i == 1``, both give ``r_i`` copies of the same one element, so they are
the same tensor, bit for bit, and ``r`` itself is a valid Expand shape. Token replication in
MoE layers (``Tile(Unsqueeze(x, 1), [1, k, 1])``) has that form; the layer rules take
``Expand``.

A repeated axis is proved to be of length 1 when ``x`` is the output of an ``Unsqueeze`` with
constant axes that include it (whatever the shapes), or when ``x``'s static shape says so; the
repeats must be a small constant with every entry >= 1 (a zero repeat empties an axis, which
Expand does not do the same way on a non-unit axis). Anything else is left alone.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.rewrites.canonical.spellings.common import SpellingRule, small_ints

__all__ = ["TileToExpand", "tile_rules"]


def _inserted_axes(x: ir.Value, rank: int) -> set[int]:
    """The axes of ``x`` an Unsqueeze inserted (normalised), when ``x`` is one's output."""
    node = x.producer()
    if node is None or node.op_type != "Unsqueeze" or node.domain not in ("", "ai.onnx"):
        return set()
    if len(node.inputs) > 1:
        axes = small_ints(node.inputs[1])
    else:
        attr = node.attributes.get("axes")
        axes = None if attr is None or attr.is_ref() else list(attr.as_ints())
    if axes is None or any(not -rank <= a < rank for a in axes):
        return set()
    return {a % rank for a in axes}


def _static_units(x: ir.Value, rank: int) -> set[int]:
    """The axes ``x``'s static shape gives length 1."""
    if x.shape is None or x.shape.rank() != rank:
        return set()
    return {i for i, dim in enumerate(x.shape) if isinstance(dim, int) and dim == 1}


class TileToExpand(SpellingRule):
    """``Tile(x, r)`` -> ``Expand(x, r)`` when every repeated axis is provably of length 1."""

    def pattern(self, op, x, repeats):
        """A Tile."""
        return op.Tile(x, repeats)

    def check(self, context, x, repeats, **_) -> pattern.MatchResult:
        """Repeats constant and >= 1; the axes repeated more than once of length 1."""
        result = pattern.MatchResult()
        counts = small_ints(repeats)
        if counts is None:
            return result.fail("the repeats are not a small constant vector", repeats)
        if any(c < 1 for c in counts):
            return result.fail(f"repeats {counts} has an entry below 1", repeats)
        rank = len(counts)
        units = _inserted_axes(x, rank) | _static_units(x, rank)
        repeated = {i for i, c in enumerate(counts) if c != 1}
        if not repeated <= units:
            axes = sorted(repeated - units)
            return result.fail(f"repeated axes {axes} are not provably of length 1", x)
        return result

    def rewrite(self, op, x, repeats, **_):
        """``Expand(x, repeats)``: the repeats are the broadcast shape."""
        return op.Expand(x, repeats)


def tile_rules(names, opset: int) -> list[pattern.RewriteRule]:
    """The Tile spelling rules."""
    return [TileToExpand.rule(names, opset)]
