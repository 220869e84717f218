"""The transformers MoE families exported whole by ``export_causal_lm.py``: configs and facts.

For each family: a tiny config made in code (hidden 64, 2 layers, 2 heads, vocab 128, 4-8
experts, top-k 2, expert intermediate 16 so that no expert weight is square), the
``*ForCausalLM`` class, and what its MoE layers compute, read from the installed transformers'
modeling code (``transformers/models/<family>/modeling_<family>.py``, version in each record).
``router`` records the routing form found there; ``expected_layer`` says what a correct fuser
must do with one MoE layer of that family in float32 (``MoE`` or refused, and what the refusal
must name). Kept apart from the export machinery so the facts can be read in one sitting.

The shared pieces (sizes, the Family type, record helpers) are in ``export_causal_lm_base.py``;
the routers of any top-k form in ``export_causal_lm_router_families.py``.
"""

from __future__ import annotations

from export_causal_lm_base import (  # noqa: F401 - re-exported for export_causal_lm.py
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
from export_causal_lm_router_families import ROUTER_FAMILIES

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
        # Two top-1 rounds, the second with the first choice at -inf: the columns of one
        # TopK(logits, 2), with per-selected non-negative (masked-softmax) weights.
        expected_layer=lambda c: _moe_topk(c.num_experts_per_tok),
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
            "num_experts_per_tok": 1,  # Llama 4 Scout and Maverick route top-1
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
        # top-1 (Llama 4 Scout and Maverick): the experts read the tokens scaled by their
        # score, weight 1 (docs/routing.md); k > 1 is not expressible
        expected_layer=lambda c: _moe(1, True),
        export_patch="llama4_real_rotary",
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
    Family(
        name="jetmoe",
        config_class="JetMoeConfig",
        model_class="JetMoeForCausalLM",
        config={
            "intermediate_size": EXPERT_INTERMEDIATE,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "kv_channels": 32,  # head_dim; attention heads = num_key_value_heads * top-k
        },
        moe_blocks=("JetMoeMoE",),
        router={
            "form": "topk_softmax",
            "code": "JetMoeTopKGating: "
            + _TOPK_SOFTMAX.format(bias=" (no bias)")
            + "; tokens sorted by expert (sort of the flat top-k ids, batch_index = order // k), "
            "expert_size = per-expert counts (.tolist()); JetMoeParallelExperts: inputs split by "
            "expert_size, F.linear per expert ([E, out, in] weights), concatenated; input_linear "
            "[E, 2I, H] chunked (first half gate): silu(gate) * up; output_linear [E, H, I]; "
            "rows times their gates, index_add into the tokens; plus a [H] bias after the sum",
            "renormalised": True,
            "shared_expert": None,
            "note": "attention is JetMoeMoA, a mixture of attention experts routed by its own "
            "JetMoeTopKGating (per-slot query and output projections): not an MLP MoE layer, so "
            "no fused op; the [H] bias after the MoE sum stays outside the fused node (the "
            "weights sum to 1)",
        },
        expected_layer=lambda c: _moe(c.num_experts_per_tok, True),
        dispatches_experts=False,
        experts_tag="parallel_experts",
        experts_note="n/a (JetMoeParallelExperts does not dispatch: split by expert_size, "
        "F.linear per expert, concatenated)",
        attention_experts=True,
    ),
    *ROUTER_FAMILIES,
]

BY_NAME = {f.name: f for f in FAMILIES}
