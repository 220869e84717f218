"""The transformers MoE blocks :mod:`export_transformers` exports, and what each must fuse into.

Each :class:`Spec` names a block builder (Mixtral, Qwen3-MoE, Qwen2-MoE, gpt-oss), its experts
implementation and exporter, and what the fused node must compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

OUT_DIR = Path(__file__).resolve().parent / "exported"
SEED = 0
# Sizes: H = 64 and intermediate sizes (48, 40) chosen so that no expert weight is square
# (2I != H, I != H): a fuser that transposes or un-interleaves the wrong axis fails on shapes.
HIDDEN = 64
REF_SHAPE = (2, 8, HIDDEN)  # the stored reference input: 16 tokens
# Shapes the export is checked on here (besides the reference): odd sizes, one token, more tokens.
CHECK_SHAPES = [(1, 1, HIDDEN), (1, 7, HIDDEN), (3, 5, HIDDEN), (4, 33, HIDDEN)]
MAX_FILE_BYTES = 1 << 20


# -- the models ----------------------------------------------------------------------------------


class _FirstOutput(torch.nn.Module):
    """``GptOssMLP`` without its second output (the router scores the decoder layer drops)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MoE block's hidden states."""
        return self.block(hidden_states)[0]


def _init(module: torch.nn.Module, stds: dict[str, float]) -> None:
    """Fill every parameter from N(0, std), std picked by the first matching name fragment.

    transformers' experts classes allocate with ``torch.empty``: nothing here may stay unset.
    """
    for name, param in module.named_parameters():
        std = next((s for frag, s in stds.items() if frag in name), None)
        if std is None:
            raise KeyError(f"no init std for parameter {name}")
        with torch.no_grad():
            param.normal_(0.0, std)


def build_mixtral(impl: str | None) -> tuple[torch.nn.Module, Any]:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        experts_implementation=impl,
    )
    block = MixtralSparseMoeBlock(cfg)
    _init(block, {"gate.weight": 0.2, "gate_up_proj": 0.1, "down_proj": 0.1})
    return block, cfg


def build_qwen3(impl: str | None) -> tuple[torch.nn.Module, Any]:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=40,
        num_experts=8,
        num_experts_per_tok=4,
        norm_topk_prob=True,  # as in Qwen3-30B-A3B's config.json (the class default is False)
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        experts_implementation=impl,
    )
    block = Qwen3MoeSparseMoeBlock(cfg)
    _init(block, {"gate.weight": 0.2, "gate_up_proj": 0.1, "down_proj": 0.1})
    return block, cfg


def build_qwen2(impl: str | None) -> tuple[torch.nn.Module, Any]:
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=40,
        shared_expert_intermediate_size=80,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,  # Qwen1.5-MoE / Qwen2-57B-A14B: the top-k softmax values as they are
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        experts_implementation=impl,
    )
    block = Qwen2MoeSparseMoeBlock(cfg)
    _init(
        block,
        {
            "shared_expert_gate": 0.1,
            "gate.weight": 0.2,
            "gate_up_proj": 0.1,
            "experts.down_proj": 0.1,
            "shared_expert.": 0.1,
        },
    )
    return block, cfg


def build_gpt_oss(impl: str | None) -> tuple[torch.nn.Module, Any]:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        experts_implementation=impl,
    )
    block = GptOssMLP(cfg)
    # gate_up std 0.6 makes |gate|, |up| pass the limit 7 often, so the clamps matter.
    _init(
        block,
        {
            "router.weight": 0.2,
            "router.bias": 0.2,
            "gate_up_proj_bias": 0.5,
            "gate_up_proj": 0.6,
            "down_proj_bias": 0.5,
            "down_proj": 0.1,
        },
    )
    return _FirstOutput(block), cfg


# What each family computes, read from transformers' modeling code (checked against the export).
_SWIGLU_CONCAT = {
    "activation": "SwiGLU: silu(gate) * up, silu(g) = g * sigmoid(g)",
    "swiglu_order": "gate_up_proj [E, 2I, H] concatenated: rows 0..I-1 gate, rows I..2I-1 up "
    "(chunk(2, dim=-1) of x @ W[e].T)",
    "clamp": None,
    "expert_weight_layout": "gate_up_proj [E, 2I, H], down_proj [E, H, I] (out, in): "
    "bmm(W[ids], x[..., None])",
    "biases": "none (router and experts)",
}
_RENORM = "softmax over all experts (float32), top-k, divide by the sum of the k values"
_NO_RENORM = "softmax over all experts (float32), top-k, the k softmax values as they are"


