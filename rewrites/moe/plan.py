"""What a layer proof produces: :class:`ExpertWeights`, :class:`LayerPlan`.

The vocabulary every proof step of :mod:`.analysis` shares: the plan the rewrite emits from and
the readers of the recognised bindings. A proof step refuses with
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` inside
:func:`~onnx_moe_fuse.rewrites.graph.refusals.part`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.contract.ops import ACTIVATION_TYPES
from onnx_moe_fuse.rewrites.graph.tensor_reads import read_array

#: Activations QMoE takes: ORT CPU runs all five, and so do this project's QMoE kernels
#: (kernels/qmoe/manifest.json; test.json has a gelu, silu and identity case each). A target
#: with fewer (onnxruntime-webgpu: swiglu only) refuses the rest in ``contract.targets``.
QMOE_ACTIVATIONS = frozenset(ACTIVATION_TYPES)
#: Activations ORT's CPU MoE runs.
MOE_ACTIVATIONS = frozenset(ACTIVATION_TYPES)
#: The float types of expert weights (and DequantizeLinear scales) a layer proof reads.
FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
#: The float types a fused node computes in: MoE/QMoE's ``T`` (which targets have a kernel for
#: which is ``contract.targets``' business).
LAYER_DTYPES = frozenset(FLOAT_TYPES)
QUANT_TYPES = {
    ir.DataType.INT4: (4, True),
    ir.DataType.UINT4: (4, False),
    ir.DataType.INT8: (8, True),
    ir.DataType.UINT8: (8, False),
}


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """One expert projection's weights in GroupedMatMul's K-major layout ``[E, K, N]``.

    Float weights keep ``float_source``, the stored tensor (``layout`` as stored), never read by
    the proofs; :attr:`floats` reads a whole layer and serves only the forms that cannot be
    streamed (a float tensor that is not external data is held in ``array`` as read). Quantized ones keep their source tensors, never read by the
    proofs: ``codes_source`` (the integer codes as stored, ``layout`` ``"kn"`` ``[E, K, N]`` or
    ``"nk"`` ``[E, N, K]``, symmetric zero point ``offset``) and, for 3-D scales,
    ``scales_source`` (stored in the same layout; smaller scales, broadcast to ``[E, 1, N]``,
    are read into ``small_scales``). ``scale_blocks`` is the number of scales along K, ``block``
    the block size along K the source declares (0 when it declares none, or one partial block).
    The emission reads the codes expert by expert (:mod:`.repack`); :attr:`raw`, :attr:`codes`
    and :attr:`scales` read a whole layer's and serve only the forms that cannot be streamed.
    ``zero_points`` ``[E, blocks, N]`` (like the scales) holds asymmetric zero points in the
    unsigned code space of :attr:`codes` (value = ``(code - zp) * scale``); None when every zero
    point is the symmetric one.
    """

    role: str
    value: ir.Value
    shape: tuple[int, int, int]
    dtype: ir.DataType
    array: np.ndarray | None = None
    codes_source: ir.TensorProtocol | None = None
    layout: str = "kn"
    offset: int = 0
    small_scales: np.ndarray | None = None
    scales_source: ir.TensorProtocol | None = None
    scale_blocks: int = 1
    bits: int = 0
    block: int = 0
    bias: np.ndarray | None = None
    source_nodes: tuple[ir.Node, ...] = ()
    zero_points: np.ndarray | None = None
    float_source: ir.TensorProtocol | None = None

    @cached_property
    def floats(self) -> np.ndarray | None:
        """Float weights K-major ``[E, K, N]`` (an external source is read whole: fallback)."""
        if self.array is not None or self.float_source is None:
            return self.array
        w = read_array(self.float_source)
        return w.transpose(0, 2, 1) if self.layout == "nk" else w

    @cached_property
    def raw(self) -> np.ndarray | None:
        """The source's integer codes, K-major ``[E, K, N]`` (a whole layer read: fallback)."""
        if self.codes_source is None:
            return None
        q = read_array(self.codes_source)
        return q.transpose(0, 2, 1) if self.layout == "nk" else q

    @cached_property
    def scales(self) -> np.ndarray | None:
        """The scales K-major ``[E, blocks, N]`` (a 3-D source is read whole: fallback)."""
        if self.scales_source is None:
            return self.small_scales
        s = read_array(self.scales_source)
        return np.ascontiguousarray(s.transpose(0, 2, 1) if self.layout == "nk" else s)

    @cached_property
    def codes(self) -> np.ndarray | None:
        """Unsigned QMoE codes ``[E, K, N]``: value = ``(code - zp) * scale``.

        ``zp`` is ``2**(bits-1)``, or :attr:`zero_points` where the weights have their own.
        """
        if self.raw is None:
            return None
        return (self.raw.astype(np.int16) - self.offset + (1 << (self.bits - 1))).astype(np.uint8)

    @property
    def per_channel(self) -> bool:
        """True when the scales can be one per expert and output channel (a single block)."""
        return self.quantized and self.scale_blocks == 1

    @property
    def quantized(self) -> bool:
        """True for DequantizeLinear weights."""
        return self.codes_source is not None

    def describe(self) -> str:
        """E.g. ``int4 blocked 32`` or ``float``."""
        if not self.quantized:
            return "float"
        zp = ", asymmetric" if self.zero_points is not None else ""
        if self.block and not self.per_channel:
            return f"{self.bits}-bit blocked {self.block}{zp}"
        if self.block:
            return f"{self.bits}-bit per channel (one block of {self.block}){zp}"
        return f"{self.bits}-bit per channel{zp}"


