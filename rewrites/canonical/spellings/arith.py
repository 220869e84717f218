"""Arithmetic spellings: ``Gemm`` -> ``MatMul``, reciprocal products -> ``Div``, constants second.

* ``Gemm(A, B, C, alpha, beta, transA, transB)`` -> ``MatMul(A', B')`` (``A'``/``B'`` a
  ``Transpose`` when ``transA``/``transB``; the weight-layout pass folds that on constants),
  ``Mul`` by alpha only when alpha != 1, ``Add(_, C)`` (``C`` times beta only when beta != 1,
  and no ``Add`` at all when ``C`` is absent or beta is 0, which is what ORT's Gemm does: it
  reads no ``C`` at beta 0). Same formula; the runtime's GEMM may fuse the scaling and the
  bias addition into its accumulation, so results agree to rounding (tests: relative 1e-5).
  Alpha/beta become constants of the operands' type, so a scaled Gemm is rewritten only for a
  floating type in which they are exact; an unscaled one for every type Gemm takes.
* ``Mul(v, Reciprocal(s))`` / ``Mul(Reciprocal(s), v)`` -> ``Div(v, s)``. Not bit-exact:
  ``v * (1/s)`` rounds twice, ``v / s`` once, so the two differ by at most 1.5 units in the
  last place (relative 2**-22.4 in float32; tests: relative 2.4e-7 = 2 ulp). Accepted because
  the canonical form lives only on the working copy and exists to be recognised: where a layer
  fuses, the fused node computes its own renormalisation and replaces both spellings alike;
  where none fuses, the original graph keeps its ``Reciprocal`` untouched. The ``Reciprocal``
  is consumed only when nothing else reads it (the rewriter's removability check).
* ``Mul(c, x)`` / ``Add(c, x)`` with ``c`` constant and ``x`` not -> ``Mul(x, c)`` /
  ``Add(x, c)``: IEEE multiplication and addition are commutative bit for bit and broadcasting
  is symmetric, so this one is exact; later patterns then need one operand order.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from onnx_moe_fuse.rewrites.canonical.spellings.common import (
    SpellingRule,
    dtype_of,
    exactly_representable,
    has_attribute_refs,
    is_constant,
    scalar_const,
)

__all__ = ["ConstantSecond", "GemmToMatMul", "ReciprocalMulToDiv", "arith_rules"]


class GemmToMatMul(SpellingRule):
    """``Gemm`` -> ``MatMul`` (+ ``Transpose``) (+ ``Mul`` alpha) (+ ``Add`` of [beta] C)."""

    def pattern(self, op, a, b):
        """A Gemm, C optional, bound as ``out`` to read its attributes."""
        return op.Gemm(a, b, pattern.Var("c", can_match_none=True), _outputs=["out"])

    @staticmethod
    def _attrs(out) -> tuple[float, float, int, int]:
        attrs = out.producer().attributes
        return (
            attrs.get_float("alpha", 1.0),
            attrs.get_float("beta", 1.0),
            attrs.get_int("transA", 0),
            attrs.get_int("transB", 0),
        )

    def check(self, context, a, b, c, out, **_) -> pattern.MatchResult:
        """Scaling needs a floating type in which alpha and beta are exact."""
        result = pattern.MatchResult()
        if has_attribute_refs(out.producer()):
            return result.fail("an attribute refers to a function attribute", out)
        alpha, beta, _, _ = self._attrs(out)
        scalars = [alpha] + ([beta] if c is not None else [])
        for number in scalars:
            if number not in (0.0, 1.0) and not exactly_representable(number, dtype_of(a)):
                return result.fail(f"Gemm scale {number} is not exactly a {dtype_of(a)} value", out)
        if alpha == 0.0:
            return result.fail("Gemm with alpha 0 is a broadcast of C, not a MatMul", out)
        return result

    def rewrite(self, op, a, b, c, out, **_):
        """``MatMul(A', B') [* alpha] [+ C [* beta]]``."""
        alpha, beta, trans_a, trans_b = self._attrs(out)
        if trans_a:
            a = op.Transpose(a, perm=[1, 0], _outputs=[self.names(a.name)])
        if trans_b:
            b = op.Transpose(b, perm=[1, 0], _outputs=[self.names(b.name)])
        y = op.MatMul(a, b, _outputs=[self.names(out.name)])
        if alpha != 1.0:
            scale = scalar_const(op, alpha, dtype_of(a), self.names(f"{out.name}.alpha"))
            y = op.Mul(y, scale, _outputs=[self.names(out.name)])
        if c is None or beta == 0.0:
            return y
        if beta != 1.0:
            scale = scalar_const(op, beta, dtype_of(a), self.names(f"{out.name}.beta"))
            c = op.Mul(c, scale, _outputs=[self.names(c.name)])
        return op.Add(y, c)


class ReciprocalMulToDiv(SpellingRule):
    """``Mul(v, Reciprocal(s))`` (or the reciprocal first) -> ``Div(v, s)``."""

    def __init__(self, names, opset: int, reciprocal_first: bool) -> None:
        """``reciprocal_first``: match ``Mul(Reciprocal(s), v)`` instead."""
        super().__init__(names, opset)
        self.name = f"{self.name}[{'reciprocal_first' if reciprocal_first else 'value_first'}]"
        self._reciprocal_first = reciprocal_first

    def pattern(self, op, v, s):
        """The product of a value and a reciprocal, in this rule's operand order."""
        inverse = op.Reciprocal(s)
        return op.Mul(inverse, v) if self._reciprocal_first else op.Mul(v, inverse)

    def rewrite(self, op, v, s, **_):
        """``Div(v, s)``."""
        return op.Div(v, s)


class ConstantSecond(SpellingRule):
    """``Mul(c, x)`` / ``Add(c, x)``, ``c`` constant and ``x`` not -> ``op(x, c)`` (exact)."""

    def __init__(self, names, opset: int, op_type: str) -> None:
        """``op_type``: ``"Mul"`` or ``"Add"``."""
        super().__init__(names, opset)
        self.name = f"{self.name}[{op_type}]"
        self._op_type = op_type

    def pattern(self, op, first, second):
        """The binary op, operands as they stand."""
        return getattr(op, self._op_type)(first, second)

    def check(self, context, first, second, **_) -> pattern.MatchResult:
        """Only a constant first and a computed second operand are swapped."""
        result = pattern.MatchResult()
        if not is_constant(first):
            return result.fail("the first operand is not a constant", first)
        if is_constant(second):
            return result.fail("both operands are constants", second)
        return result

    def rewrite(self, op, first, second, **_):
        """The same op with the operands swapped."""
        return op.op(self._op_type, second, first)


def arith_rules(names, opset: int) -> list[pattern.RewriteRule]:
    """The arithmetic spelling rules."""
    return [
        GemmToMatMul.rule(names, opset),
        ReciprocalMulToDiv.rule(names, opset, reciprocal_first=False),
        ReciprocalMulToDiv.rule(names, opset, reciprocal_first=True),
        ConstantSecond.rule(names, opset, "Mul"),
        ConstantSecond.rule(names, opset, "Add"),
    ]
