"""Symbolic shapes of onnx-ir values: their dims, and what shape tensors hold, as the graph fixes them.

:func:`value_dims` and :func:`lead_dims` give the dims of a value (:class:`~.dims.Dim` products)
as the graph fixes them (declared or inferred shapes, and what shape-preserving, broadcasting
and reshaping ops imply): a static export's concrete token count then equals the product a
Reshape target must have.

:func:`shape_value` evaluates an integer tensor of rank 0 or 1 that the graph computes from
shapes (``Shape``, ``Size``, ``Gather``, ``Slice``, ``Concat``, ``Unsqueeze``, ``Squeeze``,
``Reshape``, ``ReduceProd``, ``Mul``, ``Div``, ``Add``, ``Sub``) into a :class:`ShapeValue`, each
element a ``Dim`` product (unknown sizes as symbols tied to the value and axis they come from).
It reads declared shapes and constants only, never the data path, and returns None for anything
it cannot prove. ``FoldShapesPass`` (``canonical/shapes/fold_shapes.py``) turns the provable
ones into constants.

The two recurse into each other (a Reshape target may be computed from shapes; a shape is read
from dims), so they share one module and one memo per question.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.dims import (
    Dim,
    broadcast_dims,
    product,
    reduced_dims,
    reshape_dims,
    sliced_dims,
    split_dims,
    unknown_dim,
)
from onnx_moe_fuse.rewrites.graph.facts import (
    ELEMENTWISE_BINARY,
    ELEMENTWISE_UNARY,
    attr_int,
    const_ints,
    node_axes,
    normalize_axes,
)

__all__ = [
    "INT64_INPUTS",
    "SHAPE_ARITHMETIC",
    "SHAPE_TYPES",
    "ShapeValue",
    "lead_dims",
    "shape_value",
    "value_dims",
]


# -- dims of values ----------------------------------------------------------------------------

#: Ops whose output has the shape of their first input.
_SAME_SHAPE = ELEMENTWISE_UNARY - {"TopK"} | {
    "Sqrt", "Reciprocal", "Abs", "Not", "IsNaN",
    "ScatterElements", "ScatterND", "Scatter",  # the output is the data input, updated
    "RMSNormalization", "LayerNormalization",  # output 0 normalises its input (opset 23's RMS)
}  # fmt: skip


def value_dims(
    value: ir.Value | None, _depth: int = 0, _memo: dict[int, list[Dim] | None] | None = None
) -> list[Dim] | None:
    """The dims of ``value``: sizes the graph fixes as ints, unknown sizes as symbols.

    A declared (or inferred) int size is taken as a fact. An unknown size is followed through the
    producer where it provably equals a dim of another value (Unsqueeze/Squeeze/Reshape/Expand,
    Transpose, Gather, TopK, MatMul, same-shape ops), so that ``Shape(x)[0]`` and the first dim
    of ``Unsqueeze(x, [1])`` get the same symbol; otherwise it is a symbol of its own (named after
    the value and the axis). Declared dim names (``dim_param``) are never trusted to be equal.
    None when the rank is unknown.
    """
    if value is None or _depth > 48:
        return None
    if value.shape is not None and all(isinstance(d, int) for d in value.shape):
        return [Dim.of(d) for d in value.shape]  # type: ignore[arg-type]
    memo = {} if _memo is None else _memo  # one walk per question: shared inputs once, not 2^n
    if id(value) in memo:
        return memo[id(value)]
    memo[id(value)] = None  # a cycle (an invalid graph) reads as unknown
    memo[id(value)] = out = _value_dims(value, _depth, memo)
    return out


def _value_dims(value: ir.Value, depth: int, memo: dict) -> list[Dim] | None:
    tensor = None if value.is_graph_input() else ir.convenience.get_const_tensor(value)
    if tensor is not None:  # the tensor's shape only: its data is not read
        return [Dim.of(d) for d in tensor.shape]
    node = value.producer()
    derived = None
    if node is not None and node.domain in ("", "ai.onnx"):
        try:
            derived = _derived_dims(node, value, depth + 1, memo)
        except (TypeError, ValueError, IndexError):  # an op the helper cannot read: no fact
            derived = None
    if value.shape is None:
        return derived
    if derived is not None and len(derived) != len(value.shape):
        derived = None  # the declared rank disagrees with the producer: trust neither's symbols
    out = []
    for i, d in enumerate(value.shape):
        if isinstance(d, int):
            out.append(Dim.of(d))
        elif derived is not None:
            out.append(derived[i])
        else:
            out.append(unknown_dim(value, i))
    return out


def lead_dims(value: ir.Value | None, count: int, prefix: str = "L") -> list[Dim]:
    """The first ``count`` dims of ``value``: concrete where the graph fixes them.

    An unknown dim is the symbol ``{prefix}{i}``, which is all a proof may assume of it (any
    value). A known size is its int, so a proof that needs ``T*k`` rows accepts a Reshape to
    ``16`` exactly when ``T`` is 8 and ``k`` is 2.
    """
    dims = value_dims(value) or []
    out = []
    for i in range(count):
        d = dims[i] if i < len(dims) else None
        out.append(d if d is not None and not d.syms else Dim.sym(f"{prefix}{i}"))
    return out


def _derived_dims(node: ir.Node, value: ir.Value, depth: int, memo: dict) -> list[Dim] | None:
    """The dims of ``value`` (an output of ``node``) from the dims of the node's inputs."""
    op, ins = node.op_type, node.inputs
    if value is not node.outputs[0] and op not in ("TopK", "Split"):
        return None
    if op == "ConstantOfShape":  # its input is a shape, not a tensor of that shape
        return _constant_of_shape_dims(node, memo)
    first = value_dims(ins[0], depth, memo) if ins and ins[0] is not None else None
    if first is None:
        return None
    if op in _SAME_SHAPE:
        return first
    if op == "Unsqueeze":
        axes = node_axes(node)
        axes = None if axes is None else normalize_axes(axes, len(first) + len(axes))
        if not axes:
            return None
        rest = iter(first)
        return [Dim.of(1) if i in axes else next(rest) for i in range(len(first) + len(axes))]
    if op == "Squeeze":
        axes = node_axes(node)
        axes = None if not axes else normalize_axes(axes, len(first))
        return None if axes is None else [d for i, d in enumerate(first) if i not in axes]
    if op == "Reshape":
        target = _target_dims(ins[1], memo) if len(ins) > 1 else None
        return None if target is None else _reshaped_dims(node, value, first, target)
    if op == "Tile":
        repeats = const_ints(ins[1]) if len(ins) > 1 else None
        if repeats is None or len(repeats) != len(first) or min(repeats, default=1) < 1:
            return None
        return [d * Dim.of(r) for d, r in zip(first, repeats, strict=True)]
    if op == "Slice":
        return sliced_dims(node, first)
    if op == "Split":
        return split_dims(node, value, first)
    if op == "Expand":
        shape = const_ints(ins[1]) if len(ins) > 1 else None
        if shape is None and memo.get(_FILLS) and len(ins) > 1:
            if _is_fill(ins[0]):  # torch's zeros_like
                return _filled_dims(ins[1], depth, memo)
            return _expanded_dims(first, ins[1], value, depth, memo)
        return None if shape is None else broadcast_dims(first, [Dim.of(s) for s in shape], value)
    if op == "Transpose":
        perm = node.attributes.get("perm")
        order = list(range(len(first)))[::-1] if perm is None else [int(p) for p in perm.value]
        return [first[p] for p in order] if sorted(order) == list(range(len(first))) else None
    if op == "Gather":
        indices = value_dims(ins[1], depth, memo)
        axis = normalize_axes([attr_int(node, "axis", 0)], len(first))  # type: ignore[list-item]
        if indices is None or axis is None:
            return None
        return first[: axis[0]] + indices + first[axis[0] + 1 :]
    if op == "TopK":
        k = const_ints(ins[1]) if len(ins) > 1 else None
        axis = normalize_axes([attr_int(node, "axis", -1)], len(first))  # type: ignore[list-item]
        kept = [Dim.of(k[0])] if k is not None and len(k) == 1 else None
        if kept is None and len(ins) > 1:  # k computed from shapes: an argsort keeps every row
            sv = shape_value(ins[1])
            kept = list(sv.dims) if sv is not None and len(sv.dims) == 1 else None
        if kept is None or axis is None:
            return None
        return [kept[0] if i == axis[0] else d for i, d in enumerate(first)]
    if op == "GatherND" and len(ins) > 1 and attr_int(node, "batch_dims", 0) == 0:
        indices = value_dims(ins[1], depth, memo)  # out: indices[:-1] + data[m:], m = indices[-1]
        if indices is None or not indices or indices[-1].syms or indices[-1].coef > len(first):
            return None
        return [*indices[:-1], *first[indices[-1].coef :]]
    if op == "MatMul":
        second = value_dims(ins[1], depth, memo)
        if second is None or len(first) < 2 or len(second) < 2:
            return None
        batch = broadcast_dims(first[:-2], second[:-2], value)
        return None if batch is None else [*batch, first[-2], second[-1]]
    if op == "Gemm":
        second = value_dims(ins[1], depth, memo) if len(ins) > 1 else None
        if second is None or len(first) != 2 or len(second) != 2:
            return None
        rows = first[1] if attr_int(node, "transA", 0) else first[0]
        cols = second[0] if attr_int(node, "transB", 0) else second[1]
        return [rows, cols]
    if op in ELEMENTWISE_BINARY or op in _COMPARISONS:
        second = value_dims(ins[1], depth, memo) if len(ins) > 1 else None
        return None if second is None else broadcast_dims(first, second, value)
    if op == "GatherElements" and len(ins) > 1:  # the output has the indices' shape
        return value_dims(ins[1], depth, memo)
    if op == "Where" and len(ins) == 3:  # the broadcast of the condition and both branches
        dims = first
        for other in ins[1:]:
            more = value_dims(other, depth, memo) if other is not None else None
            dims = None if more is None or dims is None else broadcast_dims(dims, more, value)
        return dims
    if op in _REDUCTIONS:
        return reduced_dims(node, first)
    if op == "OneHot":
        depth_value = const_ints(ins[1]) if len(ins) > 1 else None
        axis = normalize_axes([attr_int(node, "axis", -1)], len(first) + 1)  # type: ignore[list-item]
        if depth_value is None or len(depth_value) != 1 or depth_value[0] < 1 or axis is None:
            return None
        return [*first[: axis[0]], Dim.of(depth_value[0]), *first[axis[0] :]]
    return None


