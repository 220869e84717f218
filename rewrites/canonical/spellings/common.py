"""What the spelling rules share: fresh value names, constant reads, opset-aware emitters.

The spelling rules (``spelling_*.py``) rewrite one op spelling into the one the layer rules
match. They run on the working copy, whose fused regions are later spliced into the original
graph by value name, so every value a rule creates is named here: the value that replaces a
matched output takes the old name (the rewriter does that), and every other new value gets a
fresh name that collides with nothing in the model (:class:`FreshNames`), so the rewriter's
closing name fix never has to rename a value that already existed.

Constants are read without loading weights: a rule asks for a value only when its tensor has
one element (:func:`scalar_constant`) or is a small integer vector (:func:`small_ints`); a
graph input with a default initializer is not a constant (a feed may override it).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.rewrites.graph.fresh_names import FreshNames

__all__ = [
    "FLOAT_TYPES",
    "FreshNames",
    "SpellingRule",
    "constant_rank",
    "constant_tensor",
    "dtype_of",
    "exactly_representable",
    "has_attribute_refs",
    "int64_const",
    "is_constant",
    "reduce_sum",
    "scalar_const",
    "scalar_constant",
    "small_ints",
    "squeeze",
    "unsqueeze",
]

#: Floating-point element types the arithmetic rules emit scalar constants for.
FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE}
)
#: Small integer vectors (axes, repeats, shapes) are read only up to this many elements.
_SMALL = 64


class SpellingRule(pattern.RewriteRuleClassBase):
    """A spelling rule: it knows the model's default opset and where fresh names come from."""

    def __init__(self, names: FreshNames, opset: int) -> None:
        """``names`` allocates intermediate names; ``opset`` is the model's ``""`` opset."""
        super().__init__(type(self).__name__)
        self.names = names
        self.opset = opset


# -- constants -----------------------------------------------------------------------------------


def constant_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The value's constant tensor (initializer or Constant output), never a graph input's.

    A Constant in a subgraph has no ``const_value`` (the rewriter propagates constants in the
    main graph and functions only), so its node is read as well.
    """
    if value is None or value.is_graph_input():
        return None
    try:
        return ir.convenience.get_const_tensor(value)
    except ValueError:  # a malformed Constant node: not a constant this pass can use
        return None


def constant_rank(value: ir.Value | None) -> int | None:
    """The rank of a constant value's tensor, else None."""
    tensor = constant_tensor(value)
    return None if tensor is None else len(tensor.shape)


def is_constant(value: ir.Value | None) -> bool:
    """Whether the value is a constant (its tensor is not loaded to answer)."""
    return constant_tensor(value) is not None


def scalar_constant(value: ir.Value | None) -> np.ndarray | None:
    """The value as a 0-d array when it is a constant of one element, else None."""
    tensor = constant_tensor(value)
    if tensor is None or tensor.size != 1:
        return None
    return np.asarray(tensor.numpy()).reshape(())


def small_ints(value: ir.Value | None) -> list[int] | None:
    """A constant integer vector of at most a few elements as a list, else None."""
    tensor = constant_tensor(value)
    if tensor is None or tensor.size > _SMALL or len(tensor.shape) > 1:
        return None
    if tensor.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return None
    return [int(v) for v in np.asarray(tensor.numpy()).reshape(-1)]


def has_attribute_refs(node: ir.Node) -> bool:
    """Whether an attribute of ``node`` refers to its function's attribute (value unknown here)."""
    return any(attr.is_ref() for attr in node.attributes.values())


def exactly_representable(number: float, dtype: ir.DataType | None) -> bool:
    """Whether ``number`` survives a round trip through the floating type ``dtype``."""
    if dtype not in FLOAT_TYPES:
        return False
    converted = np.array(number, dtype=dtype.numpy()).astype(np.float64)
    return bool(converted == np.float64(number))


