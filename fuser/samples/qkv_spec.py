"""The records of the attention-prelude samples: the spec of a prelude and what it must fuse into.

:data:`NORMS` and :data:`PROJECTIONS` list the spellings; :mod:`.qkv` has the catalogue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import onnx
import onnx.numpy_helper

Norm = Literal[
    "decomposed",  # Pow(x, 2), ReduceMean, Add(ms, eps), Sqrt, Div(x, rms), Mul(normalized, scale)
    "decomposed_recip",  # Mul(x, x), Add(eps, ms), Sqrt, Reciprocal, Mul(x, inv), Mul(scale, .)
    "decomposed_cast",  # Cast(x, f32), Pow, ..., Reciprocal, Mul, Cast(f16), Mul(scale, .)
    "add_decomposed",  # Add(x, skip) then "decomposed"
    "rms23",  # RMSNormalization (opset 23)
    "sln",  # SimplifiedLayerNormalization (ORT, default domain)
    "add_sln",  # Add(x, skip) then SimplifiedLayerNormalization
    "skip_sln",  # com.microsoft.SkipSimplifiedLayerNormalization, residual output
]
Projection = Literal[
    "nbits",  # MatMulNBits, no zero points
    "nbits_zp8",  # MatMulNBits, packed uint8 zero points all 8 (0x88)
    "nbits_asym",  # MatMulNBits, asymmetric packed zero points (near miss)
    "nbits_bits8",  # MatMulNBits with bits=8 (near miss)
    "dq_int4",  # DequantizeLinear(int4, no zero point) + MatMul
    "dq_uint4_zp8",  # DequantizeLinear(uint4, zero point 8) + MatMul
]
NORMS: tuple[str, ...] = Norm.__args__  # type: ignore[attr-defined]
PROJECTIONS: tuple[str, ...] = Projection.__args__  # type: ignore[attr-defined]

IR_VERSION = 10  # int4 needs IR 10
IR_VERSION_OPSET23 = 11
FLOAT16 = onnx.TensorProto.FLOAT16
FLOAT = onnx.TensorProto.FLOAT
ROLES = ("q", "k", "v")


@dataclass(frozen=True)
class QkvSpec:
    """Everything that defines one prelude sample (weights come from the name's seed)."""

    name: str
    norm: Norm
    projection: Projection
    dtype: Literal["float32", "float16"] = "float32"
    rank: int = 2
    hidden: int = 96
    nq: int = 64
    nkv: int = 32
    block_size: int = 32
    epsilon: float | None = 1e-6  # None: the op's default (RMSNormalization, SLN, SSLN only)
    roles: tuple[str, ...] = ROLES  # projections in graph order; "q", "k", "v"
    out_names: tuple[str, ...] = ("q", "k", "v")  # graph output name per projection (same order)
    weight_names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    residual_output: bool = False  # skip forms: A + skip is a graph output
    extra_normed_consumer: bool = False  # the normalised value also feeds ReduceSum -> output
    opset: int = 21

    @property
    def k_blocks(self) -> int:
        """Blocks along K."""
        return -(-self.hidden // self.block_size)

    @property
    def has_skip(self) -> bool:
        """True for the forms with a skip input."""
        return self.norm in ("add_sln", "add_decomposed", "skip_sln")

    @property
    def np_dtype(self) -> np.dtype:
        """The activation dtype."""
        return np.dtype(self.dtype)

    @property
    def width(self) -> dict[str, int]:
        """Output width per role."""
        return {"q": self.nq, "k": self.nkv, "v": self.nkv}


@dataclass(frozen=True)
class QkvEntry:
    """One catalogue entry: the prelude to build and what a fuser must make of it.

    ``expected_inputs`` maps MatMulNBitsQkv's input slots to the original value that must fill
    them (``""`` for an empty slot); a B or scales slot not listed holds a new initializer (DQ
    weights repacked into MatMulNBits layout), which the tests compare with the sample's
    weights. ``expected_outputs`` are the names the fused node's outputs must carry.
    """

    spec: QkvSpec
    family: str
    description: str
    expected: list[tuple[str, int]]
    near_miss_reason: str | None = None
    expected_attributes: dict[str, int | float | str] = field(default_factory=dict)
    expected_inputs: dict[str, str] = field(default_factory=dict)
    expected_outputs: tuple[str, ...] = ()
    kept_ops: list[tuple[str, int]] = field(default_factory=list)