def _num_experts(cfg: Any) -> int:
    return cfg.num_local_experts if hasattr(cfg, "num_local_experts") else cfg.num_experts


def _mixtral_computes(cfg: Any) -> dict[str, Any]:
    return {
        "module": "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "router": "logits = x @ gate.weight.T (no bias)",
        "routing": _RENORM,
        "renormalised": True,
        "top_k": cfg.num_experts_per_tok,
        "num_experts": _num_experts(cfg),
        **_SWIGLU_CONCAT,
        "combine": "sum over k of routing weight * expert output",
        "shared_expert": None,
    }


def _qwen3_computes(cfg: Any) -> dict[str, Any]:
    return {
        **_mixtral_computes(cfg),
        "module": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
        "routing": _RENORM + " (norm_topk_prob=True)",
        "num_experts": cfg.num_experts,
    }


def _qwen2_computes(cfg: Any) -> dict[str, Any]:
    return {
        **_mixtral_computes(cfg),
        "module": "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "routing": _NO_RENORM + " (norm_topk_prob=False)",
        "renormalised": False,
        "num_experts": cfg.num_experts,
        "shared_expert": "sigmoid(x @ shared_expert_gate.weight.T) * "
        "down(silu(gate_proj(x)) * up_proj(x)), three bias-free Linears of intermediate "
        f"{cfg.shared_expert_intermediate_size}, added to the routed experts' sum",
    }


def _gpt_oss_computes(cfg: Any) -> dict[str, Any]:
    return {
        "module": "transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP (first output only)",
        "router": "logits = x @ router.weight.T + router.bias",
        "routing": "top-k of the logits, then softmax over the k values (= softmax, top-k, renormalise)",
        "renormalised": True,
        "top_k": cfg.num_experts_per_tok,
        "num_experts": cfg.num_local_experts,
        "activation": f"gpt-oss SwiGLU: g = min(g, {cfg.swiglu_limit}); "
        f"u = clamp(u, -{cfg.swiglu_limit}, {cfg.swiglu_limit}); "
        f"(u + 1) * g * sigmoid({cfg.swiglu_alpha} * g)",
        "swiglu_order": "interleaved: gate = gate_up[..., ::2] (even columns), up = gate_up[..., 1::2]",
        "clamp": {"gate": [None, cfg.swiglu_limit], "up": [-cfg.swiglu_limit, cfg.swiglu_limit]},
        "swiglu_alpha": cfg.swiglu_alpha,
        "swiglu_beta": 1.0,
        "expert_weight_layout": "gate_up_proj [E, H, 2I], down_proj [E, I, H] (in, out: "
        "transposed against MoE's [E, out, in]): bmm(x[:, None], W[ids])",
        "biases": "router bias [E]; gate_up_proj_bias [E, 2I] (interleaved like the weights); "
        "down_proj_bias [E, H]",
        "combine": "sum over k of routing weight * expert output",
        "shared_expert": None,
    }


def _moe_expected(cfg: Any, k: int, normalize: int, **extra: Any) -> dict[str, Any]:
    attrs = {
        "k": k,
        "normalize_routing_weights": normalize,
        "activation_type": "swiglu",
        "swiglu_fusion": 1,
        "activation_alpha": 1.0,
        "activation_beta": 0.0,
    }
    attrs.update(extra)
    return attrs


@dataclass
class Spec:
    """One export: how to build the module, how to export it, what it should fuse into."""

    name: str
    family: str
    build: Callable[[str | None], tuple[torch.nn.Module, Any]]
    impl: str | None
    exporter: str  # "dynamo", "dynamo+transformers-table" or "torchscript"
    computes: Callable[[Any], dict[str, Any]]
    expected: list[list[Any]]
    expected_attributes: Callable[[Any], dict[str, Any]] | None
    expected_note: str
    # For an export that must not fuse although it computes a MoE: the attributes of the MoE it
    # equals (checked by a hand-built node like the expected ones).
    equivalent_attributes: Callable[[Any], dict[str, Any]] | None = None
    # Ops the fused model must still hold, exactly (as sample_models/generate.py's kept_ops): the
    # router Gemm stays, as the MoE's router_probs input.
    kept_ops: list[list[Any]] = field(default_factory=list)
    # Shapes this export cannot run (recorded, checked to fail): the TorchScript loop's trap.
    failing_shapes: list[tuple[int, int, int]] = field(default_factory=list)


