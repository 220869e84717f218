"""``com.microsoft.MatMulNBits`` expert projections (Mobius' dense fallback), read as DQ weights.

``MatMulNBits(A, B [N, k_blocks, blob], scales, zero_points?)`` computes
``A @ dequantize(B)^T`` with ``(code - zp) * scale`` blocked along K; that is
``MatMul(A, DequantizeLinear(codes^T [K, N], scales^T [k_blocks, N], zp^T, axis=0,
block_size))``, the form the per-slot rules take once the experts are stacked. This module
checks a node is of that kind (:func:`nbits_weight`, by attributes and shapes only: no data is
loaded) and unpacks one node's codes, scales and zero points into DQ's K-major layout
(:func:`nbits_dequantize_arrays`), with the contract's MatMulNBits layout
(:mod:`onnx_moe_fuse.contract.packing`).
No zero points means the symmetric point (8 for 4-bit, 128 for 8-bit), written out explicitly:
a uint4/uint8 DequantizeLinear without zero point would mean 0.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.contract.ops import MATMUL_NBITS, MS_DOMAIN
from onnx_moe_fuse.contract.packing import unpack_bits, unpack_matmul_nbits, zero_point
from onnx_moe_fuse.rewrites.graph.facts import attr_int
from onnx_moe_fuse.rewrites.graph.tensor_reads import read_array

__all__ = [
    "MS_DOMAIN",
    "nbits_dequantize_arrays",
    "nbits_geometry",
    "nbits_is_supported",
    "nbits_tensor_arrays",
]


def nbits_geometry(node: ir.Node) -> tuple[int, int, int, int] | None:
    """``(K, N, bits, block_size)`` of a MatMulNBits node, or None when not fixed."""
    k, n = attr_int(node, "K", None), attr_int(node, "N", None)
    bits = attr_int(node, "bits", MATMUL_NBITS.default("bits"))
    block = attr_int(node, "block_size", None)
    if None in (k, n, bits, block):
        return None
    return k, n, bits, block


def _initializer(value: ir.Value | None) -> bool:
    return value is not None and not value.is_graph_input() and value.const_value is not None


def nbits_is_supported(node: ir.Node) -> bool:
    """True for a node this module can read as DQ weights.

    4- or 8-bit, constant ``B`` and float scales of the right shapes, uint8 zero points or
    none, no ``g_idx``.
    """
    geometry = nbits_geometry(node)
    if geometry is None or node.domain != MS_DOMAIN:
        return False
    k, n, bits, block = geometry
    if bits not in (4, 8) or block < 16 or block & (block - 1):
        return False
    if len(node.inputs) > len(MATMUL_NBITS.inputs):
        return False  # not a MatMulNBits ORT could load
    ins = MATMUL_NBITS.named_inputs(list(node.inputs))
    b, scales, zp, g_idx = ins["B"], ins["scales"], ins["zero_points"], ins["g_idx"]
    if not (_initializer(b) and _initializer(scales)) or g_idx is not None:
        return False
    k_blocks = -(-k // block)
    if b.const_value.dtype != ir.DataType.UINT8:
        return False
    if tuple(b.const_value.shape) != (n, k_blocks, block * bits // 8):
        return False
    if not scales.const_value.dtype.is_floating_point():
        return False
    if scales.const_value.size != n * k_blocks:
        return False
    if zp is not None:
        if not _initializer(zp) or zp.const_value.dtype != ir.DataType.UINT8:
            return False
        per_row = -(-k_blocks * bits // 8)
        if zp.const_value.size != n * per_row:
            return False
    return True


def nbits_dequantize_arrays(node: ir.Node) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes [K, N], scales [k_blocks, N], zero points [k_blocks, N])`` for DQ ``axis=0``.

    Codes and zero points are ml_dtypes ``uint4`` for 4-bit, ``uint8`` for 8-bit.
    """
    geometry = nbits_geometry(node)
    assert geometry is not None
    ins = MATMUL_NBITS.named_inputs(list(node.inputs))
    zp = ins["zero_points"]
    return nbits_tensor_arrays(
        geometry,
        ins["B"].const_value,
        ins["scales"].const_value,
        None if zp is None else zp.const_value,
    )


def nbits_tensor_arrays(
    geometry: tuple[int, int, int, int],
    b: ir.TensorProtocol,
    scales: ir.TensorProtocol,
    zero_points: ir.TensorProtocol | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`nbits_dequantize_arrays` from a node's ``(K, N, bits, block_size)`` and tensors.

    The codes are unpacked as they are stored (no float is read or rounded): the same codes.
    """
    k, n, bits, block = geometry
    k_blocks = -(-k // block)
    codes = unpack_matmul_nbits(read_array(b), k, bits, block)
    s = read_array(scales).reshape(n, k_blocks)
    if zero_points is None:
        zp = np.full((n, k_blocks), zero_point(bits), dtype=np.uint8)
    else:
        packed = read_array(zero_points).reshape(n, -1)
        zp = unpack_bits(packed, bits).reshape(n, -1)[:, :k_blocks] if bits == 4 else packed
    dtype = ml_dtypes.uint4 if bits == 4 else np.uint8
    return (
        np.ascontiguousarray(codes.T).astype(dtype),
        np.ascontiguousarray(s.T),
        np.ascontiguousarray(zp.T).astype(dtype),
    )
