"""Shape tensors as symbolic facts: what a Shape/Gather/Concat/Mul chain holds, element by element.

:func:`shape_value` evaluates an integer tensor of rank 0 or 1 that the graph computes from
shapes (``Shape``, ``Size``, ``Gather``, ``Slice``, ``Concat``, ``Unsqueeze``, ``Squeeze``,
``Reshape``, ``ReduceProd``, ``Mul``, ``Div``, ``Add``, ``Sub``) into a :class:`ShapeValue`, each
element a :class:`~onnx_moe_fuse.rewrites.graph.facts.Dim` product (unknown sizes as symbols
tied to the value and axis they come from). It reads declared shapes and constants only, never
the data path, and returns None for anything it cannot prove. :class:`FoldShapesPass`
(``fold_shapes.py``) turns the provable ones into constants.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import (
    Dim,
    attr_int,
    const_ints,
    node_axes,
    product,
    value_dims,
)

__all__ = ["SHAPE_ARITHMETIC", "SHAPE_TYPES", "INT64_INPUTS", "ShapeValue", "shape_value"]

SHAPE_TYPES = frozenset({ir.DataType.INT64, ir.DataType.INT32})
#: Ops that compute shapes from shapes: the only ones the constant folder may evaluate.
SHAPE_ARITHMETIC = frozenset(
    {
        "Shape", "Size", "Gather", "Slice", "Concat", "Squeeze", "Unsqueeze", "Reshape", "Cast",
        "Identity", "Mul", "Div", "Add", "Sub", "Range", "ReduceProd", "Constant",
    }
)  # fmt: skip
#: A shape value has at most this many elements (longer integer tensors are data).
_MAX_RANK = 64
#: Inputs that are int64 by the op's definition (their dtype is known without inference).
INT64_INPUTS = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Split": (1,),
    "Unsqueeze": (1,), "Squeeze": (1,), "TopK": (1,), "Slice": (1, 2, 3, 4),
    "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,),
}  # fmt: skip


@dataclass(frozen=True)
class ShapeValue:
    """An integer tensor of rank 0 or 1 whose elements are known as :class:`Dim` products."""

    dims: tuple[Dim, ...]
    scalar: bool

    @property
    def ints(self) -> list[int] | None:
        """The elements as numbers, or None while one is symbolic."""
        return None if any(d.syms for d in self.dims) else [d.coef for d in self.dims]


#: The ops :func:`shape_value` evaluates (anything else is not a shape computation to it).
_EVALUATED = frozenset(
    {"Shape", "Size", "Identity", "Cast", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze",
     "Reshape", "ReduceProd", "Mul", "Div", "Add", "Sub", "ConstantOfShape"}
)  # fmt: skip


def shape_value(
    value: ir.Value | None, _depth: int = 0, _memo: dict | None = None
) -> ShapeValue | None:
    """What the shape tensor ``value`` holds, element by element; None when not provable.

    ``_memo`` is shared with :func:`value_dims` for one question (a Reshape target computed from
    the dims of values whose own shapes come from computed targets): each value is read once.
    """
    memo = {} if _memo is None else _memo
    key = ("shape_value", id(value))
    if key in memo:
        return memo[key]
    memo[key] = None  # a cycle (an invalid graph) reads as unknown
    memo[key] = out = _shape_value(value, _depth, memo)
    return out


def _shape_value(value: ir.Value | None, _depth: int, memo: dict) -> ShapeValue | None:
    if value is None or _depth > 32 or value.is_graph_input():
        return None
    if value.dtype is not None and value.dtype not in SHAPE_TYPES:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is not None:
        if tensor.dtype not in SHAPE_TYPES or len(tensor.shape) > 1 or tensor.size > _MAX_RANK:
            return None
        arr = tensor.numpy()
        return ShapeValue(tuple(Dim.of(int(v)) for v in arr.reshape(-1)), arr.ndim == 0)
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx") or value is not node.outputs[0]:
        return None
    if node.op_type == "Constant":  # value_int(s), as onnxscript's folder writes them
        ints = node.attributes.get("value_ints") or node.attributes.get("value_int")
        if ints is None or ints.is_ref():
            return None
        scalar = ints.name == "value_int"
        values = [ints.value] if scalar else list(ints.value)
        return ShapeValue(tuple(Dim.of(int(v)) for v in values), scalar)
    if node.op_type not in _EVALUATED or (value.shape is not None and len(value.shape) > 1):
        return None  # checked before the inputs: never a walk over the data path
    try:
        return _evaluate(node, _depth + 1, memo)
    except (TypeError, ValueError, IndexError, ZeroDivisionError):  # an unreadable node: no fact
        return None


def _evaluate(node: ir.Node, depth: int, memo: dict) -> ShapeValue | None:
    op, ins = node.op_type, node.inputs
    if op == "Shape":
        dims = value_dims(ins[0], 0, memo)
        if dims is None:
            return None
        start, end = attr_int(node, "start", 0), attr_int(node, "end", None)
        return ShapeValue(tuple(dims[start:end]), False)
    if op == "Size":
        dims = value_dims(ins[0], 0, memo)
        return None if dims is None else ShapeValue((product(dims),), True)
    args = [shape_value(v, depth, memo) for v in ins]
    if not args or args[0] is None:
        return None
    first = args[0]
    if op == "ConstantOfShape":
        return _filled(node, first)
    if op in ("Identity", "Cast"):
        to = attr_int(node, "to", None)
        ok = op == "Identity" or (to is not None and ir.DataType(to) in SHAPE_TYPES)
        return first if ok else None
    if op == "Gather" and len(args) > 1 and args[1] is not None and not first.scalar:
        index = args[1].ints
        if attr_int(node, "axis", 0) != 0 or index is None:
            return None
        rank = len(first.dims)
        picked = tuple(first.dims[i + rank if i < 0 else i] for i in index)
        return ShapeValue(picked, args[1].scalar)
    if op == "Slice" and not first.scalar:
        return _slice(first, args[1:])
    if op == "Concat":
        if attr_int(node, "axis", None) not in (0, -1) or any(a is None or a.scalar for a in args):
            return None
        return ShapeValue(tuple(d for a in args for d in a.dims), False)  # type: ignore[union-attr]
    if op == "Unsqueeze" and first.scalar and node_axes(node) in ([0], [-1]):
        return ShapeValue(first.dims, False)
    if op in ("Squeeze", "Reshape") and len(first.dims) == 1:
        target = const_ints(ins[1]) if op == "Reshape" and len(ins) > 1 else None
        if op == "Squeeze" and node_axes(node) in ([], [0], [-1]):
            return ShapeValue(first.dims, True)
        if target is not None and target in ([], [1], [-1]):
            return ShapeValue(first.dims, target == [])
        return None
    if op == "ReduceProd" and not first.scalar and node_axes(node) in ([], [0], [-1]):
        if attr_int(node, "noop_with_empty_axes", 0) and not node_axes(node):
            return None
        return ShapeValue((product(first.dims),), not attr_int(node, "keepdims", 1))
    if op in ("Mul", "Div", "Add", "Sub") and len(args) == 2 and args[1] is not None:
        return _arithmetic(op, first, args[1])
    return None


def _filled(node: ir.Node, shape: ShapeValue) -> ShapeValue | None:
    """``ConstantOfShape([n])`` with an integer fill: ``n`` copies of it (a 1-D shape, say)."""
    count = shape.ints
    if shape.scalar or count is None or len(count) != 1 or not 0 <= count[0] <= _MAX_RANK:
        return None
    attr = node.attributes.get("value")
    if attr is None or attr.is_ref():
        return None  # the default fill is float 0: not a shape
    fill = attr.value
    if fill.dtype not in SHAPE_TYPES or fill.size != 1:
        return None
    return ShapeValue((Dim.of(int(fill.numpy().reshape(-1)[0])),) * count[0], False)


def _slice(data: ShapeValue, args: list[ShapeValue | None]) -> ShapeValue | None:
    """``Slice`` of a 1-D shape along axis 0 with constant starts / ends (/ axes, steps > 0)."""
    ints = [a.ints if a is not None else None for a in args]
    if len(ints) < 2 or ints[0] is None or ints[1] is None or len(ints[0]) != 1:
        return None
    if len(ints) > 2 and ints[2] not in ([0], [-1]):
        return None
    step = ints[3][0] if len(ints) > 3 and ints[3] is not None else 1
    if len(ints) > 3 and ints[3] is None or step <= 0:
        return None
    return ShapeValue(tuple(data.dims[ints[0][0] : ints[1][0] : step]), False)


def _arithmetic(op: str, a: ShapeValue, b: ShapeValue) -> ShapeValue | None:
    """Element-wise ``Mul`` / exact ``Div`` of products, ``Add`` / ``Sub`` of numbers."""
    if len(a.dims) != len(b.dims) and 1 not in (len(a.dims), len(b.dims)):
        return None
    n = max(len(a.dims), len(b.dims))
    xs = a.dims * n if len(a.dims) == 1 else a.dims
    ys = b.dims * n if len(b.dims) == 1 else b.dims
    out = []
    for x, y in zip(xs, ys, strict=True):
        if op == "Mul":
            out.append(x * y)
        elif op == "Div":
            q = x.divide(y)  # only an exact quotient: integer Div truncates otherwise
            if q is None or (q.coef < 0):
                return None
            out.append(q)
        elif x.syms or y.syms:
            return None
        else:
            out.append(Dim.of(x.coef + y.coef if op == "Add" else x.coef - y.coef))
    return ShapeValue(tuple(out), a.scalar and b.scalar)
