"""Repacking of proved expert weights into the fused node's inputs.

Input: a :class:`~.analysis.LayerPlan` (weights in GroupedMatMul's K-major ``[E, K, N]``).
Output: the arrays of ORT's output-major layout:

* MoE: ``fc1 [E, N1, H]``, ``fc1_bias [E, N1]``, ``fc2 [E, H, I]``, ``fc2_bias [E, H]``;
* QMoE: ``fc1 [E, N1, H / pack]`` uint8 (4-bit: two codes a byte, the even element in the low
  nibble; codes stored as ``q + 8`` / ``q + 128``), scales ``[E, N1]`` (one per output row) or
  ``[E, N1, H / block]``, the same for FC2 with ``[E, H, I / pack]``.

Quantized weights are repacked expert by expert in the integer domain (:mod:`.repack`): the
QMoE weights and scales come out as streamed arrays that a weight sink writes one expert at a
time, so a layer's codes are never unpacked, widened or held whole. A source whose experts do
not start on whole bytes is read whole instead (still integers).

With asymmetric zero points (``LayerPlan.zero_points``) both projections get zero-point inputs
(a projection with symmetric weights gets the symmetric point written out), packed by
:func:`~onnx_moe_fuse.contract.packing.pack_qmoe_zero_points`: ``[E, N / pack]`` column-wise,
``[E, N, blocks / pack]`` block-wise.

A float layer quantised on request (``LayerPlan.from_float``, :mod:`.quantize`) is first
repacked as for MoE (:func:`float_arrays`), then its two weight arrays are quantised there
(:func:`quantize_arrays`): symmetric, no zero-point inputs.

``N1`` is ``I``, or ``2 I`` for SwiGLU, whose rows are always interleaved (row ``2j`` the gate,
``2j + 1`` the linear operand: ``swiglu_fusion=1``), whatever the source spelling was: separate
gate/up experts, one FC1 cut in halves, or strided slices. ``LayerPlan.fc1_columns`` names, for
each fused row, the FC1 output column it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx_moe_fuse.contract.packing import pack_qmoe, pack_qmoe_zero_points, zero_point
from onnx_moe_fuse.rewrites.moe.analysis import ExpertWeights, LayerPlan
from onnx_moe_fuse.rewrites.moe.quantize import quantize_weights
from onnx_moe_fuse.rewrites.moe.repack import (
    Part,
    RepackedCodes,
    RepackedScales,
    row_order,
    source_of,
)

__all__ = ["FusedArrays", "float_arrays", "fused_arrays", "quantize_arrays"]


@dataclass(frozen=True)
class FusedArrays:
    """The constant inputs of one fused node (``None`` for an absent optional input).

    A QMoE node's weights and scales may be streamed arrays (:mod:`.repack`), which a weight
    sink turns into tensors without making them whole.
    """

    fc1: np.ndarray
    fc1_scales: np.ndarray | None
    fc1_bias: np.ndarray | None
    fc2: np.ndarray
    fc2_scales: np.ndarray | None
    fc2_bias: np.ndarray | None
    fc1_zero_points: np.ndarray | None = None
    fc2_zero_points: np.ndarray | None = None

    def by_input(self) -> dict[str, np.ndarray | None]:
        """The arrays by the fused op's input names (``contract.ops``); None: an absent bias.

        The scales are there only for QMoE. The order is the order the rule creates the
        initializers in (weights and biases, then scales), which fixes the fused model's bytes.
        """
        out: dict[str, np.ndarray | None] = {
            "fc1_experts_weights": self.fc1,
            "fc1_experts_bias": self.fc1_bias,
            "fc2_experts_weights": self.fc2,
            "fc2_experts_bias": self.fc2_bias,
        }
        if self.fc1_scales is not None:
            out["fc1_scales"] = self.fc1_scales
        if self.fc2_scales is not None:
            out["fc2_scales"] = self.fc2_scales
        if self.fc1_zero_points is not None:
            out["fc1_zero_points"] = self.fc1_zero_points
        if self.fc2_zero_points is not None:
            out["fc2_zero_points"] = self.fc2_zero_points
        return out


def _concat_bias(parts: tuple[ExpertWeights, ...]) -> np.ndarray | None:
    if all(p.bias is None for p in parts):
        return None
    pieces = [
        p.bias if p.bias is not None else np.zeros((p.shape[0], p.shape[2]), p.dtype.numpy())
        for p in parts
    ]
    return np.concatenate(pieces, axis=1)


def _output_major_quant(
    codes: np.ndarray, scales: np.ndarray, bits: int, block: int
) -> tuple[np.ndarray, np.ndarray]:
    """K-major codes ``[E, K, N]`` and scales ``[E, blocks, N]`` -> QMoE weights and scales."""
    packed = pack_qmoe(np.ascontiguousarray(codes.transpose(0, 2, 1)), bits)
    s = np.ascontiguousarray(scales.transpose(0, 2, 1))  # [E, N, blocks]
    if not block:  # one block over K: one scale per output row
        s = np.ascontiguousarray(s[:, :, 0])
    return packed, s


def _zero_points_of(w: ExpertWeights) -> np.ndarray:
    """``w``'s zero points ``[E, blocks, N]``, the symmetric point where it has none."""
    if w.zero_points is not None:
        return w.zero_points
    e, _, n = w.shape
    return np.full((e, w.scale_blocks, n), zero_point(w.bits), np.uint8)


