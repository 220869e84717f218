"""Where the rules put the weights they repack: the ``WeightSink`` type, streamed arrays, the default.

A rule that emits a fused node repacks the layer's weights into new arrays (the QMoE codes and
scales, the MatMulNBitsQkv blocks). Each becomes an initializer. A *weight sink* turns one such
array into the tensor the initializer holds: the default, :func:`in_memory`, wraps the array as an
``ir.Tensor`` (the array stays alive as long as the model does); the fuser's file sink
(``onnx_moe_fuse.io.weight_sink``) writes it to a scratch external-data file and returns an
``ir.ExternalTensor`` reading it back, so that only the layer being fused has its repacked arrays
in memory. The sink is configuration handed to a rule when it is built, never match state.

A rule may hand a sink a :class:`StreamedArray` instead of an array: a description of the
array (dtype, shape) and a way to make it one block of rows at a time (one expert), so that a
layer's repacked weights never exist whole in memory. A file sink writes the blocks as they
come (or, for a *portable* one, whose sources are files, in a worker process later); the
in-memory sink joins them (:func:`materialise`).

The type lives here and the file implementation in the fuser, so the rules stay free of fuser
imports (rules never import ``onnx_moe_fuse`` outside ``rewrites``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np
import onnx_ir as ir

__all__ = ["StreamedArray", "WeightSink", "in_memory", "materialise"]


@runtime_checkable
class StreamedArray(Protocol):
    """An array made in row blocks: ``chunks()`` yields C-ordered pieces along axis 0.

    Joined in order along axis 0 the pieces are the array of ``shape`` and ``dtype``.
    ``portable`` is True when the object can be pickled and run in another process (its sources
    are files, read there); ``nbytes`` is the whole array's size.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    portable: bool

    @property
    def nbytes(self) -> int:
        """The whole array's bytes."""
        ...

    def chunks(self) -> Iterator[np.ndarray]:
        """The array's row blocks, in order."""
        ...


class WeightSink(Protocol):
    """A callable: ``sink(array, name)`` -> the tensor the initializer ``name`` holds.

    ``array`` is a numpy array or a :class:`StreamedArray`. The returned tensor must read back
    exactly ``array`` (same dtype, shape and bytes) and be named ``name``, once the sink's owner
    has finished it (a file sink may write portable streamed arrays later, before saving). The
    caller drops ``array`` after the call: a sink may keep it (in memory) or write it out and
    let it go.
    """

    def __call__(self, array: np.ndarray | StreamedArray, name: str) -> ir.TensorProtocol:
        """Store ``array`` as the data of initializer ``name``; return its tensor."""
        ...


def materialise(array: np.ndarray | StreamedArray) -> np.ndarray:
    """``array`` as one C-contiguous numpy array (a streamed one's pieces joined)."""
    if isinstance(array, np.ndarray):
        return np.ascontiguousarray(array)
    out = np.empty(array.shape, array.dtype)
    flat = out.reshape(-1)
    at = 0
    for piece in array.chunks():
        flat[at : at + piece.size] = piece.reshape(-1)
        at += piece.size
    if at != out.size:
        raise ValueError(
            f"a streamed array of shape {array.shape} made {at} of {out.size} elements"
        )
    return out


def in_memory(array: np.ndarray | StreamedArray, name: str) -> ir.TensorProtocol:
    """The default sink: ``array`` as an in-memory ``ir.Tensor`` (C-contiguous)."""
    return ir.tensor(materialise(array), name=name)
