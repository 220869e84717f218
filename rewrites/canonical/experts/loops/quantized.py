"""Expert weights behind ``DequantizeLinear`` in an expert loop, and their ``[E, K, N]`` stack.

One expert's projection may read ``DequantizeLinear(codes [K, N], scales [k_blocks, N],
zero_points? [k_blocks, N], axis=0, block_size)`` of constants: what ORT's ``MatMulNBits`` is
once :mod:`~onnx_moe_fuse.rewrites.canonical.weights.nbits_weights` has presented it as a
``MatMul`` (``MatMulNBitsQuantizer`` output), and what blocked DequantizeLinear quantisers
write. :func:`quantized_weight` reads that form (anything else: None); :func:`stack_quantized`
stacks the experts' codes, scales and zero points, each as it is (the codes are never
dequantized or requantised), into one ``DequantizeLinear(codes [E, K, N], scales [E, k_blocks,
N], zero_points [E, k_blocks, N], axis=1, block_size)``, the form the layer rules read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.value_proofs import producer_op
from onnx_moe_fuse.rewrites.graph.facts import attr_int

__all__ = ["QuantizedWeight", "quantized_weight", "stack_quantized"]

_CODE_TYPES = frozenset({ir.DataType.INT4, ir.DataType.UINT4, ir.DataType.INT8, ir.DataType.UINT8})


def _const(value: ir.Value | None, rank: int) -> bool:
    tensor = value.const_value if value is not None else None
    return tensor is not None and not value.is_graph_input() and len(tensor.shape) == rank


@dataclass(frozen=True)
class QuantizedWeight:
    """One expert's blocked ``DequantizeLinear`` weight along K (axis 0)."""

    codes: ir.Value
    scales: ir.Value
    zero_points: ir.Value | None
    block: int

    @property
    def dtype(self) -> ir.DataType:
        """The dequantized (scale) type."""
        return self.scales.const_value.dtype

    @property
    def signature(self) -> tuple:
        """What two experts must share to be stacked: code type, block, scale and zp shapes."""
        zp = self.zero_points
        return (
            str(self.codes.const_value.dtype),
            self.block,
            tuple(self.scales.const_value.shape),
            None if zp is None else (str(zp.const_value.dtype), tuple(zp.const_value.shape)),
        )


def quantized_weight(value: ir.Value) -> QuantizedWeight | None:
    """``value`` as a blocked DequantizeLinear of constants along K, or None."""
    dq = producer_op(value, "DequantizeLinear")
    if dq is None or len(dq.inputs) < 2:
        return None
    codes, scales = dq.inputs[0], dq.inputs[1]
    zp = dq.inputs[2] if len(dq.inputs) > 2 else None
    block = attr_int(dq, "block_size", 0) or 0
    axis = attr_int(dq, "axis", 1)
    if block <= 0 or axis not in (0, -2) or attr_int(dq, "output_dtype", 0):
        return None
    if not (_const(codes, 2) and _const(scales, 2)) or (zp is not None and not _const(zp, 2)):
        return None
    if (
        codes.const_value.dtype not in _CODE_TYPES
        or not scales.const_value.dtype.is_floating_point()
    ):
        return None
    k, n = (int(d) for d in codes.const_value.shape)
    if tuple(scales.const_value.shape) != (-(-k // block), n):
        return None
    if zp is not None and (
        tuple(zp.const_value.shape) != (-(-k // block), n)
        or zp.const_value.dtype != codes.const_value.dtype
    ):
        return None
    return QuantizedWeight(codes, scales, zp, block)


def _lazy(parts: Sequence[ir.Value], name: str) -> ir.Value:
    """A new value (not yet registered) stacking ``parts``' tensors, read when first used."""
    first = parts[0].const_value
    dtype = first.dtype
    shape = ir.Shape([len(parts), *first.shape])

    def compute() -> ir.TensorProtocol:
        return ir.Tensor(np.stack([p.const_value.numpy() for p in parts]), dtype=dtype)

    tensor = ir.LazyTensor(compute, dtype, shape, cache=False, name=name)
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=shape, const_value=tensor)


def stack_quantized(
    weights: Sequence[QuantizedWeight], fresh: Callable[[str], str], base: str
) -> tuple[list[ir.Value], int]:
    """The stacked ``(codes, scales[, zero_points])`` values (unregistered) and the block.

    Every weight has the same :attr:`QuantizedWeight.signature` (the loop proof compares
    them).
    """
    values = [
        _lazy([w.codes for w in weights], fresh(f"{base}_codes")),
        _lazy([w.scales for w in weights], fresh(f"{base}_scales")),
    ]
    if weights[0].zero_points is not None:
        zps = [w.zero_points for w in weights]
        values.append(_lazy(zps, fresh(f"{base}_zero_points")))  # type: ignore[arg-type]
    return values, weights[0].block
