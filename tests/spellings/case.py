"""One generated MoE layer (:class:`LayerCase`) and the outcome it must have (:func:`expected`).

Split out of ``strategies.py`` (which re-exports every name). A case picks one spelling per
part (router, routing, experts, activation, combine, weights, tokens) plus sizes and a seed,
and optionally one mutation that breaks the layer's equivalence to a fused node in exactly one
place; :func:`expected` says what the fuser must do with it, from the meaning of ORT's
MoE/QMoE alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .axes import CONSTRUCTED_ROUTINGS, MUTATION_PART, PER_SLOT_EXPERTS, SWIGLU


@dataclass(frozen=True)
class LayerCase:
    """One generated MoE layer: a spelling per part, sizes, a seed and an optional mutation.

    ``groups`` and ``topk_group`` are the group-limited top-k's sizes (routing
    ``grouped_topk``: ``groups`` groups of ``E / groups`` experts, the experts chosen within
    the ``topk_group`` best groups); 1 and 1 for every other routing.
    """

    router: str
    routing: str
    experts: str
    activation: str
    combine: str
    weight_dtype: str
    granularity: str
    zero_point: str
    rank: int
    shapes: str
    hidden: int
    inter: int
    experts_count: int
    top_k: int
    token_dims: tuple[int, ...]  # the static sizes before H ([T] or [B, S]); feeds use them
    seed: int
    mutation: str | None = None
    opset_version: int = 21  # 21..23 (blocked DequantizeLinear needs 21)
    groups: int = 1
    topk_group: int = 1
    bias: str = "none"  # axes.BIASES: per-expert FC1/FC2 biases of a per-slot layout

    @property
    def quantized(self) -> bool:
        """True when the expert weights are behind DequantizeLinear."""
        return self.weight_dtype != "float32"

    @property
    def bits(self) -> int:
        """The bit width of the quantized codes (32 for float)."""
        return {"int4": 4, "uint4": 4, "int8": 8, "uint8": 8}.get(self.weight_dtype, 32)

    @property
    def fused_fc1(self) -> bool:
        """True when gate and linear come from one FC1 projection of width 2 I."""
        return self.activation in SWIGLU and self.activation != "swiglu_separate"

    @property
    def opset(self) -> int:
        """The default-domain opset: ``opset_version``, or 24 where the Swish op needs it."""
        return 24 if self.activation == "swish" else self.opset_version

    @property
    def flat_tokens(self) -> bool:
        """True when rank-3 tokens are flattened to ``[T, H]`` rows before the router.

        The per-slot layouts route ``[B, S, H]`` tokens as they are, unless the router is a
        Gemm (2-D only) or the combine splits flat rows back (``split_rows``).
        """
        return self.rank == 3 and (
            self.experts not in PER_SLOT_EXPERTS
            or self.router == "gemm_transb"
            or self.combine == "split_rows"
        )

    @property
    def constructed(self) -> bool:
        """True when a fused node can take the routing only through the routing construction.

        The routings of :data:`~.axes.CONSTRUCTED_ROUTINGS` (sigmoid scores, biased or grouped
        choice, routing factors, top-1 without renormalisation), and raw top-k softmax weights
        on quantized experts (QMoE on ORT CPU always renormalises the k weights).
        """
        return self.routing in CONSTRUCTED_ROUTINGS or (
            self.routing == "softmax_topk_raw" and self.quantized
        )

    def label(self) -> str:
        """A short readable name of the case."""
        w = (
            "f32"
            if not self.quantized
            else f"{self.weight_dtype}-{self.granularity}-zp{self.zero_point}"
        )
        groups = f" G{self.groups}/{self.topk_group}" if self.routing == "grouped_topk" else ""
        if self.bias != "none":
            groups += f" bias-{self.bias}"
        base = (
            f"{self.router}/{self.routing}/{self.experts}/{self.activation}/{self.combine}/{w}/"
            f"r{self.rank}-{self.shapes} H{self.hidden} I{self.inter} E{self.experts_count} "
            f"k{self.top_k}{groups} opset{self.opset} seed{self.seed}"
        )
        return base if self.mutation is None else f"{base} !{self.mutation}"

    def axis_values(self) -> dict[str, object]:
        """The spelling chosen on every axis (the keys of ``strategies.SUPPORTED``)."""
        return {
            "router": self.router,
            "routing": self.routing,
            "experts": self.experts,
            "activation": self.activation,
            "combine": self.combine,
            "weight_dtype": self.weight_dtype,
            "granularity": self.granularity if self.quantized else None,
            "zero_point": self.zero_point if self.quantized else None,
            "rank": self.rank,
            "shapes": self.shapes,
            "bias": self.bias,
            "mutation": self.mutation,
        }


@dataclass(frozen=True)
class Expected:
    """What the fuser must do with a case.

    Fuse into ``op`` with ``attributes`` (a value, or a set of allowed values, per attribute),
    or refuse (``op`` None) with a near miss naming ``part``.
    """

    op: str | None
    attributes: Mapping[str, object]
    part: str | None = None


#: A small float layer of the commonest spellings, for tests that change one axis at a time.
SMALL_BASE = LayerCase(
    router="matmul",
    routing="softmax_topk_div",
    experts="gather_expand",
    activation="swiglu_separate",
    combine="mul_reducesum",
    weight_dtype="float32",
    granularity="channel",
    zero_point="absent",
    rank=2,
    shapes="symbolic",
    hidden=16,
    inter=8,
    experts_count=4,
    top_k=2,
    token_dims=(5,),
    seed=3,
)


def group_options(experts: int) -> list[int]:
    """The group counts a ``grouped_topk`` of ``experts`` takes: 2 or more groups of 2 or more."""
    return [g for g in range(2, experts // 2 + 1) if experts % g == 0]


def expected(case: LayerCase) -> Expected:
    """The outcome ``case`` must have (from the meaning of ORT's MoE/QMoE, not the fuser).

    A constructed routing (:attr:`LayerCase.constructed`) leaves ``normalize_routing_weights``
    open: the construction feeds ORT either the weights as they are (0) or logits whose softmax
    over the k is renormalised back by a rescale after the node (1), whichever the target takes.
    """
    if case.mutation is not None:
        return Expected(None, {}, MUTATION_PART[case.mutation])
    act = case.activation
    swiglu = act in SWIGLU
    oss = act == "swiglu_oss"
    normalize: object = 0 if case.routing == "softmax_topk_raw" else 1
    attrs: dict[str, object] = {
        "k": case.top_k,
        "activation_type": "swiglu"
        if swiglu
        else {"relu": "relu", "gelu_tanh": "gelu", "gelu_tanh_hand": "gelu"}.get(act, "silu"),
        "normalize_routing_weights": {0, 1} if case.constructed else normalize,
        "use_sparse_mixer": 0,
        "swiglu_fusion": 1 if swiglu else 0,
        "activation_alpha": 1.702 if oss else 1.0,
        "activation_beta": 1.0 if oss else 0.0,
        "swiglu_limit": 7.0 if oss else math.inf,
    }
    if not case.quantized:
        return Expected("MoE", attrs)
    attrs["expert_weight_bits"] = case.bits
    if case.granularity == "block32" and max(case.hidden, case.inter) > 32:
        attrs["block_size"] = 32
    elif case.granularity == "block32":  # one block of 32 over each K: per channel too
        attrs["block_size"] = {0, 32}
    else:
        # one block over K per projection: per channel (0), or K itself when FC1 and FC2 share it
        attrs["block_size"] = {0, case.hidden} if case.hidden == case.inter else {0}
    return Expected("QMoE", attrs)
