"""Symbolic shapes of onnx-ir values: :class:`Dim` products, Reshape targets, dims as the graph fixes them.

A :class:`Dim` is ``coef * sym_1 * sym_2 ...``: an integer times named factors (a symbolic dim of
a declared shape, or an unknown size tied to the value and axis it comes from).
:func:`reshape_dims` applies a constant ``Reshape`` target to symbolic dims; :func:`value_dims`
and :func:`lead_dims` give the dims of a value as the graph fixes them (declared or inferred
shapes, and what shape-preserving, broadcasting and reshaping ops imply): a static export's
concrete token count then equals the product a Reshape target must have. The names also resolve
from :mod:`._graph_facts`, where the other small graph facts live.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import (
    _ELEMENTWISE_BINARY,
    _ELEMENTWISE_UNARY,
    attr_int,
    const_ints,
    node_axes,
    normalize_axes,
)

__all__ = ["Dim", "lead_dims", "product", "reshape_dims", "value_dims"]


# -- symbolic shapes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Dim:
    """A dimension as a product ``coef * sym_1 * sym_2 ...`` of an int and named factors."""

    coef: int = 1
    syms: tuple[str, ...] = ()

    @staticmethod
    def sym(name: str) -> Dim:
        """A named, unknown dimension."""
        return Dim(1, (name,))

    @staticmethod
    def of(n: int) -> Dim:
        """A known dimension."""
        return Dim(int(n), ())

    def __mul__(self, other: Dim) -> Dim:
        """The product of two dims."""
        return Dim(self.coef * other.coef, tuple(sorted(self.syms + other.syms)))

    def divide(self, other: Dim) -> Dim | None:
        """``self / other`` when it is exact (as a product of factors), else None."""
        if other.coef == 0 or self.coef % other.coef:
            return None
        mine, theirs = Counter(self.syms), Counter(other.syms)
        if theirs - mine:
            return None
        return Dim(self.coef // other.coef, tuple(sorted((mine - theirs).elements())))

    def __str__(self) -> str:
        """E.g. ``2*M`` or ``64``."""
        parts = ([str(self.coef)] if self.coef != 1 or not self.syms else []) + list(self.syms)
        return "*".join(parts)


def product(dims: Sequence[Dim]) -> Dim:
    """The product of ``dims``."""
    out = Dim.of(1)
    for d in dims:
        out = out * d
    return out


def reshape_dims(
    in_dims: Sequence[Dim], shape: Sequence[int | Dim], allowzero: int = 0
) -> list[Dim] | None:
    """Apply ``Reshape(shape)`` to a symbolic input shape; None if not provably valid.

    ``0`` copies the input dim at the same position (``allowzero=0``), ``-1`` takes what is left.
    A target computed in the graph may hold symbolic entries (a :class:`Dim` with factors): such
    an entry is that size, as the graph computed it.
    """
    out: list[Dim | None] = []
    infer_at = None
    for i, s in enumerate(shape):
        if isinstance(s, Dim):
            if s.syms:
                out.append(s)
                continue
            s = s.coef
        if s == 0 and not allowzero:
            if i >= len(in_dims):
                return None
            out.append(in_dims[i])
        elif s == -1:
            if infer_at is not None:
                return None
            infer_at = i
            out.append(None)
        elif s > 0:
            out.append(Dim.of(s))
        else:
            return None
    total = product(in_dims)
    known = product([d for d in out if d is not None])
    if infer_at is None:
        return out if known == total else None  # type: ignore[return-value]
    rest = total.divide(known)
    if rest is None:
        return None
    out[infer_at] = rest
    return out  # type: ignore[return-value]


# -- dims of values ----------------------------------------------------------------------------

#: Ops whose output has the shape of their first input.
_SAME_SHAPE = _ELEMENTWISE_UNARY - {"TopK"} | {
    "Sqrt", "Reciprocal", "Abs", "Not", "IsNaN",
    "ScatterElements", "ScatterND", "Scatter",  # the output is the data input, updated
}  # fmt: skip


def _unknown(value: ir.Value, axis: int) -> Dim:
    """A symbol for an unknown dim of ``value``, shared only with dims proved equal to it."""
    return Dim.sym(f"{value.name or id(value)}[{axis}]")


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
            out.append(_unknown(value, i))
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


def _broadcast(a: list[Dim], b: list[Dim], out_value: ir.Value) -> list[Dim] | None:
    """Multidirectional broadcasting of two symbolic shapes (None for an invalid pair).

    Two different unknown dims make an unknown dim of ``out_value`` (the larger, at run time).
    """
    n = max(len(a), len(b))
    a = [Dim.of(1)] * (n - len(a)) + a
    b = [Dim.of(1)] * (n - len(b)) + b
    out = []
    for x, y in zip(a, b, strict=True):
        if x == y or y == Dim.of(1):
            out.append(x)
        elif x == Dim.of(1):
            out.append(y)
        elif not y.syms and x.syms:  # x unknown, y a size: a valid model has x == y or x == 1
            out.append(y)
        elif not x.syms and y.syms:
            out.append(x)
        elif x.syms and y.syms:
            out.append(_unknown(out_value, len(out)))
        else:
            return None  # two different sizes, neither 1: not a valid graph
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
        return (
            None if target is None else reshape_dims(first, target, attr_int(node, "allowzero", 0))
        )
    if op == "Tile":
        repeats = const_ints(ins[1]) if len(ins) > 1 else None
        if repeats is None or len(repeats) != len(first) or min(repeats, default=1) < 1:
            return None
        return [d * Dim.of(r) for d, r in zip(first, repeats, strict=True)]
    if op == "Slice":
        return _sliced_dims(node, first)
    if op == "Split":
        return _split_dims(node, value, first)
    if op == "Expand":
        shape = const_ints(ins[1]) if len(ins) > 1 else None
        return None if shape is None else _broadcast(first, [Dim.of(s) for s in shape], value)
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
        if k is None or len(k) != 1 or axis is None:
            return None
        return [Dim.of(k[0]) if i == axis[0] else d for i, d in enumerate(first)]
    if op == "MatMul":
        second = value_dims(ins[1], depth, memo)
        if second is None or len(first) < 2 or len(second) < 2:
            return None
        batch = _broadcast(first[:-2], second[:-2], value)
        return None if batch is None else [*batch, first[-2], second[-1]]
    if op == "Gemm":
        second = value_dims(ins[1], depth, memo) if len(ins) > 1 else None
        if second is None or len(first) != 2 or len(second) != 2:
            return None
        rows = first[1] if attr_int(node, "transA", 0) else first[0]
        cols = second[0] if attr_int(node, "transB", 0) else second[1]
        return [rows, cols]
    if op in _ELEMENTWISE_BINARY or op in _COMPARISONS:
        second = value_dims(ins[1], depth, memo) if len(ins) > 1 else None
        return None if second is None else _broadcast(first, second, value)
    if op in _REDUCTIONS:
        return _reduced_dims(node, first)
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


def _reduced_dims(node: ir.Node, first: list[Dim]) -> list[Dim] | None:
    """A reduction's dims: the reduced axes dropped, or kept as 1 (``keepdims``, the default)."""
    axes = node_axes(node)
    if axes is None:
        return None
    if not axes:  # no axes: all of them, unless noop_with_empty_axes
        if attr_int(node, "noop_with_empty_axes", 0):
            return first
        axes = list(range(len(first)))
    normal = normalize_axes(axes, len(first))
    if normal is None:
        return None
    keep = attr_int(node, "keepdims", 1)
    return [Dim.of(1) if i in normal else d for i, d in enumerate(first) if keep or i not in normal]


