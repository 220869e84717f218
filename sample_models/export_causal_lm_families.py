"""The transformers MoE families exported whole by ``export_causal_lm.py``: configs and facts.

For each family: a tiny config made in code (hidden 64, 2 layers, 2 heads, vocab 128, 4-8
experts, top-k 2, expert intermediate 16 so that no expert weight is square), the
``*ForCausalLM`` class, and what its MoE layers compute, read from the installed transformers'
modeling code (``transformers/models/<family>/modeling_<family>.py``, version in each record).
``router`` records the routing form found there; ``expected_layer`` says what a correct fuser
must do with one MoE layer of that family in float32 (``MoE`` or refused, and what the refusal
must name). Kept apart from the export machinery so the facts can be read in one sitting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HIDDEN = 64
VOCAB = 128
LAYERS = 2
HEADS = 2
EXPERT_INTERMEDIATE = 16  # 2I = 32, I = 16, H = 64: no square expert weight
DENSE_INTERMEDIATE = 40  # dense MLPs and shared experts

# Fields every tiny config shares (each family's names for them).
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "initializer_range": 0.1,  # std 0.02 routes almost uniformly; 0.1 makes top-k decisive
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": False,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Family:
    """One transformers MoE family: how to make its tiny model, and what its MoE layers are."""

    name: str
    config_class: str
    model_class: str
    config: dict[str, Any]
    # The MoE block classes (decoder layers holding another MLP are dense: nothing to fuse).
    moe_blocks: tuple[str, ...]
    router: dict[str, Any]
    # What a correct fuser must do with one float32 MoE layer: {"outcome": "MoE", "attributes":
    # ...} or {"outcome": "refused", "refusal_names": "router", ...}.
    expected_layer: Callable[[Any], dict[str, Any]]
    # Whether config.experts_implementation selects batched_mm / grouped_mm for its experts
    # (``transformers.integrations.moe.use_experts_implementation`` on the experts class).
    dispatches_experts: bool = True
    # Also export float16 with static shapes (for a family whose dynamic exports cannot be made,
    # so that it still has a float16 export).
    static_fp16: bool = False
    # An export patch (``export_causal_lm_onnx.PATCHES``) tried when the plain export fails.
    export_patch: str | None = None


def _moe(k: int, normalize: bool, **extra: Any) -> dict[str, Any]:
    attrs = {
        "k": k,
        "normalize_routing_weights": int(normalize),
        "activation_type": "swiglu",
        "swiglu_fusion": 1,
        "activation_alpha": 1.0,
        "activation_beta": 0.0,
        **extra,
    }
    return {"outcome": "MoE", "attributes": attrs}


def _moe_topk(k: int) -> dict[str, Any]:
    """A layer whose router is any top-k selection with per-selected non-negative weights.

    The fused op carries such a router exactly: the router subgraph stays, and the fused node is
    fed its TopK indices and final weights, so only the op and k are pinned (the construction
    chooses ``normalize_routing_weights`` and the rest itself).
    """
    return {"outcome": "MoE", "attributes": {"k": k}}


def _refused(names: str, why: str) -> dict[str, Any]:
    return {"outcome": "refused", "refusal_names": names, "why": why}


_SOFTMAX_TOPK = (
    "logits = x @ W.T (no bias); probs = softmax(logits, float32); top-k of probs; {renorm}"
)
_TOPK_SOFTMAX = (
    "logits = x @ W.T{bias}; top-k of the logits; softmax over the k values "
    "(= softmax over all, top-k, renormalised)"
)
_SIGMOID_GROUP_TOPK = (
    "{cls}: scores = sigmoid(x @ W.T) (float32); choice = scores + e_score_correction_bias "
    "(selection only); group score = sum of the top-2 choices per group, top topk_group groups "
    "kept, others -inf; top-k of choice; weights = scores at those experts"
    "{renorm} * routed_scaling_factor"
)
_GROUP_RENORM = " / (their sum + 1e-20) (norm_topk_prob=True)"
_SHARED_UNGATED = "plus {what} ungated shared expert(s), added to the routed sum"
_SHARED_GATED = (
    "plus a shared expert: sigmoid(x @ shared_expert_gate.T) * down(silu(gate(x)) * up(x)), "
    "added to the routed sum (stays outside the fused MoE)"
)


def _renorm(flag: bool) -> str:
    return (
        "divided by the sum of the k values (norm_topk_prob=True)"
        if flag
        else "the k softmax values as they are (norm_topk_prob=False)"
    )


FAMILIES: list[Family] = [
    Family(
        name="mixtral",
        config_class="MixtralConfig",
        model_class="MixtralForCausalLM",
        config={
            "intermediate_size": EXPERT_INTERMEDIATE,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 32,
        },
        moe_blocks=("MixtralSparseMoeBlock",),
        router={
            "form": "softmax_topk",
            "code": "MixtralTopKRouter: " + _SOFTMAX_TOPK.format(renorm=_renorm(True)),
            "renormalised": True,
            "shared_expert": None,
        },
        expected_layer=lambda c: _moe(c.num_experts_per_tok, True),
    ),
    Family(
        name="qwen3_moe",
        config_class="Qwen3MoeConfig",
        model_class="Qwen3MoeForCausalLM",
        config={
            "intermediate_size": DENSE_INTERMEDIATE,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,  # Qwen3-30B-A3B's config.json (class default False)
            "head_dim": 32,
        },
        moe_blocks=("Qwen3MoeSparseMoeBlock",),
        router={
            "form": "softmax_topk",
            "code": "Qwen3MoeTopKRouter: " + _SOFTMAX_TOPK.format(renorm=_renorm(True)),
            "renormalised": True,
            "shared_expert": None,
        },
        expected_layer=lambda c: _moe(c.num_experts_per_tok, c.norm_topk_prob),
    ),
    Family(
        name="qwen2_moe",
        config_class="Qwen2MoeConfig",
        model_class="Qwen2MoeForCausalLM",
        config={
            "intermediate_size": DENSE_INTERMEDIATE,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "shared_expert_intermediate_size": DENSE_INTERMEDIATE,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,  # Qwen1.5-MoE-A2.7B
        },
        moe_blocks=("Qwen2MoeSparseMoeBlock",),
        router={
            "form": "softmax_topk",
            "code": "Qwen2MoeTopKRouter: "
            + _SOFTMAX_TOPK.format(renorm=_renorm(False))
            + "; "
            + _SHARED_GATED,
            "renormalised": False,
            "shared_expert": "sigmoid-gated",
        },
        expected_layer=lambda c: _moe(c.num_experts_per_tok, c.norm_topk_prob),
    ),
    Family(
        name="olmoe",
        config_class="OlmoeConfig",
        model_class="OlmoeForCausalLM",
        config={
            "intermediate_size": EXPERT_INTERMEDIATE,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,  # OLMoE-1B-7B
        },
        moe_blocks=("OlmoeSparseMoeBlock",),
        router={
            "form": "softmax_topk",
            "code": "OlmoeTopKRouter: " + _SOFTMAX_TOPK.format(renorm=_renorm(False)),
            "renormalised": False,
            "shared_expert": None,
            "note": "q/k RMSNorm over the whole projection (OlmoeAttention q_norm, k_norm)",
        },
        expected_layer=lambda c: _moe(c.num_experts_per_tok, c.norm_topk_prob),
    ),
    Family(
        name="gpt_oss",
        config_class="GptOssConfig",
        model_class="GptOssForCausalLM",
        config={
            "intermediate_size": EXPERT_INTERMEDIATE,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 32,
            "sliding_window": 4,  # layer 0 sliding, layer 1 full (the default alternation)
            "swiglu_limit": 7.0,
            "swiglu_alpha": 1.702,
        },
        moe_blocks=("GptOssMLP",),
        router={
            "form": "topk_softmax",
            "code": "GptOssTopKRouter: "
            + _TOPK_SOFTMAX.format(bias=" + router.bias")
            + "; experts: interleaved gate/up (even/odd columns), [E, in, out] weights with "
            "biases, gate clamped above at swiglu_limit, up clamped to +-swiglu_limit, "
            "(up + 1) * gate * sigmoid(alpha * gate)",
            "renormalised": True,
            "shared_expert": None,
        },
        expected_layer=lambda c: _moe(
            c.num_experts_per_tok,
            True,
            activation_alpha=c.swiglu_alpha,
            activation_beta=1.0,
            swiglu_limit=c.swiglu_limit,
        ),
    ),
    Family(
        name="granitemoe",
        config_class="GraniteMoeConfig",
        model_class="GraniteMoeForCausalLM",
        config={
            "intermediate_size": EXPERT_INTERMEDIATE,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            # Non-trivial multipliers, as granite-3.0-1b-a400m's config.json has.
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.015625,
            "logits_scaling": 6.0,
        },
        moe_blocks=("GraniteMoeMoE",),
        router={
            "form": "topk_softmax",
            "code": "GraniteMoeTopKRouter: " + _TOPK_SOFTMAX.format(bias=" (no bias)"),
            "renormalised": True,
            "shared_expert": None,
        },
        expected_layer=lambda c: _moe(c.num_experts_per_tok, True),
    ),
    Family(
        name="phimoe",
        config_class="PhimoeConfig",
        model_class="PhimoeForCausalLM",
        config={
            "intermediate_size": EXPERT_INTERMEDIATE,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 32,
        },
        moe_blocks=("PhimoeSparseMoeBlock",),
        router={
            "form": "sparsemixer",
            "code": "PhimoeTopKRouter -> sparsemixer (eval): expert 1 = argmax(logits), weight = "
            "softmax of the logits masked to -inf where (max - l) / max(|l|, max) > "
            "2 * router_jitter_noise, taken at expert 1; expert 2 = argmax with expert 1 set "
            "to -inf, weight = the same masked softmax around the second max (top-2 only)",
            "renormalised": None,
            "shared_expert": None,
        },
        expected_layer=lambda c: _refused(
            "router",
            "sparsemixer routing (two masked softmaxes around the first and second maximum, "
            "threshold 2 * router_jitter_noise) is not softmax top-k: no MoE normalisation "
            "computes it",
        ),
    ),
    Family(
        name="deepseek_v3",
        config_class="DeepseekV3Config",
        model_class="DeepseekV3ForCausalLM",
        config={
            "intermediate_size": DENSE_INTERMEDIATE,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "first_k_dense_replace": 1,  # layer 0 dense MLP, layer 1 MoE (as the real model)
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "num_key_value_heads": HEADS,
        },
        moe_blocks=("DeepseekV3MoE",),
        router={
            "form": "sigmoid_bias_group_topk",
            "code": "DeepseekV3TopkRouter: scores = sigmoid(x @ W.T) (float32); choice = scores + "
            "e_score_correction_bias; group score = sum of the top-2 choices per group, top "
            "topk_group groups kept, others -inf; top-k of choice; weights = scores at those "
            "experts / (their sum + 1e-20) * routed_scaling_factor; plus ungated shared experts",
            "renormalised": True,
            "shared_expert": "ungated (DeepseekV3MLP, n_shared_experts * moe_intermediate_size)",
        },
        # Top-k selection + per-selected non-negative weights: the fused op carries it exactly.
        expected_layer=lambda c: _moe_topk(c.num_experts_per_tok),
    ),
    Family(
        name="llama4",
        config_class="Llama4TextConfig",
        model_class="Llama4ForCausalLM",
        config={
            "intermediate_size": EXPERT_INTERMEDIATE,
            "intermediate_size_mlp": DENSE_INTERMEDIATE,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 32,
            "interleave_moe_layer_step": 1,
            "attention_chunk_size": 8,
        },
        moe_blocks=("Llama4TextMoe",),
        router={
            "form": "sigmoid_topk_dense",
            "code": "Llama4Router: logits = x @ W.T; top-k of the logits; scores = sigmoid of the "
            "top-k logits scattered into -inf elsewhere (0 after sigmoid); every expert runs on "
            "every token, its input pre-scaled by its score (Llama4TextExperts bmm over all "
            "experts), summed, plus an ungated shared expert",
            "renormalised": False,
            "shared_expert": "ungated (Llama4TextMLP)",
        },
        expected_layer=lambda c: _refused(
            "router",
            "sigmoid of the top-k logits (not softmax), applied to the expert input, not its "
            "output",
        ),
        dispatches_experts=False,
    ),
    Family(
        name="qwen3_next",
        config_class="Qwen3NextConfig",
        model_class="Qwen3NextForCausalLM",
        config={
            "intermediate_size": DENSE_INTERMEDIATE,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "shared_expert_intermediate_size": DENSE_INTERMEDIATE,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            # One linear-attention (gated delta net) layer, one full-attention layer.
            "layer_types": ["linear_attention", "full_attention"],
        },
        moe_blocks=("Qwen3NextSparseMoeBlock",),
        router={
            "form": "softmax_topk",
            "code": "Qwen3NextTopKRouter: "
            + _SOFTMAX_TOPK.format(renorm=_renorm(True))
            + "; "
            + _SHARED_GATED,
            "renormalised": True,
            "shared_expert": "sigmoid-gated",
        },
        expected_layer=lambda c: _moe(c.num_experts_per_tok, c.norm_topk_prob),
        # torch.export specialises the sequence of the gated delta net's chunk loop: no dynamic
        # export, so its float16 export is static.
        static_fp16=True,
    ),
    # -- routers of any top-k form: sigmoid or softmax scores, a selection-only correction bias,
    # group-limited top-k, routing scaling factors, clamped renormalisation. Each is a top-k
    # selection with per-selected non-negative weights, which the fused MoE carries exactly
    # (the router subgraph kept, the fused node fed its TopK indices and final weights).
    Family(
        name="glm4_moe",
        config_class="Glm4MoeConfig",
        model_class="Glm4MoeForCausalLM",
        config={
            "intermediate_size": DENSE_INTERMEDIATE,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            # GLM-4.5's config.json: one group (the group-limited top-k keeps every expert, but
            # the code still computes it), scaling 2.5, q/k norms, attention biases.
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "first_k_dense_replace": 1,  # layer 0 dense MLP, layer 1 MoE
            "use_qk_norm": True,
            "attention_bias": True,
        },
        moe_blocks=("Glm4MoeMoE",),
        router={
            "form": "sigmoid_bias_group_topk",
            "code": _SIGMOID_GROUP_TOPK.format(cls="Glm4MoeTopkRouter", renorm=_GROUP_RENORM)
            + "; "
            + _SHARED_UNGATED.format(what="an"),
            "renormalised": True,
            "shared_expert": "ungated (Glm4MoeMLP, n_shared_experts * moe_intermediate_size)",
            "note": "partial rotary (partial_rotary_factor 0.5, the config's default)",
        },
        expected_layer=lambda c: _moe_topk(c.num_experts_per_tok),
    ),
    Family(
        name="dots1",
        config_class="Dots1Config",
        model_class="Dots1ForCausalLM",
        config={
            "intermediate_size": DENSE_INTERMEDIATE,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 2,  # dots.llm1: 2 shared experts, one group, scaling 2.5
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "first_k_dense_replace": 1,
        },
        moe_blocks=("Dots1MoE",),
        router={
            "form": "sigmoid_bias_group_topk",
            "code": _SIGMOID_GROUP_TOPK.format(cls="Dots1TopkRouter", renorm=_GROUP_RENORM)
            + "; "
            + _SHARED_UNGATED.format(what="2"),
            "renormalised": True,
            "shared_expert": "ungated (Dots1MLP, n_shared_experts * moe_intermediate_size)",
            "note": "q/k RMSNorm per head (Dots1Attention q_norm, k_norm)",
        },
        expected_layer=lambda c: _moe_topk(c.num_experts_per_tok),
    ),
    Family(
        name="exaone_moe",
        config_class="ExaoneMoeConfig",
        model_class="ExaoneMoeForCausalLM",
        config={
            "intermediate_size": DENSE_INTERMEDIATE,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "num_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "first_k_dense_replace": 1,
            "sliding_window": 4,  # layer 0 sliding, layer 1 full
            "sliding_window_pattern": 2,
        },
        moe_blocks=("ExaoneMoeSparseMoEBlock",),
        router={
            "form": "sigmoid_bias_group_topk",
            "code": _SIGMOID_GROUP_TOPK.format(cls="ExaoneMoeTopkRouter", renorm=_GROUP_RENORM)
            + "; "
            + _SHARED_UNGATED.format(what="an"),
            "renormalised": True,
            "shared_expert": "ungated (ExaoneMoeMLP, num_shared_experts * moe_intermediate_size)",
            "note": "q/k RMSNorm per head; layer 0 sliding-window attention",
        },
        expected_layer=lambda c: _moe_topk(c.num_experts_per_tok),
    ),
    Family(
        name="minimax_m2",
        config_class="MiniMaxM2Config",
        model_class="MiniMaxM2ForCausalLM",
        config={
            "intermediate_size": EXPERT_INTERMEDIATE,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "head_dim": 32,
        },
        moe_blocks=("MiniMaxM2SparseMoeBlock",),
        router={
            "form": "sigmoid_bias_topk",
            "code": "MiniMaxM2TopKRouter: scores = sigmoid(x @ W.T) (float32); top-k of scores + "
            "e_score_correction_bias (the block's buffer, selection only); weights = scores at "
            "those experts / their sum (no epsilon, no scaling)",
            "renormalised": True,
            "shared_expert": None,
            "note": "q/k RMSNorm over the whole projection (MiniMaxM2Attention q_norm, k_norm)",
        },
        expected_layer=lambda c: _moe_topk(c.num_experts_per_tok),
    ),
    Family(
        name="afmoe",
        config_class="AfmoeConfig",
        model_class="AfmoeForCausalLM",
        config={
            "intermediate_size": DENSE_INTERMEDIATE,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "num_dense_layers": 1,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "num_shared_experts": 1,
            "route_scale": 2.5,
            "head_dim": 32,
            "global_attn_every_n_layers": 2,  # layer 0 sliding, layer 1 full
            "sliding_window": 4,
        },
        moe_blocks=("AfmoeSparseMoeBlock",),
        router={
            "form": "sigmoid_bias_topk",
            "code": "AfmoeTokenChoiceRouter: scores = sigmoid(x @ W.T) (float32); top-k (sorted) of "
            "scores + expert_bias (selection only); weights = scores at those experts / (their "
            "sum + 1e-20) * route_scale; plus an ungated shared expert (AfmoeMLP), added",
            "renormalised": True,
            "shared_expert": "ungated (AfmoeMLP, num_shared_experts * moe_intermediate_size)",
            "note": "gated attention (sigmoid gate on the attention output), q/k norms, "
            "RMSNorm before and after both attention and MLP",
        },
        expected_layer=lambda c: _moe_topk(c.num_experts_per_tok),
    ),
    Family(
        name="lfm2_moe",
        config_class="Lfm2MoeConfig",
        model_class="Lfm2MoeForCausalLM",
        config={
            "intermediate_size": DENSE_INTERMEDIATE,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "num_dense_layers": 1,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "use_expert_bias": True,  # LFM2-8B-A1B: expert bias, renormalised, scaling 1.0
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            # Layer 0: short convolution + dense MLP; layer 1: attention + MoE.
            "layer_types": ["conv", "full_attention"],
        },
        moe_blocks=("Lfm2MoeSparseMoeBlock",),
        router={
            "form": "sigmoid_bias_topk",
            "code": "Lfm2MoeTopKRouter: scores = sigmoid(x @ W.T) (in the model dtype); top-k of "
            "scores + expert_bias (use_expert_bias, selection only); weights = scores at those "
            "experts / (their sum + 1e-6) (norm_topk_prob=True) * routed_scaling_factor",
            "renormalised": True,
            "shared_expert": None,
            "note": "layer 0 a gated short convolution (Conv1d, kernel conv_L_cache=3)",
        },
        expected_layer=lambda c: _moe_topk(c.num_experts_per_tok),
    ),
    Family(
        name="ernie4_5_moe",
        config_class="Ernie4_5_MoeConfig",
        model_class="Ernie4_5_MoeForCausalLM",
        config={
            "intermediate_size": DENSE_INTERMEDIATE,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "moe_num_experts": 8,  # num_experts
            "moe_k": 2,  # num_experts_per_tok
            "moe_num_shared_experts": 2,  # ERNIE-4.5-21B-A3B: 2 shared, MoE from layer 1
            "moe_layer_start_index": 1,
            "moe_norm_min": 1e-12,
        },
        moe_blocks=("Ernie4_5_MoeSparseMoeBlock",),
        router={
            "form": "softmax_bias_topk",
            "code": "Ernie4_5_MoeTopKRouter: probs = softmax(x @ W.T) (float32); top-k of probs + "
            "moe_statics.e_score_correction_bias (selection only); weights = probs at those "
            "experts / clamp(their sum, min=moe_norm_min); plus an ungated shared expert "
            "(Ernie4_5_MoeMLP), added",
            "renormalised": True,
            "shared_expert": "ungated (Ernie4_5_MoeMLP, moe_num_shared_experts * "
            "moe_intermediate_size)",
        },
        expected_layer=lambda c: _moe_topk(c.num_experts_per_tok),
    ),
    Family(
        name="deepseek_v2",
        config_class="DeepseekV2Config",
        model_class="DeepseekV2ForCausalLM",
        config={
            "intermediate_size": DENSE_INTERMEDIATE,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            # DeepSeek-V2's config.json: group-limited greedy (8 groups, top 3), scaling 16.
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 16.0,
            "first_k_dense_replace": 1,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "num_key_value_heads": HEADS,
        },
        moe_blocks=("DeepseekV2Moe",),
        router={
            "form": "softmax_group_topk",
            "code": "DeepseekV2TopkRouter (topk_method='group_limited_greedy'): probs = "
            "softmax(x @ W.T) (float32); group score = max prob per group, top topk_group groups "
            "kept, the others' probs set to 0; top-k of those probs; weights = the k probs * "
            "routed_scaling_factor (not renormalised: the router ignores norm_topk_prob); "
            + _SHARED_UNGATED.format(what="an"),
            "renormalised": False,
            "shared_expert": "ungated (DeepseekV2MLP, n_shared_experts * moe_intermediate_size)",
        },
        expected_layer=lambda c: _moe_topk(c.num_experts_per_tok),
        export_patch="deepseek_v2_real_rotary",
    ),
    Family(
        name="deepseek_v2_greedy",
        config_class="DeepseekV2Config",
        model_class="DeepseekV2ForCausalLM",
        config={
            "intermediate_size": DENSE_INTERMEDIATE,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            # DeepSeek-V2-Lite's config.json: greedy top-k, scaling 1.0, no q LoRA.
            "topk_method": "greedy",
            "routed_scaling_factor": 1.0,
            "first_k_dense_replace": 1,
            "q_lora_rank": None,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "num_key_value_heads": HEADS,
        },
        moe_blocks=("DeepseekV2Moe",),
        router={
            "form": "softmax_topk_scaled",
            "code": "DeepseekV2TopkRouter (topk_method='greedy'): probs = softmax(x @ W.T) "
            "(float32); top-k of probs; weights = the k probs * routed_scaling_factor (not "
            "renormalised: the router ignores norm_topk_prob); "
            + _SHARED_UNGATED.format(what="an"),
            "renormalised": False,
            "shared_expert": "ungated (DeepseekV2MLP, n_shared_experts * moe_intermediate_size)",
            "note": "routed_scaling_factor 1.0: torch.onnx folds the multiplication away, so the "
            "export's router is softmax top-k, not renormalised (as Qwen2-MoE's)",
        },
        expected_layer=lambda c: _moe_topk(c.num_experts_per_tok),
        export_patch="deepseek_v2_real_rotary",
    ),
]

BY_NAME = {f.name: f for f in FAMILIES}


def make_config(family: Family, impl: str | None) -> Any:
    """The family's tiny config, experts implementation ``impl`` (None: the class default)."""
    import transformers

    cls = getattr(transformers, family.config_class)
    kwargs = {**_COMMON, **family.config}
    if impl is not None and family.dispatches_experts:
        kwargs["experts_implementation"] = impl
    return cls(**kwargs)
