"""Squeeze spelling: ``Unsqueeze(Squeeze(x, a), a)`` -> ``x``.

``torch.max(x, dim).values.unsqueeze(-1)`` (a Switch router's weight) exports as a reduction
that drops the axis, then an ``Unsqueeze`` that puts it back. ``Squeeze`` removes axes of length
1 (it fails on any other) and ``Unsqueeze`` with the same axes, counted on ``x``'s rank,
inserts length-1 axes at the same places: the result is ``x``, element for element and shape
for shape. The rule returns ``Identity(x)`` so the replaced value keeps its name. Axes must be
constant (inputs from opset 13, as both ops take them) and ``x``'s rank known, and ``x`` a
TopK's output (the top-1 spellings' ``Squeeze``): other pairs are left for the passes that read
them as written (the expert loop's squeezed NonZero columns).
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from onnx_moe_fuse.rewrites.canonical.spellings.common import SpellingRule, small_ints
from onnx_moe_fuse.rewrites.graph.facts import static_rank

__all__ = ["SqueezeUnsqueeze", "squeeze_rules"]

_MIN_OPSET = 13


class SqueezeUnsqueeze(SpellingRule):
    """``Unsqueeze(Squeeze(x, a), a)`` -> ``Identity(x)``."""

    def pattern(self, op, x, squeezed_axes, unsqueezed_axes):
        """A Squeeze then an Unsqueeze, both with axes inputs."""
        return op.Unsqueeze(op.Squeeze(x, squeezed_axes), unsqueezed_axes)

    def check(self, context, x, squeezed_axes, unsqueezed_axes, **_) -> pattern.MatchResult:
        """The same constant axes, counted on ``x``'s known rank."""
        result = pattern.MatchResult()
        if self.opset < _MIN_OPSET:
            return result.fail(f"opset {self.opset} < {_MIN_OPSET}")
        made_by = x.producer()
        if made_by is None or made_by.op_type != "TopK":
            # only a top-k's values or indices (torch.max(...).values.unsqueeze(-1)): other
            # Squeeze/Unsqueeze pairs are forms other passes read as they are (expert loops)
            return result.fail("not a TopK output", x)
        rank = static_rank(x)
        out, back = small_ints(squeezed_axes), small_ints(unsqueezed_axes)
        if rank is None or out is None or back is None:
            return result.fail("axes not constant or the rank of x unknown", x)
        if any(not -rank <= a < rank for a in out + back):
            return result.fail("an axis out of range", x)
        if sorted(a % rank for a in out) != sorted(a % rank for a in back):
            return result.fail(f"Unsqueeze axes {back} differ from Squeeze axes {out}", x)
        return result

    def rewrite(self, op, x, **_):
        """``Identity(x)``."""
        return op.Identity(x)


def squeeze_rules(names, opset: int) -> list[pattern.RewriteRule]:
    """The Squeeze spelling rules."""
    return [SqueezeUnsqueeze.rule(names, opset)]
