"""Questions about the graph's values that the meaning transfers ask (no weight bytes read).

Constants are recognised by their producer (initializer, ``Constant``) and read only when small
(scalars, shape vectors, a zeros test on at most :data:`SMALL` elements); expert weight stacks are
described by their shapes alone.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.dims import Dim
from onnx_moe_fuse.rewrites.graph.facts import const_array
from onnx_moe_fuse.rewrites.graph.symbolic_dims import shape_value, value_dims

__all__ = [
    "SMALL",
    "const_shape",
    "is_const",
    "is_zeros",
    "small_const",
    "target_dims",
    "value_dims",
]

#: The most elements a constant may have to be read here.
SMALL = 4096


def is_const(value: ir.Value | None) -> bool:
    """An initializer (not a graph input) or a ``Constant`` node's output."""
    if value is None or value.is_graph_input():
        return False
    if value.const_value is not None:
        return True
    node = value.producer()
    return node is not None and node.op_type == "Constant" and node.domain in ("", "ai.onnx")


def const_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    """A constant's shape, read from its tensor (never its data)."""
    if not is_const(value):
        return None
    tensor = value.const_value  # type: ignore[union-attr]
    if tensor is None:
        node = value.producer()  # type: ignore[union-attr]
        attr = next(iter(node.attributes.values()), None)
        if attr is None or attr.is_ref():
            return None
        if attr.name in ("value_float", "value_int"):
            return ()
        if attr.name in ("value_floats", "value_ints"):
            return (len(attr.value),)
        tensor = attr.value
    return tuple(int(d) for d in tensor.shape)


def small_const(value: ir.Value | None) -> np.ndarray | None:
    """A constant of at most :data:`SMALL` elements, read; else None."""
    shape = const_shape(value)
    if shape is None or int(np.prod(shape, dtype=np.int64)) > SMALL:
        return None
    return const_array(value)


def target_dims(value: ir.Value | None) -> list[Dim] | None:
    """The elements of a shape operand (Reshape/Expand targets) as dims, or None."""
    shape = shape_value(value)
    return None if shape is None else list(shape.dims)


def is_zeros(value: ir.Value | None) -> bool:
    """Whether ``value`` holds zeros only: a zero constant, ConstantOfShape of 0, Expand of 0."""
    if value is None:
        return False
    arr = small_const(value)
    if arr is not None:
        return bool(arr.size) and not np.any(arr)
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "ConstantOfShape":
        fill = node.attributes.get("value")
        return fill is None or not np.any(fill.value.numpy())
    if node.op_type in ("Expand", "Identity", "Cast"):
        return is_zeros(node.inputs[0])
    return False
