"""Activation spellings: ``Swish`` and ``com.microsoft.QuickGelu`` -> ``x * Sigmoid(alpha * x)``.

The layer rules take SiLU as ``Mul(h, Sigmoid(h))`` and the SwiGLU gate as
``Mul(gate, Sigmoid(Mul(gate, alpha)))``. ONNX's ``Swish`` (opset 24, ``alpha`` default 1) and
ORT's ``QuickGelu`` (``alpha`` default 1.702) are both defined as ``x * sigmoid(alpha * x)``, so
they become exactly that: ``Mul(x, Sigmoid(Mul(x, alpha)))``, and ``Mul(x, Sigmoid(x))`` when
alpha is 1 (multiplying by 1 is exact, so the two forms agree bit for bit).

``alpha`` is a float attribute; it becomes a constant of ``x``'s type, so the rule fires only
when alpha is exactly representable in that type (a float16 model with alpha 1.702 keeps its
op: rounding alpha would change the function). Runtime kernels of ``Swish`` may evaluate the
formula in another order (``x / (1 + exp(-alpha x))``), so the rewritten graph agrees with the
op to rounding (tests: relative 1e-6 in float32), not bit for bit. ``HardSwish`` is a different
function (``x * HardSigmoid(x)``) and is left alone.
"""

from __future__ import annotations

import numpy as np
from onnxscript.rewriter import pattern

from onnx_moe_fuse.contract.ops import MS_DOMAIN
from onnx_moe_fuse.rewrites.canonical.spellings.common import (
    FLOAT_TYPES,
    SpellingRule,
    dtype_of,
    exactly_representable,
    has_attribute_refs,
    scalar_const,
)

__all__ = ["QuickGeluToSigmoidMul", "SwishToSigmoidMul", "activation_rules"]


class _ScaledSigmoidMul(SpellingRule):
    """``op(x, alpha)`` -> ``Mul(x, Sigmoid(Mul(x, alpha)))`` (``Mul(x, Sigmoid(x))`` at 1)."""

    op_type = ""
    domain = ""
    default_alpha = 1.0

    def pattern(self, op, x):
        """The activation node, bound as ``out`` to read its attribute."""
        return getattr(op, self.op_type)(x, _domain=self.domain, _outputs=["out"])

    def _alpha(self, out) -> float:
        return out.producer().attributes.get_float("alpha", self.default_alpha)

    def check(self, context, x, out, **_) -> pattern.MatchResult:
        """Alpha must be 1 or exactly a value of ``x``'s floating type."""
        result = pattern.MatchResult()
        if has_attribute_refs(out.producer()):
            return result.fail("alpha refers to a function attribute", out)
        alpha = self._alpha(out)
        if dtype_of(x) not in FLOAT_TYPES:
            return result.fail(f"input type {dtype_of(x)} is not a known floating type", x)
        if alpha != 1.0 and not exactly_representable(alpha, dtype_of(x)):
            return result.fail(f"alpha {alpha} is not exactly a {dtype_of(x)} value", out)
        return result

    def rewrite(self, op, x, out, **_):
        """``x * Sigmoid(alpha * x)``."""
        alpha = self._alpha(out)
        scaled = x
        if alpha != 1.0:
            const = scalar_const(op, alpha, dtype_of(x), self.names(f"{out.name}.alpha"))
            scaled = op.Mul(x, const, _outputs=[self.names(out.name)])
        gate = op.Sigmoid(scaled, _outputs=[self.names(out.name)])
        return op.Mul(x, gate)


class SwishToSigmoidMul(_ScaledSigmoidMul):
    """ONNX ``Swish`` (opset 24): ``x * sigmoid(alpha * x)``, alpha default 1."""

    op_type = "Swish"


class QuickGeluToSigmoidMul(_ScaledSigmoidMul):
    """ORT ``com.microsoft.QuickGelu``: ``x * sigmoid(alpha * x)``, alpha default 1.702."""

    op_type = "QuickGelu"
    domain = MS_DOMAIN
    # ORT's default is the float32 1.702f: the attribute type, so compare against that
    default_alpha = float(np.float32(1.702))


def activation_rules(names, opset: int) -> list[pattern.RewriteRule]:
    """The activation spelling rules."""
    return [SwishToSigmoidMul.rule(names, opset), QuickGeluToSigmoidMul.rule(names, opset)]
