"""Clamp spellings: ``Min``/``Max`` with scalar constants and attribute ``Clip`` -> ``Clip``.

The SwiGLU rules take clamps as ``Clip(x, lo, hi)`` with its bounds as inputs. Three rules
produce that form and compose (the rewriter visits the inner node of ``Min(Max(x, lo), hi)``
first, so the two-sided clamp is built in two steps):

* ``Min(x, c)`` / ``Min(c, x)`` -> ``Clip(x, -inf, c)``; ``Max(x, c)`` / ``Max(c, x)`` ->
  ``Clip(x, c, +inf)``, ``c`` a constant of one element (reshaped to a scalar when it has
  rank > 0 and ``x``'s rank is known to be at least that, so the output shape is unchanged).
  The absent side is an explicit infinity, not an empty input: ONNX defines an absent bound as
  the type's lowest/max finite value, which would turn ``+inf`` into ``FLT_MAX`` where ``Min``
  keeps it; ``clip(x, -inf, c) = min(x, c)`` for every ``x``, NaN included (the layer analysis
  reads an infinite bound as absent). Integer types have no infinity and no value beyond the
  default bound, so they get the empty input, which is just as exact.
* ``Clip(Clip(x, a, b), c, d)``, all bounds constant scalars or absent -> ``Clip(x, max(a, c),
  min(b, d))`` when both intervals are well formed and intersect (a clamp to an interval then
  to another is the clamp to their intersection), or when ``b >= d`` and ``min(a, b) >= c``
  (then the inner upper and outer lower bounds do nothing and the pair is ``min(max(x, a), d)``,
  which is ``Clip``'s definition even for ``a > d``); else left alone. An absent bound counts as
  the type's lowest/max value, which is what ``Clip`` uses for it.
* ``Clip(x)`` with ``min``/``max`` attributes (opset < 11, float32, the only type ORT runs it
  for) -> ``Clip(x, min, max)`` with the attribute values as constants, an absent attribute as
  its default (the float32 lowest/max, so ``inf`` is clamped as before). The input form is ONNX
  from opset 11: in an opset < 11 model the result is a form for the layer rules to read on the
  working copy, never one the original graph receives.

``Min``/``Max`` are rewritten only from opset 13 (``Clip`` takes every numeric type there).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.rewrites.canonical.spellings.common import (
    FLOAT_TYPES,
    SpellingRule,
    constant_rank,
    dtype_of,
    has_attribute_refs,
    is_constant,
    scalar_constant,
)

__all__ = ["ClipAttributesToInputs", "MinMaxToClip", "NestedClipMerge", "clamp_rules"]

#: ``Min``/``Max`` become ``Clip`` only where ``Clip`` takes every numeric type.
_CLIP_ALL_TYPES_OPSET = 13


def _const(op, array: np.ndarray, dtype: ir.DataType, name: str) -> ir.Value:
    return op.Constant(value=ir.tensor(array, dtype=dtype, name=name), _outputs=[name])


def _numeric(dtype: ir.DataType | None) -> bool:
    return dtype is not None and (dtype in FLOAT_TYPES or dtype.is_integer())


def _is_nan(array: np.ndarray) -> bool:
    """Whether a 0-d bound is NaN (float16/bfloat16 included; integers never are)."""
    return array.dtype.kind not in "biu" and bool(np.isnan(array.astype(np.float64)))


def _limits(dtype: ir.DataType) -> tuple[np.ndarray, np.ndarray]:
    """What an absent lower/upper Clip bound means for ``dtype``: its lowest/max finite value."""
    np_type = dtype.numpy()
    info = ml_dtypes.finfo(np_type) if dtype in FLOAT_TYPES else ml_dtypes.iinfo(np_type)
    return np.array(info.min, dtype=np_type), np.array(info.max, dtype=np_type)


class MinMaxToClip(SpellingRule):
    """``Min``/``Max`` of a value and a one-element constant -> a one-sided ``Clip``."""

    def __init__(self, names, opset: int, op_type: str) -> None:
        """``op_type``: ``"Min"`` (an upper bound) or ``"Max"`` (a lower bound)."""
        super().__init__(names, opset)
        self.name = f"{self.name}[{op_type}]"
        self._op_type = op_type

    def pattern(self, op, first, second):
        """The two-input Min/Max, bound as ``out``."""
        return getattr(op, self._op_type)(first, second, _outputs=["out"])

    @staticmethod
    def _split(first, second) -> tuple[ir.Value, ir.Value]:
        return (second, first) if is_constant(first) else (first, second)

    def check(self, context, first, second, out, **_) -> pattern.MatchResult:
        """One operand computed, the other a one-element constant that keeps the shape."""
        result = pattern.MatchResult()
        if self.opset < _CLIP_ALL_TYPES_OPSET:
            return result.fail(f"opset {self.opset} Clip does not take every type Min takes")
        if is_constant(first) == is_constant(second):
            return result.fail("needs exactly one constant operand", out)
        x, bound = self._split(first, second)
        array = scalar_constant(bound)
        if array is None:
            return result.fail("the constant operand has more than one element", bound)
        if _is_nan(array):
            return result.fail("a NaN bound: Min/Max and Clip may treat it differently", bound)
        if not _numeric(dtype_of(x)):
            return result.fail(f"element type {dtype_of(x)} is not a known numeric type", x)
        bound_rank = constant_rank(bound)
        if bound_rank != 0 and (x.shape is None or x.shape.rank() < bound_rank):
            return result.fail("a bound of rank > 0 could change the output's rank", bound)
        return result

    def rewrite(self, op, first, second, out, **_):
        """``Clip(x, c, +inf)`` for Max, ``Clip(x, -inf, c)`` for Min (empty for integers)."""
        x, bound = self._split(first, second)
        dtype = dtype_of(x)
        if constant_rank(bound) != 0:
            bound = _const(op, scalar_constant(bound), dtype, self.names(bound.name))
        other = None
        if dtype in FLOAT_TYPES:
            infinity = np.array(np.inf if self._op_type == "Max" else -np.inf, dtype=dtype.numpy())
            other = _const(op, infinity, dtype, self.names(f"{out.name}.unbounded"))
        if self._op_type == "Max":
            return op.Clip(x, bound, other)
        return op.Clip(x, other, bound)


class NestedClipMerge(SpellingRule):
    """``Clip(Clip(x, a, b), c, d)`` -> ``Clip(x, max(a, c), min(b, d))`` on intersecting bounds."""

    def pattern(self, op, x):
        """Two nested Clips, every bound optional."""
        a, b, c, d = (pattern.Var(name, can_match_none=True) for name in "abcd")
        inner = op.Clip(x, a, b, _outputs=["inner"])
        return op.Clip(inner, c, d, _outputs=["out"])

    def _effective(self, x, a, b, c, d):
        """Each bound as (value, the Value it came from or None when absent), else None."""
        dtype = dtype_of(x)
        if not _numeric(dtype):
            return None
        lowest, highest = _limits(dtype)
        bounds = []
        for value, default in ((a, lowest), (b, highest), (c, lowest), (d, highest)):
            if value is None:
                bounds.append((default, None))
                continue
            array = scalar_constant(value)
            if array is None or _is_nan(array):
                return None
            bounds.append((array, value))
        return bounds

    def check(self, context, x, a, b, c, d, inner, out, **_) -> pattern.MatchResult:
        """Bounds constant scalars (or absent), both intervals well formed and intersecting."""
        result = pattern.MatchResult()
        for node in (inner.producer(), out.producer()):
            # a one-input Clip before opset 11 reads its bounds from attributes
            if self.opset < 11 and len(node.inputs) == 1:
                return result.fail("attribute Clip (opset < 11) is handled by its own rule", out)
        bounds = self._effective(x, a, b, c, d)
        if bounds is None:
            return result.fail("a bound is not a constant scalar of a known type", out)
        (lo1, _), (hi1, _), (lo2, _), (hi2, _) = bounds
        # a clamp to [lo1, hi1] then to [lo2, hi2] is the clamp to their intersection when both
        # are intervals and they meet; and it is min(max(x, lo1), hi2) whatever lo1 and hi2
        # are when the inner upper and the outer lower bound do nothing (hi1 >= hi2 and
        # min(lo1, hi1) >= lo2). Both are Clip(x, max(lo1, lo2), min(hi1, hi2)).
        intersect = lo1 <= hi1 and lo2 <= hi2 and max(lo1, lo2) <= min(hi1, hi2)
        nested = hi1 >= hi2 and min(lo1, hi1) >= lo2
        if not (intersect or nested):
            return result.fail("the clamp intervals are empty or do not intersect", out)
        return result

    def rewrite(self, op, x, a, b, c, d, out, **_):
        """One Clip to the intersection; a bound chosen from an absent one stays absent."""
        (lo1, lo1_v), (hi1, hi1_v), (lo2, lo2_v), (hi2, hi2_v) = self._effective(x, a, b, c, d)
        lo, lo_v = (lo1, lo1_v) if lo1 >= lo2 else (lo2, lo2_v)
        hi, hi_v = (hi1, hi1_v) if hi1 <= hi2 else (hi2, hi2_v)
        inputs = []
        for array, value in ((lo, lo_v), (hi, hi_v)):
            if value is None:
                inputs.append(None)
            elif constant_rank(value) == 0:
                inputs.append(value)
            else:
                inputs.append(_const(op, array, dtype_of(x), self.names(value.name)))
        return op.Clip(x, *inputs)


class ClipAttributesToInputs(SpellingRule):
    """Attribute ``Clip`` (opset < 11) -> ``Clip(x, min, max)`` with constant inputs."""

    def pattern(self, op, x):
        """A one-input Clip, bound as ``out`` to read its attributes."""
        return op.Clip(x, _outputs=["out"])

    def check(self, context, x, out, **_) -> pattern.MatchResult:
        """The attribute form of an opset < 11 model, on float32 (ORT's only type for it)."""
        result = pattern.MatchResult()
        node = out.producer()
        if has_attribute_refs(node):
            return result.fail("a bound refers to a function attribute", out)
        if len(node.inputs) != 1:
            return result.fail("Clip has bound inputs already", out)
        if self.opset >= 11:
            return result.fail(f"at opset {self.opset} a one-input Clip is the identity", out)
        if dtype_of(x) != ir.DataType.FLOAT:
            return result.fail(f"attribute Clip on {dtype_of(x)} is not rewritten", x)
        return result

    def rewrite(self, op, x, out, **_):
        """The attributes, or their defaults (float32 lowest/max), as constant inputs."""
        attrs = out.producer().attributes
        lowest, highest = _limits(ir.DataType.FLOAT)
        lo = np.array(attrs.get_float("min", float(lowest)), dtype=np.float32)
        hi = np.array(attrs.get_float("max", float(highest)), dtype=np.float32)
        lo_v = _const(op, lo, ir.DataType.FLOAT, self.names(f"{out.name}.min"))
        hi_v = _const(op, hi, ir.DataType.FLOAT, self.names(f"{out.name}.max"))
        return op.Clip(x, lo_v, hi_v)


def clamp_rules(names, opset: int) -> list[pattern.RewriteRule]:
    """The clamp spelling rules."""
    return [
        ClipAttributesToInputs.rule(names, opset),
        NestedClipMerge.rule(names, opset),
        MinMaxToClip.rule(names, opset, "Min"),
        MinMaxToClip.rule(names, opset, "Max"),
    ]