def _streamed_codes(parts: tuple[ExpertWeights, ...], cols: np.ndarray | None, bits: int):
    """The QMoE weight input of ``parts`` (joined, rows ``cols``) made expert by expert.

    None when a source's experts do not start on whole bytes (read whole instead).
    """
    pieces = []
    for p in parts:
        assert p.codes_source is not None
        src = source_of(p.codes_source)
        if src is None:
            return None
        k, n = p.shape[1], p.shape[2]
        pieces.append(Part(src, p.layout, k, n))
    signed = parts[0].offset == 0
    if any((p.offset == 0) != signed for p in parts):
        return None
    return RepackedCodes(tuple(pieces), bits, signed, row_order(cols, sum(p.n for p in pieces)))


def _streamed_scales(parts: tuple[ExpertWeights, ...], cols: np.ndarray | None, block: int):
    """The QMoE scales input of ``parts`` made expert by expert (None: read whole instead)."""
    pieces = []
    for p in parts:
        if p.scales_source is None:
            return None
        src = source_of(p.scales_source)
        if src is None:
            return None
        pieces.append(Part(src, p.layout, p.scale_blocks, p.shape[2]))
    dtype = parts[0].dtype.numpy()
    n = sum(p.n for p in pieces)
    return RepackedScales(tuple(pieces), np.dtype(dtype), not block, row_order(cols, n))


def _quant_input(parts: tuple[ExpertWeights, ...], cols: np.ndarray | None, bits: int, block: int):
    """(weights, scales) of one QMoE projection: streamed where the sources allow it."""
    codes = _streamed_codes(parts, cols, bits)
    scales = _streamed_scales(parts, cols, block)
    if codes is not None and scales is not None:
        return codes, scales
    index = slice(None) if cols is None else cols
    whole_codes = np.concatenate([p.codes for p in parts], axis=2)[:, :, index]  # type: ignore[misc]
    whole_scales = np.concatenate([p.scales for p in parts], axis=2)[:, :, index]  # type: ignore[misc]
    w, s = _output_major_quant(whole_codes, whole_scales, bits, block)
    return (codes if codes is not None else w), (scales if scales is not None else s)


def _output_major_zero_points(zp: np.ndarray, bits: int, block: int) -> np.ndarray:
    """K-major zero points ``[E, blocks, N]`` -> a packed QMoE zero-point input."""
    return pack_qmoe_zero_points(np.ascontiguousarray(zp.transpose(0, 2, 1)), bits, bool(block))


