"""Einsum spelling: a two-operand ``Einsum`` -> ``MatMul``/``Transpose``/``Unsqueeze``/``Squeeze``.

MoE layers written with ``Einsum`` (``"th,ehi->tei"`` dense experts, ``"tkh,tkhi->tki"`` per
slot with gathered weights, ``"tk,tki->ti"`` combine, ``"bsh,hd->bsd"`` router) compute what the
layer rules match as ``MatMul``s; this module lowers any two-operand equation it can parse.

Each letter is classified: in both operands and the output, *batch*; in both and not the output,
*contracted*; in one operand and the output, *free* (left-only / right-only); in one operand
only, summed over first (``ReduceSum`` of that operand). With nothing contracted the result is
``Mul`` of the two operands laid out in output order (``Unsqueeze`` where a letter is missing).
Otherwise one contracted letter ``K`` is the MatMul's inner axis, one free letter of each side
may be its ``M``/``N`` axis (or a unit axis), and every other output letter is a MatMul batch
axis, broadcast where one side lacks it (``Unsqueeze``, or nothing when leading: MatMul
broadcasts from the right); further contracted letters ride as batch axes and are summed after
(``ReduceSum``), so no ``Reshape`` and no static shape is needed. Each operand is transposed
into that layout only if it is not in it already, and the result is transposed to the output
order only if needed.

Of the layouts possible (operand order x choice of ``M``/``N``/``K``), the cheapest is taken:
first a weight (a constant, or a Gather/Transpose/Dequantize... of one) on the right, as in
``x @ W`` (the layer rules and the weight-layout pass expect it there), then a real ``M``/``N``
axis wherever a side has a free letter for it (else the MatMul degenerates into a batch of dot
products), then the fewest Transposes, then the fewest other nodes. So ``"tkh,tkhi->tki"`` becomes
``Squeeze(MatMul(Unsqueeze(x, [2]), w), [2])`` and ``"tk,tki->ti"``
``Squeeze(MatMul(Unsqueeze(w, [1]), y), [1])``: the rules' per-slot projection and MatMul
combine.

Einsum kernels accumulate in their own order, so the lowering agrees with ``Einsum`` to
rounding, not bit for bit (tests: relative 1e-5 in float32 against ``numpy.einsum``).
Left alone: more or fewer than two operands, ellipsis, a letter twice in one operand or in the
output, implicit-output equations mixing cases, and element types MatMul does not take (when
something is contracted) or unknown ones.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.rewrites.canonical.spellings.common import (
    SpellingRule,
    dtype_of,
    has_attribute_refs,
    is_constant,
    reduce_sum,
    squeeze,
    unsqueeze,
)

__all__ = ["Equation", "EinsumToMatMul", "Lowering", "einsum_rules", "lower", "parse_equation"]

_T = ir.DataType
#: Element types of ONNX MatMul.
_MATMUL_TYPES = frozenset(
    {_T.FLOAT16, _T.BFLOAT16, _T.FLOAT, _T.DOUBLE, _T.INT32, _T.INT64, _T.UINT32, _T.UINT64}
)
#: Ops through which a value still counts as a weight (data input first).
_WEIGHT_CARRIERS = frozenset(
    {"Gather", "GatherND", "Transpose", "Reshape", "Cast", "DequantizeLinear", "Unsqueeze"}
)


@dataclass(frozen=True)
class Equation:
    """A parsed two-operand equation: the letters of each operand and of the output."""

    first: str
    second: str
    out: str


def parse_equation(text: str) -> Equation | None:
    """``"ab,bc->ac"`` as an :class:`Equation`; None for what this lowering does not take."""
    text = text.replace(" ", "")
    if "." in text or text.count("->") > 1:
        return None
    inputs, arrow, out = text.partition("->")
    operands = inputs.split(",")
    if len(operands) != 2 or not all(s.isalpha() or s == "" for s in [*operands, out]):
        return None
    if any(len(set(s)) != len(s) for s in operands):
        return None
    if not arrow:  # implicit output: the letters seen once, in alphabetical order
        letters = "".join(operands)
        if letters != letters.lower() and letters != letters.upper():
            return None
        out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    if len(set(out)) != len(out) or not set(out) <= set("".join(operands)):
        return None
    return Equation(operands[0], operands[1], out)


@dataclass
class Side:
    """How one operand enters the product: which, summed axes, transpose, unit axes."""

    source: int  # 0: the Einsum's first operand, 1: its second
    reduce: list[int] = field(default_factory=list)
    perm: list[int] | None = None
    unsqueeze: list[int] = field(default_factory=list)


@dataclass
class Lowering:
    """The ops replacing one Einsum: each side, the product, then squeeze/reduce/transpose."""

    op_type: str  # "MatMul" or "Mul"
    left: Side
    right: Side
    squeeze: list[int] = field(default_factory=list)
    reduce: list[int] = field(default_factory=list)
    perm: list[int] | None = None
    #: Sides whose M/N axis is a unit one although they have a free letter for it (the free
    #: letters then ride as batch axes: a batch of dot products instead of one GEMM).
    unit_sides: int = 0

    def transposes(self) -> int:
        """How many Transposes it emits."""
        return sum(p is not None for p in (self.left.perm, self.right.perm, self.perm))

    def other_nodes(self) -> int:
        """How many Unsqueeze/Squeeze/ReduceSum it emits."""
        lists = [
            self.left.reduce,
            self.left.unsqueeze,
            self.right.reduce,
            self.right.unsqueeze,
            self.squeeze,
            self.reduce,
        ]
        return sum(bool(axes) for axes in lists)


def _perm(current: list[str], wanted: list[str]) -> list[int] | None:
    perm = [current.index(letter) for letter in wanted]
    return None if perm == list(range(len(perm))) else perm


def _arrange(source: int, letters: str, drop: str, layout: list[str | None], keep: int) -> Side:
    """Sum ``drop``, then lay ``letters`` out as ``layout`` (None or absent: a unit axis).

    Leading unit axes are left to broadcasting, down to ``keep`` trailing axes.
    """
    side = Side(source, reduce=[letters.index(c) for c in drop])
    kept = [c for c in letters if c not in drop]
    side.perm = _perm(kept, [c for c in layout if c is not None and c in kept])
    missing = [i for i, c in enumerate(layout) if c is None or c not in kept]
    lead = 0
    while lead in missing and len(layout) - lead > keep:
        lead += 1
    side.unsqueeze = [i - lead for i in missing if i >= lead]
    return side


def _mul_lowering(eq: Equation, order: tuple[int, int], drops: tuple[str, str]) -> Lowering:
    """Nothing contracted: both operands laid out in output order, multiplied."""
    operands = (eq.first, eq.second)
    layout: list[str | None] = list(eq.out)
    left, right = (_arrange(i, operands[i], drops[i], layout, 0) for i in order)
    return Lowering("Mul", left, right)


def _matmul_lowerings(eq: Equation, order: tuple[int, int], drops: tuple[str, str]):
    """Every MatMul layout for this operand order."""
    operands = (eq.first, eq.second)
    lhs = [c for c in operands[order[0]] if c not in drops[order[0]]]
    rhs = [c for c in operands[order[1]] if c not in drops[order[1]]]
    contracted = [c for c in lhs if c in rhs and c not in eq.out]
    free_l = [c for c in lhs if c not in rhs]
    free_r = [c for c in rhs if c not in lhs]
    for k, m, n in itertools.product(contracted, [*free_l, None], [*free_r, None]):
        extra = [c for c in contracted if c != k]
        batch = extra + [c for c in eq.out if c not in (m, n)]
        lay_l, lay_r = [*batch, m, k], [*batch, k, n]
        left = _arrange(order[0], operands[order[0]], drops[order[0]], lay_l, 2)
        right = _arrange(order[1], operands[order[1]], drops[order[1]], lay_r, 2)
        product = [*batch, m, n]
        squeezed = [c for c in product if c is not None]
        rest = [c for c in squeezed if c not in extra]
        yield Lowering(
            "MatMul",
            left,
            right,
            squeeze=[i for i, c in enumerate(product) if c is None],
            reduce=list(range(len(extra))),
            perm=_perm(rest, list(eq.out)),
            unit_sides=int(m is None and bool(free_l)) + int(n is None and bool(free_r)),
        )


def lower(eq: Equation, weights: tuple[bool, bool] = (False, False)) -> Lowering:
    """The cheapest lowering of ``eq``; ``weights`` says which operands are weights."""
    drops = (
        "".join(c for c in eq.first if c not in eq.second and c not in eq.out),
        "".join(c for c in eq.second if c not in eq.first and c not in eq.out),
    )
    contracted = set(eq.first) & set(eq.second) - set(eq.out)
    orders = [(0, 1), (1, 0)]
    if not contracted:
        order = (1, 0) if weights == (True, False) else (0, 1)
        return _mul_lowering(eq, order, drops)
    candidates = [lw for o in orders for lw in _matmul_lowerings(eq, o, drops)]

    def cost(lowering: Lowering) -> tuple[int, int, int, int]:
        left_weight = weights[lowering.left.source] and not weights[lowering.right.source]
        return (
            int(left_weight),
            lowering.unit_sides,
            lowering.transposes(),
            lowering.other_nodes(),
        )

    return min(candidates, key=cost)


def _is_weight(value: ir.Value | None, depth: int = 4) -> bool:
    """A constant, or a value computed from one through gathers and layout ops."""
    if value is None:
        return False
    if is_constant(value):
        return True
    node = value.producer()
    if depth == 0 or node is None or node.op_type not in _WEIGHT_CARRIERS or not node.inputs:
        return False
    return _is_weight(node.inputs[0], depth - 1)


class EinsumToMatMul(SpellingRule):
    """A two-operand ``Einsum`` -> MatMul (or Mul) with layout ops, per :func:`lower`."""

    def pattern(self, op, first, second):
        """A two-operand Einsum, bound as ``out`` to read its equation."""
        return op.Einsum(first, second, _outputs=["out"])

    @staticmethod
    def _equation(out) -> Equation | None:
        attr = out.producer().attributes.get("equation")
        return None if attr is None else parse_equation(attr.as_string())

    def check(self, context, first, second, out, **_) -> pattern.MatchResult:
        """An equation this lowering takes, on element types its ops take."""
        result = pattern.MatchResult()
        if has_attribute_refs(out.producer()):
            return result.fail("the equation refers to a function attribute", out)
        eq = self._equation(out)
        if eq is None:
            return result.fail("the equation is not a two-operand one this lowering takes", out)
        dtype = dtype_of(first)
        if dtype is None or dtype != dtype_of(second):
            return result.fail("the operands' element types are unknown or differ", first)
        contracted = set(eq.first) & set(eq.second) - set(eq.out)
        if contracted and dtype not in _MATMUL_TYPES:
            return result.fail(f"MatMul does not take {dtype}", first)
        for value, letters in ((first, eq.first), (second, eq.second)):
            if value.shape is not None and value.shape.rank() != len(letters):
                return result.fail("an operand's rank differs from its letters", value)
        return result

    def _side(self, op, value: ir.Value, side: Side) -> ir.Value:
        if side.reduce:
            value = reduce_sum(op, value, side.reduce, self)
        if side.perm is not None:
            value = op.Transpose(value, perm=side.perm, _outputs=[self.names(value.name)])
        if side.unsqueeze:
            value = unsqueeze(op, value, side.unsqueeze, self)
        return value

    def rewrite(self, op, first, second, out, **_):
        """The lowering's ops, in order: sides, product, squeeze, reduce, transpose."""
        eq = self._equation(out)
        lowering = lower(eq, (_is_weight(first), _is_weight(second)))
        operands = (first, second)
        left = self._side(op, operands[lowering.left.source], lowering.left)
        right = self._side(op, operands[lowering.right.source], lowering.right)
        y = op.op(lowering.op_type, left, right, _outputs=[self.names(out.name)])
        if lowering.squeeze:
            y = squeeze(op, y, lowering.squeeze, self)
        if lowering.reduce:
            y = reduce_sum(op, y, lowering.reduce, self)
        if lowering.perm is not None:
            y = op.Transpose(y, perm=lowering.perm, _outputs=[self.names(out.name)])
        return y


def einsum_rules(names, opset: int) -> list[pattern.RewriteRule]:
    """The Einsum spelling rules."""
    return [EinsumToMatMul.rule(names, opset)]
