"""Graph facts for the RMS norm + Q/K/V rule: its constants, dtype/shape inference, small readers.

Shared by the pattern, the projection and norm proofs and the rule (``matmul_nbits_qkv.py``);
constants and attributes are read exactly as the MoE rules read them (``rewrites/graph/facts.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.contract.ops import MATMUL_NBITS_QKV, MS_DOMAIN
from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_array, const_float

#: The op these rules emit (``com.microsoft`` domain).
FUSED_OP = MATMUL_NBITS_QKV.name
#: The attributes every emitted node writes, all of the op's (ORT's defaults are not relied on).
FUSED_ATTRIBUTES = MATMUL_NBITS_QKV.attribute_names
#: Node metadata key carrying the replaced node names (JSON list), as the MoE rules write it.
REPLACED_KEY = "onnx_moe_fuse.replaced"

#: Norm spellings, one rule instance each (times :data:`PROJECTION_MIXES`).
NORM_FORMS: tuple[str, ...] = (
    "skip_sln_residual",  # SkipSimplifiedLayerNormalization with output 3 bound
    "skip_sln",  # SkipSimplifiedLayerNormalization, output 0 only
    "add_sln",
    "sln",
    "add_rms",
    "rms",
    "add_decomposed_mul_ns",
    "decomposed_mul_ns",
    "add_decomposed_mul_sn",
    "decomposed_mul_sn",
    "add_decomposed_cast",
    "decomposed_cast",
)
#: Projection kinds of the three slots: ``n`` MatMulNBits, ``d`` MatMul (of a DequantizeLinear).
PROJECTION_MIXES: tuple[str, ...] = ("nnn", "nnd", "ndd", "ddd")

BLOCK = 32
BITS = 4
ROLES = ("q", "k", "v")
KERNEL_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
PRECISION = {ir.DataType.FLOAT16: 1, ir.DataType.FLOAT: 2, ir.DataType.DOUBLE: 3}
# How the matcher's refusal of a norm with other than three projections begins.
COUNT_PREFIX = "the RMS-normalised value"

# Constants and attributes are read exactly as the MoE rules read them.
const = const_array
const_scalar = const_float
int_attr = attr_int


def pattern_var(name: str, optional: bool = False) -> pattern.Var:
    return pattern.Var(name, can_match_none=optional)


# -- graph facts -------------------------------------------------------------------------------


def item_label(item: ir.Node | ir.Value | None) -> str:
    """A readable name: a node's name (or ``OpType(first output)``), a value's name."""
    if item is None:
        return "<absent>"
    if isinstance(item, ir.Node):
        if item.name:
            return item.name
        out = item.outputs[0].name if item.outputs else ""
        return f"{item.op_type}({out})"
    if item.name:
        return item.name
    producer = item.producer()
    return f"output {item.index()} of {item_label(producer)}" if producer else "<unnamed>"


def attr_or(node: ir.Node, name: str, default: Any) -> Any:
    attr = node.attributes.get(name)
    if attr is None or attr.is_ref():
        return default
    return attr.value


# Ops whose output 0 has the element type and the rank of input 0 (element-wise or norm-like).
_LIKE_INPUT0 = frozenset(
    {
        ("", "Identity"),
        ("", "Neg"),
        ("", "Relu"),
        ("", "Sigmoid"),
        ("", "Tanh"),
        ("", "Erf"),
        ("", "Sqrt"),
        ("", "Reciprocal"),
        ("", "Softmax"),
        ("", "Gelu"),
        ("", "Dropout"),
        ("", "LayerNormalization"),
        ("", "SimplifiedLayerNormalization"),
        ("", "RMSNormalization"),
        ("", "RotaryEmbedding"),
        (MS_DOMAIN, "SkipSimplifiedLayerNormalization"),
        (MS_DOMAIN, "SkipLayerNormalization"),
        (MS_DOMAIN, "MatMulNBits"),
        (MS_DOMAIN, "MatMulNBitsQkv"),
        (MS_DOMAIN, "GroupQueryAttention"),
        (MS_DOMAIN, "MultiHeadAttention"),
        (MS_DOMAIN, "RotaryEmbedding"),
        (MS_DOMAIN, "QMoE"),
        (MS_DOMAIN, "MoE"),
        (MS_DOMAIN, "FastGelu"),
        (MS_DOMAIN, "Gelu"),
    }
)
# Ops whose output has its inputs' element type and their broadcast rank.
_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"})
_SAME_TYPE = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Expand", "Flatten"})
_REDUCE = frozenset(("", op) for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceL2"))
_INFER_LIMIT = 2048  # values visited per query


def _infer(value: ir.Value | None, what: str, memo: dict[int, Any] | None = None) -> Any:
    """The element type (``what="dtype"``) or rank (``"rank"``) of ``value``, or None.

    Declared types and shapes first; otherwise read through the producer: Cast, element-wise and
    norm-like ops (ONNX's and ONNX Runtime's, e.g. MatMulNBits keeps A's rank and type),
    broadcasting binary ops, reductions with ``keepdims=1``, MatMul with a 2-D weight, Reshape
    with a constant shape. The graphs the rule meets often carry no value_info for com.microsoft
    outputs, which onnx's shape inference cannot type.
    """
    if value is None:
        return None
    memo = {} if memo is None else memo
    key_v = id(value)
    if key_v in memo:
        return memo[key_v]
    if len(memo) > _INFER_LIMIT:
        return None
    memo[key_v] = None  # guards cycles while this value is being read
    try:
        memo[key_v] = found = _infer_step(value, what, memo)
    except RecursionError:  # a very deep chain without declared shapes: unknown
        return None
    return found


def _infer_step(value: ir.Value, what: str, memo: dict[int, Any]) -> Any:
    if what == "dtype" and value.dtype is not None:
        return value.dtype
    if what == "rank" and value.shape is not None:
        return len(value.shape)
    arr = const(value)
    if arr is not None:
        if what == "rank":
            return arr.ndim
        try:
            return ir.DataType.from_numpy(arr.dtype)
        except (TypeError, ValueError):
            return None
    node = value.producer()
    if node is None or not node.inputs:
        return None
    key = (node.domain, node.op_type)
    first = node.inputs[0]
    if key == ("", "Cast"):
        if what == "rank":
            return _infer(first, what, memo)
        to = int_attr(node, "to", None)
        return ir.DataType(to) if to is not None else None
    if key in _LIKE_INPUT0 and value.index() in (0, 3):
        found = _infer(first, what, memo)
        if found is None and what == "dtype" and len(node.inputs) > 2:
            found = _infer(node.inputs[2], what, memo)  # MatMulNBits(Qkv): scales / norm_scale
        return found
    if key in _REDUCE and int_attr(node, "keepdims", 1) == 1:
        return _infer(first, what, memo)
    if node.domain == "" and node.op_type in _BROADCAST:
        if what == "dtype":
            return _infer(first, what, memo) or _infer(node.inputs[-1], what, memo)
        ranks = [_infer(v, what, memo) for v in node.inputs]
        return None if any(r is None for r in ranks) else max(ranks)
    if key == ("", "MatMul") and len(node.inputs) == 2:
        if what == "dtype":
            return _infer(first, what, memo) or _infer(node.inputs[1], what, memo)
        if _infer(node.inputs[1], what, memo) == 2:
            return _infer(first, what, memo)
        return None
    if node.domain == "" and node.op_type in _SAME_TYPE:
        if what == "dtype":
            return _infer(first, what, memo)
        if node.op_type == "Reshape" and len(node.inputs) > 1:
            shape = const(node.inputs[1])
            return None if shape is None else int(shape.size)
        if node.op_type == "Transpose":
            return _infer(first, what, memo)
    return None


def elem_type(value: ir.Value | None) -> ir.DataType | None:
    """The element type of ``value`` (see :func:`_infer`)."""
    return _infer(value, "dtype")


def pick(bindings: dict[str, Any], *names: str) -> ir.Value | None:
    """The first of ``names`` bound to a value."""
    for name in names:
        value = bindings.get(name)
        if value is not None:
            return value
    return None


def static_rank(value: ir.Value | None) -> int | None:
    """The rank of ``value`` (see :func:`_infer`)."""
    return _infer(value, "rank")


def static_dims(value: ir.Value | None) -> tuple[Any, ...] | None:
    """Static shape as a tuple of ints / symbolic names; None when unknown or anonymous."""
    if value is None or value.shape is None:
        return None
    dims: list[Any] = []
    for d in value.shape:
        if isinstance(d, int):
            dims.append(d)
        elif isinstance(d, ir.SymbolicDim) and d.value:
            dims.append(d.value)
        else:
            return None
    return tuple(dims)


def static_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    arr = const(value)
    if arr is not None:
        return tuple(arr.shape)
    dims = static_dims(value)
    if dims is None or not all(isinstance(d, int) for d in dims):
        return None
    return tuple(dims)


def dtype_name(dtype: ir.DataType | None) -> str:
    return "unknown" if dtype is None else dtype.name.lower()


def np_dtype(dtype: ir.DataType) -> np.dtype:
    return np.dtype(dtype.numpy())
