"""A small numpy interpreter for the element-wise regions the behaviour checks probe.

:func:`evaluate` runs a region's nodes (in order) on numpy arrays fed for its source values,
reading every other input as a constant (an initializer or a ``Constant`` node's value). It
implements only the ops a region may hold (:data:`OPS`): element-wise unary and binary ops,
``Clip``, comparisons and ``Where``, ``Cast``, and ``Slice``/``Split``/``Gather`` with constant
indices, plus the reductions and ``Softmax`` a router region needs (:data:`REDUCTIONS`). Each op
computes in the dtype of its inputs as ONNX defines it (float32 stays float32, so the region's
own rounding, overflow and cancellation show at the probes); a half-precision input is computed
in float32 and its result rounded back to its type, which is what a half-precision kernel does
per op. An op or attribute outside that set raises :class:`Unsupported` naming the node: the
caller refuses the region rather than guess.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import ml_dtypes
import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import attr_float, attr_int, attr_str, const_array, label

__all__ = ["OPS", "REDUCTIONS", "Unsupported", "evaluate", "numpy_dtype"]

_ONNX_TO_NUMPY = {
    ir.DataType.FLOAT: np.dtype(np.float32),
    ir.DataType.DOUBLE: np.dtype(np.float64),
    ir.DataType.FLOAT16: np.dtype(np.float16),
    ir.DataType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    ir.DataType.BOOL: np.dtype(np.bool_),
    ir.DataType.INT64: np.dtype(np.int64),
    ir.DataType.INT32: np.dtype(np.int32),
}
_HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


class Unsupported(Exception):
    """The region holds a node the interpreter does not implement as ONNX defines it."""

    def __init__(self, node: ir.Node, reason: str) -> None:
        super().__init__(f"{node.op_type} '{label(node)}': {reason}")
        self.node = node
        self.reason = reason


def numpy_dtype(dtype: ir.DataType | None) -> np.dtype | None:
    """The numpy dtype of an ONNX element type the interpreter computes in (None: another)."""
    return _ONNX_TO_NUMPY.get(dtype) if dtype is not None else None


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # ORT's logistic is accurate on both tails; 1 / (1 + exp(-x)) is too, in IEEE arithmetic
    one = x.dtype.type(1)
    return one / (one + np.exp(-x))


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64)).astype(x.dtype)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    t = x.dtype.type
    inner = t(math.sqrt(2.0 / math.pi)) * (x + t(0.044715) * x * x * x)
    return t(0.5) * x * (t(1) + np.tanh(inner))


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    t = x.dtype.type
    return t(0.5) * x * (t(1) + _erf(x / t(math.sqrt(2.0))))


def _f(node: ir.Node, name: str, default: float, x: np.ndarray) -> np.generic:
    value = attr_float(node, name, default)
    return x.dtype.type(default if value is None else value)


def _gelu(node: ir.Node, x: np.ndarray) -> np.ndarray:
    approx = attr_str(node, "approximate", "none")
    if approx not in ("none", "tanh"):
        raise Unsupported(node, f"approximate={approx!r}")
    return _gelu_tanh(x) if approx == "tanh" else _gelu_erf(x)


_UNARY: dict[str, Callable[[ir.Node, np.ndarray], np.ndarray]] = {
    "Identity": lambda n, x: x,
    "Dropout": lambda n, x: x,  # inference: the identity (training_mode is checked below)
    "Neg": lambda n, x: -x,
    "Abs": lambda n, x: np.abs(x),
    "Exp": lambda n, x: np.exp(x),
    "Log": lambda n, x: np.log(x),
    "Sqrt": lambda n, x: np.sqrt(x),
    "Reciprocal": lambda n, x: x.dtype.type(1) / x,
    "Sigmoid": lambda n, x: _sigmoid(x),
    "Tanh": lambda n, x: np.tanh(x),
    "Erf": lambda n, x: _erf(x),
    "Relu": lambda n, x: np.maximum(x, x.dtype.type(0)),
    "Softplus": lambda n, x: np.logaddexp(x.dtype.type(0), x),
    "Softsign": lambda n, x: x / (x.dtype.type(1) + np.abs(x)),
    "Sign": lambda n, x: np.sign(x),
    "Floor": lambda n, x: np.floor(x),
    "Ceil": lambda n, x: np.ceil(x),
    "Round": lambda n, x: np.round(x),
    "Sin": lambda n, x: np.sin(x),
    "Cos": lambda n, x: np.cos(x),
    "Not": lambda n, x: np.logical_not(x),
    "Elu": lambda n, x: np.where(x > 0, x, _f(n, "alpha", 1.0, x) * np.expm1(x)),
    "Celu": lambda n, x: (
        np.maximum(x, 0)
        + np.minimum(0, _f(n, "alpha", 1.0, x) * np.expm1(x / _f(n, "alpha", 1.0, x)))
    ),
    "Selu": lambda n, x: (
        _f(n, "gamma", 1.05070102214813232421875, x)
        * np.where(x > 0, x, _f(n, "alpha", 1.67326319217681884765625, x) * np.expm1(x))
    ),
    "LeakyRelu": lambda n, x: np.where(x >= 0, x, _f(n, "alpha", 0.01, x) * x),
    "ThresholdedRelu": lambda n, x: np.where(x > _f(n, "alpha", 1.0, x), x, x.dtype.type(0)),
    "HardSigmoid": lambda n, x: np.clip(_f(n, "alpha", 0.2, x) * x + _f(n, "beta", 0.5, x), 0, 1),
    "HardSwish": lambda n, x: x * np.clip(x / x.dtype.type(6) + x.dtype.type(0.5), 0, 1),
    "Mish": lambda n, x: x * np.tanh(np.logaddexp(x.dtype.type(0), x)),
    "Gelu": _gelu,
    "Swish": lambda n, x: x * _sigmoid(_f(n, "alpha", 1.0, x) * x),
}
_MS_UNARY: dict[str, Callable[[ir.Node, np.ndarray], np.ndarray]] = {
    "Gelu": lambda n, x: _gelu_erf(x),
    "FastGelu": lambda n, x: _gelu_tanh(x),
    "QuickGelu": lambda n, x: x * _sigmoid(_f(n, "alpha", 1.702, x) * x),
}
_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": np.divide,
    "Pow": np.power,
    "PRelu": lambda x, s: np.where(x < 0, s * x, x),
    "Greater": np.greater,
    "Less": np.less,
    "GreaterOrEqual": np.greater_equal,
    "LessOrEqual": np.less_equal,
    "Equal": np.equal,
    "And": np.logical_and,
    "Or": np.logical_or,
    "Xor": np.logical_xor,
}
_VARIADIC: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "Min": np.minimum,
    "Max": np.maximum,
    "Sum": np.add,
}
#: Column-routing ops (constant indices): the region's only non-element-wise ops.
COLUMN_OPS = frozenset({"Slice", "Split", "Gather"})
#: The reductions and softmaxes a router region may hold (along one axis, constant axes).
REDUCTIONS = frozenset({"ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean", "Softmax"})
#: Every op (default domain) :func:`evaluate` implements.
OPS = frozenset(
    {*_UNARY, *_BINARY, *_VARIADIC, "Clip", "Where", "Cast", "CastLike", "Mean"}
    | COLUMN_OPS
    | REDUCTIONS
)
#: The com.microsoft ops :func:`evaluate` implements.
MS_OPS = frozenset(_MS_UNARY)


def _ints(xs: list[np.ndarray | None], i: int) -> list[int] | None:
    if len(xs) <= i or xs[i] is None:
        return None
    return [int(v) for v in np.asarray(xs[i]).reshape(-1)]


def _slice(node: ir.Node, xs: list[np.ndarray | None]) -> np.ndarray:
    x = xs[0]
    assert x is not None
    starts, ends = _ints(xs, 1), _ints(xs, 2)
    if starts is None or ends is None:
        raise Unsupported(node, "no starts/ends")
    axes = _ints(xs, 3) or list(range(len(starts)))
    steps = _ints(xs, 4) or [1] * len(starts)
    index: list[slice] = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        index[a % x.ndim] = slice(s, e, st)
    return x[tuple(index)]


def _split(node: ir.Node, xs: list[np.ndarray | None]) -> list[np.ndarray]:
    x = xs[0]
    assert x is not None
    axis = (attr_int(node, "axis", 0) or 0) % x.ndim
    sizes = _ints(xs, 1)
    if sizes is None and "split" in node.attributes:
        sizes = [int(v) for v in node.attributes["split"].value]
    parts = len(node.outputs)
    if sizes is None:
        width = x.shape[axis]
        each = -(-width // parts)  # ONNX: the last chunk may be smaller (num_outputs form)
        sizes = [min(each, width - i * each) for i in range(parts)]
    bounds = np.cumsum([0, *sizes])
    return [np.take(x, np.arange(bounds[i], bounds[i + 1]), axis=axis) for i in range(parts)]


def _reduce(node: ir.Node, x: np.ndarray, axes_input: np.ndarray | None) -> np.ndarray:
    keep = bool(attr_int(node, "keepdims", 1))
    if axes_input is not None:
        axes = tuple(int(a) % x.ndim for a in np.asarray(axes_input).reshape(-1))
    elif "axes" in node.attributes:
        axes = tuple(int(a) % x.ndim for a in node.attributes["axes"].value)
    else:
        axes = ()
    if not axes:
        if attr_int(node, "noop_with_empty_axes", 0):
            return x
        axes = tuple(range(x.ndim))
    fn = {"ReduceSum": np.sum, "ReduceMax": np.max, "ReduceMin": np.min, "ReduceMean": np.mean}
    return fn[node.op_type](x, axis=axes, keepdims=keep).astype(x.dtype)


def _softmax(node: ir.Node, x: np.ndarray) -> np.ndarray:
    axis = attr_int(node, "axis", -1)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def _run(node: ir.Node, xs: list[np.ndarray | None]) -> list[np.ndarray]:
    op = node.op_type
    if node.domain == "com.microsoft":
        if op not in _MS_UNARY or len(xs) != 1:  # FastGelu's bias input is not taken
            raise Unsupported(node, "not an op the behaviour check evaluates")
        return [_MS_UNARY[op](node, xs[0])]
    if node.domain not in ("", "ai.onnx"):
        raise Unsupported(node, f"domain {node.domain!r}")
    x = xs[0] if xs else None
    if x is None:
        raise Unsupported(node, "no first input")
    if op in _UNARY:
        if op == "Dropout" and (len(xs) > 2 and xs[2] is not None and bool(np.any(xs[2]))):
            raise Unsupported(node, "training_mode is set")
        if op == "Dropout" and len(node.outputs) > 1 and node.outputs[1].uses():
            raise Unsupported(node, "its mask is read")
        return [_UNARY[op](node, x)]
    if op in _BINARY:
        return [_BINARY[op](x, xs[1])]
    if op in _VARIADIC or op == "Mean":
        out = x
        for y in xs[1:]:
            out = (_VARIADIC.get(op) or np.add)(out, y)
        return [out / x.dtype.type(len(xs)) if op == "Mean" else out]
    if op == "Clip":
        lo = xs[1] if len(xs) > 1 else None
        hi = xs[2] if len(xs) > 2 else None
        if len(xs) == 1:  # opset < 11: attributes (absent: the float32 range)
            lo, hi = (
                _f(node, "min", -3.4028234663852886e38, x),
                _f(node, "max", 3.4028234663852886e38, x),
            )
        out = x if lo is None else np.maximum(x, lo)
        return [out if hi is None else np.minimum(out, hi)]
    if op == "Where":
        return [np.where(x, xs[1], xs[2])]
    if op == "Cast":
        to = numpy_dtype(ir.DataType(attr_int(node, "to", 0)))
        if to is None:
            raise Unsupported(node, "a cast to a type the check does not compute in")
        return [x.astype(to)]
    if op == "CastLike":
        return [x.astype(xs[1].dtype)]
    if op == "Slice":
        return [_slice(node, xs)]
    if op == "Split":
        return _split(node, xs)
    if op == "Gather":
        idx = np.asarray(xs[1]).astype(np.int64)
        return [np.take(x, idx, axis=attr_int(node, "axis", 0) or 0)]
    if op == "Softmax":
        return [_softmax(node, x)]
    if op in REDUCTIONS:
        return [_reduce(node, x, xs[1] if len(xs) > 1 else None)]
    raise Unsupported(node, "not an op the behaviour check evaluates")


def _as_input(
    node: ir.Node, i: int, value: ir.Value | None, env: Mapping, constants: Mapping
) -> np.ndarray | None:
    if value is None:
        return None
    if value in env:
        return env[value]
    arr = constants.get(value)
    if arr is None:
        arr = const_array(value)
    if arr is None:
        raise Unsupported(node, f"input {i} is neither fed nor a constant")
    return np.asarray(arr)


def evaluate(
    nodes: Iterable[ir.Node],
    feeds: Mapping[ir.Value, np.ndarray],
    constants: Mapping[ir.Value, np.ndarray] | None = None,
) -> dict[ir.Value, np.ndarray]:
    """Every value the ``nodes`` (topologically ordered) compute from ``feeds`` and constants.

    ``constants``: constant inputs already read (others are read from the graph).
    """
    constants = constants or {}
    env: dict[ir.Value, np.ndarray] = dict(feeds)
    with np.errstate(all="ignore"):
        for node in nodes:
            xs = [_as_input(node, i, v, env, constants) for i, v in enumerate(node.inputs)]
            half = next((x.dtype for x in xs if x is not None and x.dtype in _HALF), None)
            if half is not None:  # compute in float32, round the result to the half type
                xs = [x.astype(np.float32) if x is not None and x.dtype in _HALF else x for x in xs]
            outs = _run(node, xs)
            for value, out in zip(node.outputs, outs, strict=False):
                out = np.asarray(out)
                if half is not None and out.dtype == np.float32:
                    out = out.astype(half)
                env[value] = out
    return env
