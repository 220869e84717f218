"""Small facts about onnx-ir values and nodes that the MoE layer checks rely on.

Everything here reads the graph and never changes it. A helper that cannot establish a fact
returns ``None`` (or raises :class:`Refusal`, for the ``require_*`` helpers) rather than guessing:
a rule must refuse what it cannot prove.

* constants: :func:`const_array`, :func:`const_ints`, :func:`const_float`, :func:`node_axes`;
* static ranks and last dims of values: :func:`static_rank`, :func:`static_last_dim`;
* symbolic shapes: :class:`Dim` (a product of an integer and named factors),
  :func:`reshape_dims`, which applies a constant ``Reshape`` target to a symbolic shape, and
  :func:`value_dims` / :func:`lead_dims`, the dims of a value as the graph fixes them (a declared
  or inferred size is a fact a proof may use: a static export's concrete token count then equals
  the product a Reshape target must have);
* node labels for reports: :func:`label`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _basics

__all__ = [
    "Refusal",
    "label",
    "value_label",
    "const_array",
    "const_ints",
    "const_float",
    "attr_int",
    "attr_float",
    "attr_str",
    "node_axes",
    "normalize_axes",
    "static_rank",
    "static_last_dim",
    "Dim",
    "reshape_dims",
    "value_dims",
    "lead_dims",
    "product",
    "default_opset",
]

Refusal = _basics.MatchFailureError
"""Raised by an analysis step that refuses a match; carries a plain-words reason."""


def label(node: ir.Node | None) -> str:
    """A readable name for ``node``: its name, or ``OpType(first output name)`` if unnamed."""
    if node is None:
        return "<none>"
    if node.name:
        return node.name
    out = node.outputs[0].name if node.outputs else ""
    return f"{node.op_type}({out})"


def value_label(value: ir.Value | None) -> str:
    """A readable name for ``value`` (its name, or where it comes from)."""
    if value is None:
        return "<absent>"
    if value.name:
        return value.name
    return f"output {value.index()} of {label(value.producer())}"


def default_opset(graph: ir.Graph | None) -> int:
    """The default-domain opset version of ``graph`` (latest known if not declared)."""
    if graph is not None:
        version = graph.opset_imports.get("")
        if version is not None:
            return int(version)
    return 21


# -- constants ---------------------------------------------------------------------------------


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The constant held by ``value`` (initializer or Constant node), or None.

    A graph input that has a default initializer is NOT constant: it can be fed at run time.
    """
    if value is None or value.is_graph_input():
        return None
    tensor = value.const_value
    if tensor is None:
        # A Constant's attribute, read as it is: onnx-ir's get_const_tensor renames the
        # attribute's tensor after the value, and the working copy shares that tensor object
        # with the original model, whose bytes would then change.
        node = value.producer()
        if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            return None
        if len(node.attributes) != 1:
            return None
        ((name, attr),) = node.attributes.items()
        if attr.is_ref():
            return None
        if name in ("value_float", "value_floats"):
            return np.array(attr.value, dtype=np.float32)
        if name in ("value_int", "value_ints"):
            return np.array(attr.value, dtype=np.int64)
        if name != "value":
            return None
        tensor = attr.value
    try:
        return tensor.numpy()
    except Exception:  # external data that cannot be read, unsupported dtype
        return None


def const_ints(value: ir.Value | None) -> list[int] | None:
    """The integer constant held by ``value`` as a flat list, or None."""
    arr = const_array(value)
    if arr is None or arr.dtype.kind not in "iu":
        return None
    return [int(v) for v in arr.reshape(-1)]


def const_float(value: ir.Value | None) -> float | None:
    """The single float held by ``value`` (a scalar or one-element tensor), or None."""
    arr = const_array(value)
    if arr is None or arr.size != 1 or arr.dtype.kind not in "fiu":
        return None
    try:
        return float(np.asarray(arr, dtype=np.float64).reshape(-1)[0])
    except (TypeError, ValueError):
        return None


def attr_int(node: ir.Node, name: str, default: int | None) -> int | None:
    """Integer attribute ``name`` of ``node`` (``default`` when absent)."""
    attr = node.attributes.get(name)
    if attr is None or attr.is_ref():
        return default
    return int(attr.value)


def attr_float(node: ir.Node, name: str, default: float | None) -> float | None:
    """Float attribute ``name`` of ``node`` (``default`` when absent)."""
    attr = node.attributes.get(name)
    if attr is None or attr.is_ref():
        return default
    return float(attr.value)


def attr_str(node: ir.Node, name: str, default: str | None) -> str | None:
    """String attribute ``name`` of ``node`` (``default`` when absent)."""
    attr = node.attributes.get(name)
    if attr is None or attr.is_ref():
        return default
    v = attr.value
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def node_axes(node: ir.Node, input_index: int = 1) -> list[int] | None:
    """The ``axes`` of a Reduce*/Squeeze/Unsqueeze node, from its input or its attribute.

    The input holds them from opset 13 on, the attribute before. Returns ``[]`` when neither is
    given, None when they are not constant.
    """
    if len(node.inputs) > input_index and node.inputs[input_index] is not None:
        return const_ints(node.inputs[input_index])
    attr = node.attributes.get("axes")
    if attr is None:
        return []
    if attr.is_ref():
        return None
    return [int(a) for a in attr.value]


