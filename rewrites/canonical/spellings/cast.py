"""Cast spellings: chains that keep precision -> one ``Cast`` or none.

A cast from type ``S`` to ``W`` is *widening* when ``W`` holds every value of ``S`` exactly
(:data:`WIDENING`: float16/bfloat16 -> float32 -> float64, small integers -> larger integers and
floats with enough mantissa, bool -> every numeric type). After a widening cast the value is
the same number, so every later cast of it gives what a cast of the original gives:

* ``Cast(Cast(x, to=W), to=T)`` with ``x`` of type ``S``, ``S -> W`` widening, ``T != S`` ->
  ``Cast(x, to=T)`` (the outer cast's attributes kept), by a rewrite rule;
* the same chain with ``T == S`` (float32 -> float64 -> float32), and ``Cast(x, to=S)`` of an
  ``x`` already of type ``S``, compute ``x`` itself: :func:`eliminate_identity_casts` removes
  them, rewiring the readers to ``x``. A rewrite rule cannot do this: the rewriter gives the
  replacement value the replaced one's name, which would rename ``x`` (a graph input, or the
  output of a node that stays). So ``x`` keeps its name and the cast's output disappears from
  the working copy, which is fine for the splice: ``x`` names the same values in the original.
  A cast whose output is a graph output is kept (its name is part of the model's interface).

Casts that lose precision (float32 -> float16 -> float32, float -> int) stay as they are, and
so does any chain whose element types are not all known. (A float -> integer cast of a value
outside the integer's range is undefined in ONNX; the equivalence holds for the defined ones.)
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.rewrites.canonical.spellings.common import (
    SpellingRule,
    dtype_of,
    has_attribute_refs,
)

__all__ = ["WIDENING", "CastChainToOne", "cast_rules", "eliminate_identity_casts"]

_T = ir.DataType
_FLOATS = {_T.FLOAT16, _T.BFLOAT16, _T.FLOAT, _T.DOUBLE}
_NUMERIC = _FLOATS | {
    _T.INT8, _T.UINT8, _T.INT16, _T.UINT16, _T.INT32, _T.UINT32, _T.INT64, _T.UINT64,
}  # fmt: skip
#: ``{source: the types that hold every source value exactly}``.
WIDENING: dict[ir.DataType, frozenset[ir.DataType]] = {
    _T.BOOL: frozenset(_NUMERIC),
    _T.FLOAT16: frozenset({_T.FLOAT, _T.DOUBLE}),
    _T.BFLOAT16: frozenset({_T.FLOAT, _T.DOUBLE}),
    _T.FLOAT: frozenset({_T.DOUBLE}),
    # integers: a larger integer type of the right sign, or a float whose mantissa holds them
    _T.INT8: frozenset({_T.INT16, _T.INT32, _T.INT64, *_FLOATS}),
    _T.UINT8: frozenset({_T.INT16, _T.UINT16, _T.INT32, _T.UINT32, _T.INT64, _T.UINT64, *_FLOATS}),
    _T.INT16: frozenset({_T.INT32, _T.INT64, _T.FLOAT, _T.DOUBLE}),
    _T.UINT16: frozenset({_T.INT32, _T.UINT32, _T.INT64, _T.UINT64, _T.FLOAT, _T.DOUBLE}),
    _T.INT32: frozenset({_T.INT64, _T.DOUBLE}),
    _T.UINT32: frozenset({_T.INT64, _T.UINT64, _T.DOUBLE}),
}


def _widens(source: ir.DataType | None, target: int) -> bool:
    return source is not None and ir.DataType(target) in WIDENING.get(source, frozenset())


def _cast_target(node: ir.Node) -> int | None:
    """The ``to`` of a plain ONNX Cast node, else None."""
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
        return None
    to = node.attributes.get("to")
    return None if to is None or to.is_ref() else to.as_int()


class CastChainToOne(SpellingRule):
    """``Cast(Cast(x, to=W), to=T)``, ``S -> W`` widening and ``T != S`` -> ``Cast(x, to=T)``."""

    def pattern(self, op, x):
        """Two chained casts, both bound to read their attributes."""
        inner = op.Cast(x, _outputs=["inner"])
        return op.Cast(inner, _outputs=["out"])

    def check(self, context, x, inner, out, **_) -> pattern.MatchResult:
        """The first cast widens and the chain does not come back to ``x``'s own type."""
        result = pattern.MatchResult()
        wide, target = _cast_target(inner.producer()), _cast_target(out.producer())
        if wide is None or target is None:
            return result.fail("not two plain Casts", out)
        if has_attribute_refs(out.producer()):
            return result.fail("an attribute of the second Cast refers to a function's", out)
        if len(inner.producer().attributes) != 1:
            return result.fail("the first Cast has attributes beyond 'to'", inner)
        source = dtype_of(x)
        if not _widens(source, wide):
            return result.fail(f"Cast {source} -> {ir.DataType(wide)} may lose precision", inner)
        if ir.DataType(target) == source:
            return result.fail("the chain computes x itself (removed by its own step)", out)
        return result

    def rewrite(self, op, x, inner, out, **_):
        """One Cast with the outer cast's attributes."""
        attrs = {name: attr for name, attr in out.producer().attributes.items()}
        return op.Cast(x, **attrs)


def _identity_source(node: ir.Node) -> ir.Value | None:
    """The value a Cast computes exactly, when it is one: its input, or its input's input."""
    target = _cast_target(node)
    if target is None:
        return None
    src = node.inputs[0]
    if src is None:
        return None
    if dtype_of(src) == ir.DataType(target):
        return src
    producer = src.producer()
    if producer is None or _cast_target(producer) is None or len(producer.attributes) != 1:
        return None
    origin = producer.inputs[0]
    if origin is None or dtype_of(origin) != ir.DataType(target):
        return None
    return origin if _widens(dtype_of(origin), _cast_target(producer)) else None


def _remove_if_dead(node: ir.Node) -> None:
    if node.graph is None:
        return
    if all(not out.uses() and not out.is_graph_output() for out in node.outputs):
        node.graph.remove(node, safe=True)


def eliminate_identity_casts(model: ir.Model) -> int:
    """Remove the Casts that compute their own (or their widened input's) value; the count."""
    removed = 0
    graphs: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
    for graph in graphs:
        for node in list(ir.traversal.RecursiveGraphIterator(graph)):
            if node.graph is None:  # removed as the dead producer of an earlier one
                continue
            out = node.outputs[0]
            source = _identity_source(node)
            if source is None or out.is_graph_output():
                continue
            producer = node.inputs[0].producer() if source is not node.inputs[0] else None
            out.replace_all_uses_with(source)
            node.graph.remove(node, safe=True)
            if producer is not None:
                _remove_if_dead(producer)
            removed += 1
    return removed


def cast_rules(names, opset: int) -> list[pattern.RewriteRule]:
    """The cast spelling rules (the identity casts are removed by a walk, not a rule)."""
    return [CastChainToOne.rule(names, opset)]