@dataclass(frozen=True, eq=False)
class LayerPlan:
    """Everything the rewrite needs to emit one fused node (computed, never stored)."""

    op: str
    root: ir.Node
    topk: ir.Node
    tokens: ir.Value
    router_probs: ir.Value
    rank: int
    num_experts: int
    k: int
    hidden: int
    inter: int
    normalize: int
    activation: str
    fc1: tuple[ExpertWeights, ...]
    fc1_columns: np.ndarray
    fc2: ExpertWeights
    alpha: float = 1.0
    beta: float = 0.0
    limit: float | None = None
    bits: int = 0
    block: int = 0
    #: the weights' zero points: "per-channel" / "block-wise" when any projection has
    #: asymmetric ones (the fused node gets explicit zero-point inputs), else None
    zero_points: str | None = None
    layer_nodes: tuple[ir.Node, ...] = field(default=())
    # the router-agnostic routing: the selection TopK's indices and the final weights the
    # fused node is fed through the routing construction (None: its own softmax routing)
    selection: ir.Value | None = None
    selected_weights: ir.Value | None = None
    weights_sum_to_one: bool = False
    # the float type the fused node computes in (its input, output, router and scales)
    dtype: ir.DataType = ir.DataType.FLOAT
    # the type the combine sums in when a widening Cast makes it wider than ``dtype`` (a
    # float16 export's float32 combine), known even where the graph does not declare it
    out_dtype: ir.DataType | None = None

    @property
    def quantized(self) -> bool:
        """True when the layer becomes a QMoE."""
        return self.op == "QMoE"

    @property
    def from_float(self) -> bool:
        """True for a float layer quantised on request (``--quantize``): QMoE of float weights."""
        return self.quantized and not self.fc2.quantized

    def attributes(self) -> dict[str, Any]:
        """Every attribute of the emitted node, written explicitly."""
        swiglu = self.activation == "swiglu"
        attrs: dict[str, Any] = {
            "k": int(self.k),
            "activation_type": self.activation,
            "normalize_routing_weights": int(self.normalize),
            "use_sparse_mixer": 0,
            "swiglu_fusion": 1 if swiglu else 0,
            "activation_alpha": float(self.alpha),
            "activation_beta": float(self.beta),
            "swiglu_limit": float(self.limit) if self.limit is not None else math.inf,
        }
        if self.quantized:
            attrs["expert_weight_bits"] = int(self.bits)
            attrs["block_size"] = int(self.block)
        return attrs


# ---------------------------------------------------------------------------------------------


def bound_node(b: Mapping[str, Any], name: str) -> ir.Node | None:
    """The producer of the value bound to ``name``, or None."""
    v = b.get(name)
    return v.producer() if isinstance(v, ir.Value) else None


def is_last_axis(axis: int | None, rank: int) -> bool:
    return axis is not None and axis in (-1, rank - 1)
