"""Where the rules put the weights they repack: the ``WeightSink`` type and its default.

A rule that emits a fused node repacks the layer's weights into new arrays (the QMoE codes and
scales, the MatMulNBitsQkv blocks). Each becomes an initializer. A *weight sink* turns one such
array into the tensor the initializer holds: the default, :func:`in_memory`, wraps the array as an
``ir.Tensor`` (the array stays alive as long as the model does); the fuser's file sink
(``onnx_moe_fuse.io.weight_sink``) writes it to a scratch external-data file and returns an
``ir.ExternalTensor`` reading it back, so that only the layer being fused has its repacked arrays
in memory. The sink is configuration handed to a rule when it is built, never match state.

The type lives here and the file implementation in the fuser, so the rules stay free of fuser
imports (rules never import ``onnx_moe_fuse`` outside ``rewrites``).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import onnx_ir as ir

__all__ = ["WeightSink", "in_memory"]


class WeightSink(Protocol):
    """A callable: ``sink(array, name)`` -> the tensor the initializer ``name`` holds.

    The returned tensor must read back exactly ``array`` (same dtype, shape and bytes) and be
    named ``name``. The caller drops ``array`` after the call: a sink may keep it (in memory) or
    write it out and let it go.
    """

    def __call__(self, array: np.ndarray, name: str) -> ir.TensorProtocol:
        """Store ``array`` as the data of initializer ``name``; return its tensor."""
        ...


def in_memory(array: np.ndarray, name: str) -> ir.TensorProtocol:
    """The default sink: ``array`` as an in-memory ``ir.Tensor`` (C-contiguous)."""
    return ir.tensor(np.ascontiguousarray(array), name=name)
