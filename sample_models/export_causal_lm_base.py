"""What every tiny ``*ForCausalLM`` family record shares: sizes, the Family type, record helpers.

Used by ``export_causal_lm_families.py`` (softmax top-k and other fixed routers) and
``export_causal_lm_router_families.py`` (routers of any top-k form); ``make_config`` builds a
family's tiny transformers config.
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
    # For a family whose experts do not dispatch: the file-name tag of its own experts form and
    # what the record says of it (Llama4: dense bmm over all experts; JetMoE: ParallelExperts).
    experts_tag: str = "dense_bmm"
    experts_note: str = "n/a (the experts class does not dispatch: dense bmm over all experts)"
    # Decoder layers whose attention is itself a mixture of experts (JetMoE's MoA): each has a
    # TopK of its own that no fused op takes; the record lists them as refused.
    attention_experts: bool = False


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


def _grouped_config(
    shared: int,
    *,
    experts_key: str = "n_routed_experts",
    shared_key: str = "n_shared_experts",
    **more: Any,
) -> dict[str, Any]:
    """A DeepSeek-V3-style MoE config: 8 experts, top-2, one group, scaling 2.5, layer 0 dense."""
    return {
        "intermediate_size": DENSE_INTERMEDIATE,
        "moe_intermediate_size": EXPERT_INTERMEDIATE,
        experts_key: 8,
        "num_experts_per_tok": 2,
        shared_key: shared,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,  # layer 0 dense MLP, layer 1 MoE
        **more,
    }  # fmt: skip


def _grouped_router(cls: str, shared: str, shared_expert: str, note: str) -> dict[str, Any]:
    """The router record of a family using DeepSeek-V3's TopkRouter code under its own name."""
    return {
        "form": "sigmoid_bias_group_topk",
        "code": _SIGMOID_GROUP_TOPK.format(cls=cls, renorm=_GROUP_RENORM)
        + "; "
        + _SHARED_UNGATED.format(what=shared),
        "renormalised": True,
        "shared_expert": shared_expert,
        "note": note,
    }


def make_config(family: Family, impl: str | None) -> Any:
    """The family's tiny config, experts implementation ``impl`` (None: the class default)."""
    import transformers

    cls = getattr(transformers, family.config_class)
    kwargs = {**_COMMON, **family.config}
    if impl is not None and family.dispatches_experts:
        kwargs["experts_implementation"] = impl
    return cls(**kwargs)