def normalize_axes(axes: Sequence[int], rank: int) -> list[int] | None:
    """``axes`` made non-negative for a tensor of ``rank``; None if one is out of range."""
    out = []
    for a in axes:
        b = a + rank if a < 0 else a
        if not 0 <= b < rank:
            return None
        out.append(b)
    return out


# -- static ranks ------------------------------------------------------------------------------

_ELEMENTWISE_UNARY = frozenset(
    {
        "Softmax",
        "LogSoftmax",
        "Sigmoid",
        "Relu",
        "Tanh",
        "Cast",
        "CastLike",
        "Identity",
        "Neg",
        "Exp",
        "Erf",
        "Gelu",
        "Clip",
        "TopK",
        "DequantizeLinear",
    }
)
_ELEMENTWISE_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"})


def static_rank(value: ir.Value | None, _depth: int = 0) -> int | None:
    """The rank of ``value`` if the graph fixes it (declared shape or a few common producers)."""
    if value is None or _depth > 32:
        return None
    if value.shape is not None:
        return len(value.shape)
    arr = const_array(value)
    if arr is not None:
        return arr.ndim
    node = value.producer()
    if node is None:
        return None
    op = node.op_type
    ins = node.inputs
    if op == "Reshape":
        shape = const_ints(ins[1]) if len(ins) > 1 else None
        return None if shape is None else len(shape)
    if op in _ELEMENTWISE_UNARY and ins:
        return static_rank(ins[0], _depth + 1)
    if op in _ELEMENTWISE_BINARY or op == "MatMul":
        ranks = [static_rank(v, _depth + 1) for v in ins[:2]]
        if any(r is None for r in ranks):
            return None
        return max(ranks)  # type: ignore[type-var]
    if op == "Gemm":
        return 2
    if op == "Transpose" and ins:
        return static_rank(ins[0], _depth + 1)
    if op in ("Unsqueeze", "Squeeze"):
        r = static_rank(ins[0], _depth + 1)
        axes = node_axes(node)
        if r is None or axes is None or (op == "Squeeze" and not axes):
            return None
        return r + len(axes) if op == "Unsqueeze" else r - len(axes)
    if op == "Gather":
        rd, ri = static_rank(ins[0], _depth + 1), static_rank(ins[1], _depth + 1)
        return None if rd is None or ri is None else rd + ri - 1
    return None


def static_last_dim(value: ir.Value | None, _depth: int = 0) -> int | None:
    """The size of the last axis of ``value`` if the graph fixes it, else None."""
    if value is None or _depth > 32:
        return None
    if value.shape is not None and len(value.shape) > 0:
        d = value.shape[-1]
        if isinstance(d, int):
            return d
    arr = const_array(value)
    if arr is not None:
        return int(arr.shape[-1]) if arr.ndim else None
    node = value.producer()
    if node is None:
        return None
    op = node.op_type
    ins = node.inputs
    if op in ("Softmax", "LogSoftmax", "Sigmoid", "Relu", "Tanh", "Cast", "Identity", "Neg"):
        return static_last_dim(ins[0], _depth + 1)
    if op == "MatMul":
        b = ins[1]
        rb = static_rank(b, _depth + 1)
        return static_last_dim(b, _depth + 1) if rb is not None and rb >= 2 else None
    if op == "Gemm":
        b = const_array(ins[1])
        if b is None or b.ndim != 2:
            return None
        trans_b = attr_int(node, "transB", 0)
        return int(b.shape[0] if trans_b else b.shape[1])
    if op in _ELEMENTWISE_BINARY:
        dims = [static_last_dim(v, _depth + 1) for v in ins[:2]]
        known = [d for d in dims if d is not None and d != 1]
        if len(known) >= 1 and all(d is not None for d in dims):
            return known[0] if len(set(known)) == 1 else None
        # one side unknown: only its own producer chain could tell; the known non-1 side fixes
        # the result when the graph is valid (broadcasting never shrinks a dim).
        return known[0] if known else None
    if op == "Reshape":
        shape = const_ints(ins[1]) if len(ins) > 1 else None
        if shape and shape[-1] > 0:
            return shape[-1]
        return None
    if op == "Transpose" and ins:
        arr = const_array(ins[0])
        if arr is None or arr.ndim == 0:
            return None
        perm_attr = node.attributes.get("perm")
        perm = list(perm_attr.value) if perm_attr is not None else list(range(arr.ndim))[::-1]
        return int(arr.shape[perm[-1]]) if len(perm) == arr.ndim else None
    return None


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
    in_dims: Sequence[Dim], shape: Sequence[int], allowzero: int = 0
) -> list[Dim] | None:
    """Apply ``Reshape(shape)`` to a symbolic input shape; None if not provably valid.

    ``0`` copies the input dim at the same position (``allowzero=0``), ``-1`` takes what is left.
    """
    out: list[Dim | None] = []
    infer_at = None
    for i, s in enumerate(shape):
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
_SAME_SHAPE = _ELEMENTWISE_UNARY - {"TopK"} | {"Sqrt", "Reciprocal", "Abs", "Not", "IsNaN"}


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
    if value is not node.outputs[0] and op != "TopK":
        return None
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
        shape = const_ints(ins[1]) if len(ins) > 1 else None
        return None if shape is None else reshape_dims(first, shape, attr_int(node, "allowzero", 0))
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
    if op in _ELEMENTWISE_BINARY:
        second = value_dims(ins[1], depth, memo) if len(ins) > 1 else None
        return None if second is None else _broadcast(first, second, value)
    return None
