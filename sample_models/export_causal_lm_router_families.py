"""The transformers MoE families whose routers are of any top-k form (exported like the rest).

Sigmoid or softmax scores, a selection-only correction bias, group-limited top-k, routing
scaling factors, clamped renormalisation: each is a top-k selection with per-selected
non-negative weights, which the fused MoE carries exactly (the router subgraph kept, the fused
node fed its TopK indices and final weights). Part of ``export_causal_lm_families.FAMILIES``.
"""

from __future__ import annotations

from export_causal_lm_base import (  # noqa: F401
    _COMMON,
    _GROUP_RENORM,
    _SHARED_GATED,
    _SHARED_UNGATED,
    _SIGMOID_GROUP_TOPK,
    _SOFTMAX_TOPK,
    _TOPK_SOFTMAX,
    DENSE_INTERMEDIATE,
    EXPERT_INTERMEDIATE,
    HEADS,
    HIDDEN,
    LAYERS,
    VOCAB,
    Family,
    _grouped_config,
    _grouped_router,
    _moe,
    _moe_topk,
    _refused,
    _renorm,
    make_config,
)

ROUTER_FAMILIES: list[Family] = [
    # -- routers of any top-k form: sigmoid or softmax scores, a selection-only correction bias,
    # group-limited top-k, routing scaling factors, clamped renormalisation. Each is a top-k
    # selection with per-selected non-negative weights, which the fused MoE carries exactly
    # (the router subgraph kept, the fused node fed its TopK indices and final weights).
    Family(
        name="glm4_moe",
        config_class="Glm4MoeConfig",
        model_class="Glm4MoeForCausalLM",
        # GLM-4.5's config.json: one group (the group-limited top-k keeps every expert, but the
        # code still computes it), scaling 2.5, q/k norms, attention biases
        config=_grouped_config(1, use_qk_norm=True, attention_bias=True),
        moe_blocks=("Glm4MoeMoE",),
        router=_grouped_router(
            "Glm4MoeTopkRouter",
            "an",
            "ungated (Glm4MoeMLP, n_shared_experts * moe_intermediate_size)",
            "partial rotary (partial_rotary_factor 0.5, the config's default)",
        ),
        expected_layer=lambda c: _moe_topk(c.num_experts_per_tok),
    ),
    Family(
        name="dots1",
        config_class="Dots1Config",
        model_class="Dots1ForCausalLM",
        config=_grouped_config(2),  # dots.llm1: 2 shared experts, one group, scaling 2.5
        moe_blocks=("Dots1MoE",),
        router=_grouped_router(
            "Dots1TopkRouter",
            "2",
            "ungated (Dots1MLP, n_shared_experts * moe_intermediate_size)",
            "q/k RMSNorm per head (Dots1Attention q_norm, k_norm)",
        ),
        expected_layer=lambda c: _moe_topk(c.num_experts_per_tok),
    ),
    Family(
        name="exaone_moe",
        config_class="ExaoneMoeConfig",
        model_class="ExaoneMoeForCausalLM",
        config=_grouped_config(
            1,
            experts_key="num_experts",
            shared_key="num_shared_experts",
            sliding_window=4,  # layer 0 sliding, layer 1 full
            sliding_window_pattern=2,
        ),
        moe_blocks=("ExaoneMoeSparseMoEBlock",),
        router=_grouped_router(
            "ExaoneMoeTopkRouter",
            "an",
            "ungated (ExaoneMoeMLP, num_shared_experts * moe_intermediate_size)",
            "q/k RMSNorm per head; layer 0 sliding-window attention",
        ),
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
