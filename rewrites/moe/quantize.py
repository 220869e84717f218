"""Opt-in quantisation of proved float MoE layers into QMoE (``--quantize int4|int8``).

A float layer the proofs show equal to one ``com.microsoft.MoE`` node can be written as QMoE
instead, with its expert weights quantised here. This is the one place where the fuser changes
what a layer computes, so it happens only when asked for (:class:`Quantization`, handed to the
rules as configuration like the weight sink) and the result is *measured*, never assumed: the
rule hands the float and the quantised arrays to the configured ``error_meter`` (the fronts give
:func:`onnx_moe_fuse.verify.quant_error.measure_quantization_error`, a run of both on fresh
random inputs; the rules import only the type) and records what it returns on the node.

The scheme (:func:`quantize_weights`), per expert and output channel ``n`` of an output-major
``w [E, N, K]``, per block of ``block`` consecutive elements along ``K`` (the whole row when
``block`` is 0, "per channel")::

    qmax  = 2 ** (bits - 1) - 1                      # 7 for int4, 127 for int8
    scale = max|w[e, n, block]| / qmax               # rounded to the scales' dtype first
    q     = clip(round_half_even(w / scale), -qmax - 1, qmax)
    code  = q + 2 ** (bits - 1)                      # QMoE's unsigned codes, zero point 8 / 128

An all-zero block gets scale 1 (its codes are the zero point, so it stays zero). Symmetric: no
zero-point inputs are written. Dequantised, each weight is the nearest point of its block's grid
(ties to even), so the error per weight is at most ``scale / 2``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_moe_fuse.contract.packing import pack_qmoe, zero_point
from onnx_moe_fuse.rewrites.graph.refusals import Refusal

__all__ = [
    "BITS",
    "BLOCK_ADVICE",
    "SCHEME",
    "BlockSizeRefusal",
    "ErrorMeter",
    "Quantization",
    "quantize_weights",
]

#: ``--quantize`` names and their bit widths.
BITS: dict[str, int] = {"int4": 4, "int8": 8}
#: The scheme in words, for the report.
SCHEME = (
    "symmetric, round to nearest (ties to even), scale = max|w| / qmax per block along K "
    "(qmax 7 for int4, 127 for int8), no zero points"
)

#: ``meter(float_inputs, quantized_inputs, attributes) -> record``: the inputs by QMoE/MoE input
#: name (output-major arrays), the fused node's semantic attributes; the record (JSON-ready)
#: holds at least ``max_rel_error``.
ErrorMeter = Callable[[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]


#: What to do instead, after a :class:`BlockSizeRefusal`'s reason and the layer.
BLOCK_ADVICE = (
    "a block runs along K (H for FC1, I for FC2): give a power of two >= 16 dividing both, "
    "or 0 for per-channel scales"
)


class BlockSizeRefusal(Refusal):
    """The requested block size does not fit a layer (it must divide H and I): a user's error.

    The pipeline turns it into an option error naming the layer (and :data:`BLOCK_ADVICE`),
    instead of a near miss: the layer would fuse with another block size, so silently leaving it
    would hide the mistake.
    """


@dataclass(frozen=True)
class Quantization:
    """What ``--quantize`` asks for: ``bits`` (4 or 8), ``block`` (0: per channel).

    ``error_meter`` measures each quantised layer against its float self (None: not measured;
    the fronts always give one). ``default_block``: ``block`` is the default, not the user's
    (a refusal says so).
    """

    bits: int
    block: int
    error_meter: ErrorMeter | None = None
    default_block: bool = False

    def __post_init__(self) -> None:
        """Refuse what QMoE cannot take (the fronts check first and name the option)."""
        if self.bits not in BITS.values():
            raise ValueError(f"quantisation bits must be 4 or 8, got {self.bits!r}")
        if self.block and (self.block < 16 or self.block & (self.block - 1)):
            raise ValueError(
                f"block size must be 0 (per channel) or a power of two >= 16, got {self.block}"
            )

    @property
    def name(self) -> str:
        """``int4`` / ``int8``."""
        return f"int{self.bits}"

    def describe(self) -> str:
        """E.g. ``int4, blocks of 32`` or ``int8, per channel``."""
        return f"{self.name}, " + (f"blocks of {self.block}" if self.block else "per channel")

    def layer_block(self, hidden: int, inter: int, at: Any = None) -> int:
        """The block size for a layer of sizes ``H``, ``I``; :class:`BlockSizeRefusal` if unfit."""
        if self.bits == 4 and (hidden % 2 or inter % 2):
            raise Refusal(
                f"int4 QMoE packs pairs along K; H = {hidden}, I = {inter} (use --quantize int8)",
                at,
            )
        if self.block and (hidden % self.block or inter % self.block):
            bad = [f"{n} = {v}" for n, v in (("H", hidden), ("I", inter)) if v % self.block]
            given = f" (the default for {self.name})" if self.default_block else ""
            raise BlockSizeRefusal(
                f"--block-size {self.block}{given} does not divide {' and '.join(bad)}", at
            )
        return self.block


def quantize_weights(
    w: np.ndarray, bits: int, block: int, scale_dtype: Any = np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """Output-major float ``w [E, N, K]`` -> packed QMoE codes and scales (the module's scheme).

    Returns ``(codes [E, N, K / pack] uint8, scales)``: ``[E, N]`` per channel (``block`` 0),
    ``[E, N, K / block]`` otherwise (``block`` must divide ``K``).
    """
    e, n, k = w.shape
    width = block or k
    assert k % width == 0, (k, block)
    qmax = (1 << (bits - 1)) - 1
    codes = np.empty((e, n, k), np.uint8)
    scales = np.empty((e, n, k // width), scale_dtype)
    for x in range(e):  # one expert at a time: float64 copies of a whole layer would not fit
        blocks = np.asarray(w[x], dtype=np.float64).reshape(n, k // width, width)
        s = (np.abs(blocks).max(axis=2) / qmax).astype(scale_dtype)
        s[s == 0] = 1  # an all-zero block: codes at the zero point, value 0
        # codes from the scales as stored, so dequantising gives the nearest grid point
        q = np.rint(blocks / s.astype(np.float64)[..., None])
        codes[x] = (np.clip(q, -qmax - 1, qmax) + zero_point(bits)).reshape(n, k)
        scales[x] = s
    return pack_qmoe(codes, bits), (scales[:, :, 0] if not block else scales)