def _streamed_floats(parts: tuple[ExpertWeights, ...], cols: np.ndarray | None):
    """MoE's weight input of float ``parts`` (joined, rows ``cols``) made expert by expert.

    Float weights move as raw bytes of their width, as QMoE's scales do, so the stream is a
    :class:`~.repack.RepackedScales` with one "block" per K value. None when a part's stored
    tensor cannot be read expert by expert (then the whole layer is joined in memory).
    """
    pieces = []
    for p in parts:
        if p.float_source is None:
            return None
        src = source_of(p.float_source)
        if src is None:
            return None
        pieces.append(Part(src, p.layout, p.shape[1], p.shape[2]))
    dtype = np.dtype(parts[0].dtype.numpy())
    if any(p.dtype != parts[0].dtype for p in parts):
        return None
    n = sum(p.n for p in pieces)
    return RepackedScales(tuple(pieces), dtype, False, row_order(cols, n))


def float_arrays(plan: LayerPlan, streamed: bool = False) -> FusedArrays:
    """MoE's weights and biases from a plan of float weights (output-major).

    ``streamed``: the weights as streamed arrays where the sources allow it (a weight sink
    writes them expert by expert: peak memory one expert, not a layer); otherwise arrays, as
    the quantisation at fusion time and its error meter need.
    """
    cols = plan.fc1_columns
    bias1 = _concat_bias(plan.fc1)
    bias1 = None if bias1 is None else np.ascontiguousarray(bias1[:, cols])
    if streamed:
        w1s = _streamed_floats(plan.fc1, cols)
        w2s = _streamed_floats((plan.fc2,), None)
        if w1s is not None and w2s is not None:
            return FusedArrays(w1s, None, bias1, w2s, None, plan.fc2.bias)  # type: ignore[arg-type]
    w1 = np.concatenate([p.floats for p in plan.fc1], axis=2)[:, :, cols]  # type: ignore[misc]
    w1 = np.ascontiguousarray(w1.transpose(0, 2, 1))
    w2 = np.ascontiguousarray(plan.fc2.floats.transpose(0, 2, 1))  # type: ignore[union-attr]
    return FusedArrays(w1, None, bias1, w2, None, plan.fc2.bias)


def quantize_arrays(floats: FusedArrays, bits: int, block: int) -> FusedArrays:
    """QMoE's inputs from MoE's: both weights quantised (:func:`.quantize.quantize_weights`).

    The scales take the weights' float type (QMoE's scales are the activations' type); the
    biases stay as they are.
    """
    w1, s1 = quantize_weights(floats.fc1, bits, block, floats.fc1.dtype)
    w2, s2 = quantize_weights(floats.fc2, bits, block, floats.fc2.dtype)
    return FusedArrays(w1, s1, floats.fc1_bias, w2, s2, floats.fc2_bias)


def fused_arrays(plan: LayerPlan) -> FusedArrays:
    """Build the fused node's weights, scales and biases from ``plan``."""
    if not plan.quantized:
        return float_arrays(plan, streamed=True)
    if plan.from_float:
        return quantize_arrays(float_arrays(plan), plan.bits, plan.block)
    cols = plan.fc1_columns
    bias1 = _concat_bias(plan.fc1)
    bias1 = None if bias1 is None else np.ascontiguousarray(bias1[:, cols])
    bias2 = plan.fc2.bias
    w1, s1 = _quant_input(plan.fc1, cols, plan.bits, plan.block)
    w2, s2 = _quant_input((plan.fc2,), None, plan.bits, plan.block)
    if plan.zero_points is None:
        return FusedArrays(w1, s1, bias1, w2, s2, bias2)
    zp1 = np.concatenate([_zero_points_of(p) for p in plan.fc1], axis=2)[:, :, cols]
    z1 = _output_major_zero_points(zp1, plan.bits, plan.block)
    z2 = _output_major_zero_points(_zero_points_of(plan.fc2), plan.bits, plan.block)
    return FusedArrays(w1, s1, bias1, w2, s2, bias2, z1, z2)