#: Other element-wise binary ops (comparisons, integer arithmetic on ids): the broadcast of
#: their two inputs' dims.
_COMPARISONS = frozenset(
    {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Mod"}
)
#: Reductions with ``axes`` (an input from opset 13 / 18, an attribute before) and ``keepdims``.
_REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd"})


def _reshaped_dims(
    node: ir.Node, value: ir.Value, first: list[Dim], target: list[int | Dim]
) -> list[Dim] | None:
    """A Reshape's output dims: its target applied to the input's dims, or the target alone.

    Where the input's dims do not prove the element count (dims the graph does not relate to
    the target's: JetMoE's dynamic export reshapes rows scattered into zeros of a computed shape
    to ``[Shape(input_ids)[0], Shape(input_ids)[1], H]``), the target's sizes are still the
    output's in every run: Reshape fails on any other count. So a size (a number or a computed
    product) and a ``0`` copying an input dim are facts of the output; a ``-1`` (what is left,
    unproved) is a symbol of the output's own. Nothing is claimed of the input's dims.
    """
    allowzero = attr_int(node, "allowzero", 0)
    applied = reshape_dims(first, target, allowzero)
    if applied is not None:
        return applied
    out, inferred = [], 0
    for i, s in enumerate(target):
        size = s if isinstance(s, Dim) else Dim.of(s)
        if size.syms:
            out.append(size)
        elif size.coef > 0:
            out.append(size)
        elif size.coef == 0 and not allowzero and i < len(first):
            out.append(first[i])
        elif size.coef == -1 and not inferred:
            inferred += 1
            out.append(unknown_dim(value, i))
        else:
            return None  # two -1s, a 0 past the input's rank, allowzero's 0: not read here
    return out


def _target_dims(target: ir.Value | None, memo: dict) -> list[int | Dim] | None:
    """A Reshape / ConstantOfShape target: constant ints, or what a shape computation holds."""
    if target is None:
        return None
    ints = const_ints(target)
    if ints is not None:
        return list(ints)
    computed = shape_value(target, 0, memo)
    return None if computed is None or computed.scalar else list(computed.dims)


#: Memo key: the question follows Expands of a fill to computed shapes (:func:`fill_dims`).
_FILLS = "follow fills"


def fill_dims(value: ir.Value | None) -> list[Dim] | None:
    """:func:`value_dims`, also through ``Expand(x, s)`` to a shape ``s`` computed at run time.

    torch's ``zeros_like(v)`` exports as ``Expand(0, Shape(v))``: its dims are ``v``'s. An
    ``Expand`` of data to a computed ``s`` (DeepSeek-V2's group mask ``[T, G, 1]`` expanded to
    ``[T, G, E/G]`` by ``Concat(Shape(x)[0] * Shape(x)[1], G, E/G)``) has the broadcast of its
    input's dims and ``s``'s. Only the questions that need it ask (a combine's weights against
    its outputs, a router Expand whose rows the plain dims cannot equate): evaluating every
    computed target (attention masks, every layer) in every question walks far up a whole
    model, and costs the fuser its time.
    """
    return value_dims(value, 0, {_FILLS: True})


def _is_fill(value: ir.Value | None) -> bool:
    """A constant with one element: an Expand of it is a tensor of its target's shape."""
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    return tensor is not None and int(np.prod(tensor.shape, dtype=np.int64)) == 1


def _filled_dims(target: ir.Value | None, depth: int, memo: dict) -> list[Dim] | None:
    """``Expand(c, s)`` of a one-element ``c`` to a shape computed at run time: ``s``'s dims.

    Only for a fill (``zeros_like(v)`` is ``Expand(0, Shape(v))``): the target's elements are
    then the output's dims, whatever the rank (a fill of rank <= the target's broadcasts to it).
    """
    computed = shape_value(target, depth, memo) if target is not None else None  # this budget
    if computed is None or computed.scalar:
        return None
    out = list(computed.dims)
    return None if any(d.coef < 0 for d in out) else out


def _expanded_dims(
    first: list[Dim], target: ir.Value, value: ir.Value, depth: int, memo: dict
) -> list[Dim] | None:
    """``Expand(x, s)`` to a computed ``s``: the broadcast of ``x``'s dims and ``s``'s elements."""
    computed = shape_value(target, depth, memo)
    if computed is None or computed.scalar or any(d.coef < 0 for d in computed.dims):
        return None
    return broadcast_dims(first, list(computed.dims), value)


def _constant_of_shape_dims(node: ir.Node, memo: dict) -> list[Dim] | None:
    """``ConstantOfShape(s)``: the dims are the elements of ``s`` (a size, never a copy marker)."""
    target = _target_dims(node.inputs[0], memo) if node.inputs else None
    if target is None:
        return None
    dims = [d if isinstance(d, Dim) else Dim.of(d) for d in target]
    return None if any(d.coef < 0 for d in dims) else dims


# -- shape tensors ----------------------------------------------------------------------------

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