SPECS = [
    Spec(
        name="mixtral_batched_mm",
        family="mixtral",
        build=build_mixtral,
        impl="batched_mm",
        exporter="dynamo",
        computes=_mixtral_computes,
        expected=[["MoE", 1]],
        expected_attributes=lambda c: _moe_expected(c, c.num_experts_per_tok, 1),
        expected_note="One MoE; FC1 = gate_up_proj re-interleaved (row 2j gate j, row 2j+1 up j), "
        "FC2 = down_proj as is; router_probs = the Gemm's logits.",
        kept_ops=[["Gemm", 1]],
    ),
    Spec(
        name="qwen3_moe_batched_mm",
        family="qwen3_moe",
        build=build_qwen3,
        impl="batched_mm",
        exporter="dynamo",
        computes=_qwen3_computes,
        expected=[["MoE", 1]],
        expected_attributes=lambda c: _moe_expected(c, c.num_experts_per_tok, 1),
        expected_note="One MoE, as Mixtral's (renormalised top-k).",
        kept_ops=[["Gemm", 1]],
    ),
    Spec(
        name="qwen2_moe_batched_mm",
        family="qwen2_moe",
        build=build_qwen2,
        impl="batched_mm",
        exporter="dynamo",
        computes=_qwen2_computes,
        expected=[["MoE", 1]],
        expected_attributes=lambda c: _moe_expected(c, c.num_experts_per_tok, 0),
        expected_note="One MoE with normalize_routing_weights=0 (not renormalised: MoE only, never "
        "QMoE); the shared expert (its gate Gemm, three Gemms, two Sigmoids) stays as it is and "
        "its output is still added to the MoE's; the router Gemm stays as the MoE's router_probs.",
        kept_ops=[["Gemm", 5], ["Sigmoid", 2]],
    ),
    Spec(
        name="gpt_oss_batched_mm",
        family="gpt_oss",
        build=build_gpt_oss,
        impl="batched_mm",
        exporter="dynamo",
        computes=_gpt_oss_computes,
        expected=[["MoE", 1]],
        expected_attributes=lambda c: _moe_expected(
            c,
            c.num_experts_per_tok,
            1,
            activation_alpha=c.swiglu_alpha,
            activation_beta=1.0,
            swiglu_limit=c.swiglu_limit,
        ),
        expected_note="One MoE; FC1 = gate_up_proj transposed to [E, 2I, H] (already interleaved), "
        "fc1 bias = gate_up_proj_bias, FC2 = down_proj transposed to [E, H, I], fc2 bias = "
        "down_proj_bias; router_probs = the Gemm's logits including the router bias.",
        kept_ops=[["Gemm", 1]],
    ),
    Spec(
        name="mixtral_batched_mm_hf_table",
        family="mixtral",
        build=build_mixtral,
        impl="batched_mm",
        exporter="dynamo+transformers-table",
        computes=_mixtral_computes,
        expected=[["MoE", 1]],
        expected_attributes=lambda c: _moe_expected(c, c.num_experts_per_tok, 1),
        expected_note="As mixtral_batched_mm (same weights); only the token repeat differs: "
        "transformers' translation of repeat_interleave gives Unsqueeze/Tile/Reshape, not "
        "torchlib's Unsqueeze/Expand/Reshape.",
        kept_ops=[["Gemm", 1]],
    ),
    Spec(
        name="mixtral_grouped_mm",
        family="mixtral",
        build=build_mixtral,
        impl="grouped_mm",
        exporter="dynamo+transformers-table",
        computes=_mixtral_computes,
        expected=[],
        expected_attributes=None,
        equivalent_attributes=lambda c: _moe_expected(c, c.num_experts_per_tok, 1),
        expected_note="None for the issue's spellings: the grouped_mm form sorts the routed rows by "
        "expert (ArgSort as TopK over all rows), slices one contiguous group per expert "
        "(CumSum, Range, Gather, MatMul per expert, Concat) and un-sorts with ScatterND. It "
        "computes the same as mixtral_batched_mm (same weights), so a dedicated rule could "
        "fuse it into the same MoE; until one exists it must come out unchanged, explained.",
    ),
    Spec(
        name="mixtral_eager_torchscript",
        family="mixtral",
        build=build_mixtral,
        impl=None,
        exporter="torchscript",
        computes=_mixtral_computes,
        expected=[],
        expected_attributes=None,
        equivalent_attributes=lambda c: _moe_expected(c, c.num_experts_per_tok, 1),
        expected_note="None: the legacy exporter unrolled the eager loop once per expert hit by the "
        "example input (Split of the hit-expert list into E pieces, NonZero per expert, "
        "ScatterElements accumulation). It is input-dependent (fails in ORT when some expert is "
        "not hit, e.g. one token), so fusing it would change its meaning; leave it unchanged.",
        failing_shapes=[(1, 1, HIDDEN)],
    ),
]