def _target_dims(target: ir.Value | None, memo: dict) -> list[int | Dim] | None:
    """A Reshape / ConstantOfShape target: constant ints, or what a shape computation holds."""
    if target is None:
        return None
    ints = const_ints(target)
    if ints is not None:
        return list(ints)
    # the evaluator of computed shapes reads value_dims itself: imported here, not at the top
    from onnx_moe_fuse.rewrites.graph.shape_values import shape_value

    computed = shape_value(target, 0, memo)
    return None if computed is None or computed.scalar else list(computed.dims)


def _constant_of_shape_dims(node: ir.Node, memo: dict) -> list[Dim] | None:
    """``ConstantOfShape(s)``: the dims are the elements of ``s`` (a size, never a copy marker)."""
    target = _target_dims(node.inputs[0], memo) if node.inputs else None
    if target is None:
        return None
    dims = [d if isinstance(d, Dim) else Dim.of(d) for d in target]
    return None if any(d.coef < 0 for d in dims) else dims


def _split_dims(node: ir.Node, value: ir.Value, first: list[Dim]) -> list[Dim] | None:
    """One ``Split`` output: its piece of the axis.

    The sizes come from the input or the attribute, else equal parts of a known size (the
    count of outputs; ``num_outputs`` rounds up, the last piece the smaller one).
    """
    axis = normalize_axes([attr_int(node, "axis", 0)], len(first))  # type: ignore[list-item]
    if axis is None:
        return None
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        sizes = const_ints(node.inputs[1])
    elif "split" in node.attributes:
        attr = node.attributes["split"]
        sizes = None if attr.is_ref() else [int(v) for v in attr.value]
    else:
        whole, parts = first[axis[0]], len(node.outputs)
        if whole.syms or parts == 0:
            return None
        step = -(-whole.coef // parts)  # ceil: num_outputs' last piece is the smaller one
        sizes = [min(step, whole.coef - i * step) for i in range(parts)]
    if sizes is None or len(sizes) != len(node.outputs) or min(sizes, default=0) < 0:
        return None
    whole = first[axis[0]]
    if not whole.syms and sum(sizes) != whole.coef:
        return None  # not a valid Split of this axis
    out = list(first)
    out[axis[0]] = Dim.of(sizes[value.index()])  # type: ignore[index]
    return out


#: ``Slice`` ends at or past this reach the end of any axis (torch writes INT64_MAX).
_TO_THE_END = 2**62


def _sliced_dims(node: ir.Node, first: list[Dim]) -> list[Dim] | None:
    """``Slice`` with constant starts / ends / axes / steps; a symbolic axis only if kept whole."""
    args = [const_ints(v) if v is not None else None for v in node.inputs[1:5]]
    if (
        len(args) < 2
        or args[0] is None
        or args[1] is None
        or any(a is None for a, v in zip(args, node.inputs[1:5], strict=False) if v is not None)
    ):
        return None
    starts, ends = args[0], args[1]
    axes = args[2] if len(args) > 2 and args[2] is not None else list(range(len(starts)))
    steps = args[3] if len(args) > 3 and args[3] is not None else [1] * len(starts)
    axes = normalize_axes(axes, len(first))
    if axes is None or not len(starts) == len(ends) == len(axes) == len(steps):
        return None
    out = list(first)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        d = first[axis]
        if step == 0:
            return None
        if not d.syms:
            out[axis] = Dim.of(len(range(*slice(start, end, step).indices(d.coef))))
        elif start == 0 and end >= _TO_THE_END and step == 1:
            continue  # the whole axis, whatever its size
        else:
            return None
    return out
