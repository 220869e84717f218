"""Read constants without touching the graph (for :mod:`.dense_experts` and its helpers).

``onnx_ir.convenience.get_const_tensor`` (which ``_graph_facts.const_array`` uses) names the
tensor of a ``Constant`` node after its output as a side effect. The working copy shares those
tensors with the original model, so a pass that only looks at a layer it then leaves alone would
still change the original's bytes. These readers take the attribute's value as it is.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

__all__ = ["const_array", "const_ints", "is_const", "node_axes"]

_STD = ("", "ai.onnx")


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The constant held by ``value`` (initializer or Constant node), or None.

    A graph input with a default initializer is not constant: it can be fed at run time.
    """
    if value is None or value.is_graph_input():
        return None
    tensor = value.const_value
    if tensor is None:
        node = value.producer()
        if node is None or node.op_type != "Constant" or node.domain not in _STD:
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
    except Exception:  # external data that cannot be read, an unsupported dtype
        return None


def is_const(value: ir.Value | None) -> bool:
    """True when ``value`` holds a readable constant."""
    return const_array(value) is not None


def const_ints(value: ir.Value | None) -> list[int] | None:
    """The integer constant held by ``value`` as a flat list, or None."""
    arr = const_array(value)
    if arr is None or arr.dtype.kind not in "iu":
        return None
    return [int(v) for v in arr.reshape(-1)]


def node_axes(node: ir.Node, input_index: int = 1) -> list[int] | None:
    """The ``axes`` of a Reduce*/Squeeze/Unsqueeze node (input from opset 13, else attribute).

    ``[]`` when neither is given, None when they are not constant.
    """
    if len(node.inputs) > input_index and node.inputs[input_index] is not None:
        return const_ints(node.inputs[input_index])
    attr = node.attributes.get("axes")
    if attr is None:
        return []
    if attr.is_ref():
        return None
    return [int(a) for a in attr.value]
