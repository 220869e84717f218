"""Stack per-expert weights into ``[E, K, N]`` arrays (numpy only: the graph is not touched).

Used by :mod:`.emit`, which reads every array first and only then changes the graph, so
a tensor that cannot be read (external data gone) leaves the model as it was. Only the tensors
being stacked are read; the original tensor objects are never modified (the working copy
shares them with the original model).

* float ``[K, N]`` -> ``[E, K, N]``;
* ``DequantizeLinear`` of per-expert codes: codes, scales and zero points stacked, the
  quantisation axis one up: per tensor -> per expert (``axis=0``, scales ``[E]``); per axis
  ``a`` -> blocked along the other axis with one block spanning it; blocked along ``a`` ->
  blocked along ``a + 1`` with the same block size;
* ``MatMulNBits``: unpacked into DQ's K-major codes, scales and zero points (:mod:`.nbits`),
  then stacked, blocked along K (``axis=1``);
* weights already stacked ``[E, K, N]`` are used as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.dense.ffn import Projection, WeightSource
from onnx_moe_fuse.rewrites.canonical.experts.dense.nbits import (
    nbits_dequantize_arrays,
    nbits_geometry,
)
from onnx_moe_fuse.rewrites.graph.facts import attr_int
from onnx_moe_fuse.rewrites.graph.tensor_reads import read_array

__all__ = ["StackedWeight", "stack_bias", "stack_weights"]


@dataclass
class StackedWeight:
    """One FC's ``[E, K, N]`` weights: a value to use as is, a float array, or DQ operands."""

    as_is: ir.Value | None = None
    array: np.ndarray | None = None
    codes: np.ndarray | None = None
    scales: np.ndarray | None = None
    zero_points: np.ndarray | None = None
    dq_attributes: dict = field(default_factory=dict)


def _stack_dequantize(sources: list[WeightSource]) -> StackedWeight:
    dq0 = sources[0].dequantize
    k, n = sources[0].shape
    axis = attr_int(dq0, "axis", 1)
    axis = axis + 2 if axis < 0 else axis
    block = attr_int(dq0, "block_size", 0) or 0
    scale0 = dq0.inputs[1].const_value

    def stack(pos: int) -> np.ndarray:
        arrays = [read_array(s.dequantize.inputs[pos].const_value) for s in sources]
        arr = np.stack(arrays)
        if scale0.size == 1:  # per tensor -> per expert
            return arr.reshape(len(sources)) if pos else arr
        if len(scale0.shape) == 1 and pos:  # per axis -> one block spanning the other axis
            return arr.reshape((len(sources), 1, n) if axis == 1 else (len(sources), k, 1))
        return arr  # blocked: stacking adds the expert axis in front

    if scale0.size == 1:
        new_axis, new_block = 0, 0
    elif len(scale0.shape) == 1:
        new_axis, new_block = (1, k) if axis == 1 else (2, n)
    else:
        new_axis, new_block = axis + 1, block
    attrs = {name: a for name, a in dq0.attributes.items() if name not in ("axis", "block_size")}
    attrs["axis"] = new_axis
    if new_block:
        attrs["block_size"] = new_block
    has_zp = len(dq0.inputs) > 2 and dq0.inputs[2] is not None
    return StackedWeight(
        codes=stack(0),
        scales=stack(1),
        zero_points=stack(2) if has_zp else None,
        dq_attributes=attrs,
    )


def _stack_nbits(sources: list[WeightSource]) -> StackedWeight:
    parts = [nbits_dequantize_arrays(s.nbits) for s in sources]
    _, _, _, block = nbits_geometry(sources[0].nbits)
    return StackedWeight(
        codes=np.stack([p[0] for p in parts]),
        scales=np.stack([p[1] for p in parts]),
        zero_points=np.stack([p[2] for p in parts]),
        dq_attributes={"axis": 1, "block_size": block},
    )


def stack_weights(sources: list[WeightSource], stacked: bool) -> StackedWeight:
    """The ``[E, K, N]`` weights of one FC from its experts' weights (in expert order)."""
    if stacked:
        return StackedWeight(as_is=sources[0].value)
    if sources[0].nbits is not None:
        return _stack_nbits(sources)
    if sources[0].dequantize is not None:
        return _stack_dequantize(sources)
    return StackedWeight(array=np.stack([read_array(s.value.const_value) for s in sources]))


def stack_bias(projections: list[Projection], experts: int) -> np.ndarray | None:
    """``[E, N]`` biases: per-expert ``[N]`` / ``[1, N]`` stacked, or stacked ``[E, 1, N]``."""
    if projections[0].bias is None:
        return None
    arrays = [p.bias.const_value.numpy() for p in projections]
    return np.stack(arrays).reshape(experts, -1)