#: Ops whose output has the element type of their first input.
_SAME_TYPE_OPS = frozenset(
    """Abs Add Ceil Clip Div Elu Erf Exp Expand Flatten Floor Gather GatherElements GatherND
    Gelu Gemm HardSigmoid HardSwish Identity LeakyRelu Log MatMul Max Min Mul Neg Pow
    Reciprocal ReduceMax ReduceMean ReduceMin ReduceSum Relu Reshape Round Sigmoid Sign Sin
    Slice Softmax Softplus Split Sqrt Squeeze Sub Swish Tanh Tile Transpose Unsqueeze
    Einsum Concat CumSum Pad Sum Mean LogSoftmax ScatterElements ScatterND""".split()
)
#: Ops whose first output has the type of their first input (their other outputs differ).
_SAME_TYPE_FIRST_OUTPUT = frozenset({"TopK", "Dropout", "LayerNormalization"})
#: Ops whose output is int64 whatever their input.
_INT64_OPS = frozenset({"Shape", "Size", "ArgMax", "ArgMin", "NonZero"})


def dtype_of(value: ir.Value | None, depth: int = 16) -> ir.DataType | None:
    """The value's element type: recorded, or followed back through type-keeping ops.

    Models often record types only at the graph's boundary; a rule that must emit a constant
    of ``x``'s type follows ``x`` back to a value whose type is known (``Cast`` gives its
    ``to``, ``DequantizeLinear`` its scale's type).
    """
    if value is None:
        return None
    if value.dtype is not None:
        return value.dtype
    tensor = constant_tensor(value)
    if tensor is not None:
        return tensor.dtype
    node = value.producer()
    if depth == 0 or node is None or node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    if node.op_type == "Cast":
        to = node.attributes.get("to")
        return None if to is None else ir.DataType(to.as_int())
    if node.op_type == "DequantizeLinear" and len(node.inputs) > 1:
        return dtype_of(node.inputs[1], depth - 1)
    if node.op_type == "Where" and len(node.inputs) > 1:
        return dtype_of(node.inputs[1], depth - 1)
    if node.op_type in _INT64_OPS or (node.op_type == "TopK" and value.index() == 1):
        return ir.DataType.INT64
    if node.op_type in _SAME_TYPE_OPS or (
        node.op_type in _SAME_TYPE_FIRST_OUTPUT and value.index() == 0
    ):
        return dtype_of(node.inputs[0], depth - 1)
    return None


# -- emitters ----------------------------------------------------------------------------------


def scalar_const(op, number: float, dtype: ir.DataType, name: str) -> ir.Value:
    """A 0-d Constant of ``dtype`` holding ``number``."""
    array = np.array(number, dtype=dtype.numpy())
    return op.Constant(value=ir.tensor(array, dtype=dtype, name=name), _outputs=[name])


def int64_const(op, values: list[int], name: str) -> ir.Value:
    """A 1-D int64 Constant (axes, shapes)."""
    array = np.array(values, dtype=np.int64)
    return op.Constant(value=ir.tensor(array, name=name), _outputs=[name])


def _axes_op(op, op_type: str, x: ir.Value, axes: list[int], rule: SpellingRule, **attrs):
    """``op_type(x, axes)``: axes an input from opset 13, an attribute before."""
    name = rule.names(x.name)
    if rule.opset >= 13:
        axes_value = int64_const(op, axes, rule.names(x.name))
        return op.op(op_type, x, axes_value, _outputs=[name], **attrs)
    return op.op(op_type, x, axes=axes, _outputs=[name], **attrs)


def unsqueeze(op, x: ir.Value, axes: list[int], rule: SpellingRule) -> ir.Value:
    """``Unsqueeze(x, axes)`` in the form of the rule's opset."""
    return _axes_op(op, "Unsqueeze", x, axes, rule)


def squeeze(op, x: ir.Value, axes: list[int], rule: SpellingRule) -> ir.Value:
    """``Squeeze(x, axes)`` in the form of the rule's opset."""
    return _axes_op(op, "Squeeze", x, axes, rule)


def reduce_sum(op, x: ir.Value, axes: list[int], rule: SpellingRule) -> ir.Value:
    """``ReduceSum(x, axes, keepdims=0)`` in the form of the rule's opset."""
    return _axes_op(op, "ReduceSum", x, axes, rule, keepdims=0)
