"""Constant readers for :mod:`.dense_experts` and its helpers.

They are ``_graph_facts``' readers, which take a ``Constant`` attribute as it is (onnx-ir's
``get_const_tensor`` would rename the tensor, which the working copy shares with the original
model), plus :func:`is_const`.
"""

from __future__ import annotations

import onnx_ir as ir

from .._graph_facts import const_array, const_ints, node_axes

__all__ = ["const_array", "const_ints", "is_const", "node_axes"]


def is_const(value: ir.Value | None) -> bool:
    """True when ``value`` holds a readable constant."""
    return const_array(value) is not None
