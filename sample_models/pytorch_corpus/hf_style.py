"""Corpus layers after transformers' modeling files (the eager blocks, written out here).

transformers 5.x routes most of these through shared experts implementations; the classes
below are the eager forms the modeling files had (4.4x-4.5x) or keep as their eager branch.
Loops run over ``range(num_experts)``: upstream's ``expert_hit`` (``nonzero`` of the hit
experts) makes the TorchScript trace drop unhit experts and stops torch.export.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import E, H, HFSwiGLUMLP, I, K, Layer

HIT = "loops over range(num_experts), not over the `expert_hit` nonzero of upstream"


class MixtralBlockSparseTop2MLP(nn.Module):
    """transformers ``models/mixtral/modeling_mixtral.py`` (4.4x), ``MixtralBlockSparseTop2MLP``."""

    def __init__(self, inter: int = I) -> None:
        super().__init__()
        self.w1 = nn.Linear(H, inter, bias=False)
        self.w2 = nn.Linear(inter, H, bias=False)
        self.w3 = nn.Linear(H, inter, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(hidden_states)) * self.w3(hidden_states))


class MixtralSparseMoeBlock(nn.Module):
    """transformers ``models/mixtral/modeling_mixtral.py`` (4.4x), ``MixtralSparseMoeBlock``.

    Softmax, TopK, optional renormalisation, ``one_hot`` expert mask permuted to ``[E, k, T]``,
    ``torch.where`` per expert and ``index_add_`` of the weighted rows. ``norm`` False is
    OLMoE's / Qwen2-MoE's ``norm_topk_prob=False``.
    """

    def __init__(self, experts: int = E, k: int = K, norm: bool = True) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm = experts, k, norm
        self.gate = nn.Linear(H, experts, bias=False)
        self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP() for _ in range(experts)])

    def routed(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, H)
            current = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current.to(hidden_states.dtype))
        return final_hidden_states

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        flat = hidden_states.view(-1, hidden_dim)
        return self.routed(flat).reshape(batch_size, sequence_length, hidden_dim)


class Qwen2MoeSparseMoeBlock(MixtralSparseMoeBlock):
    """transformers ``models/qwen2_moe/modeling_qwen2_moe.py`` (4.4x), ``Qwen2MoeSparseMoeBlock``.

    The Mixtral loop with ``norm_topk_prob=False`` plus a shared expert gated by
    ``sigmoid(shared_expert_gate(x))``, added to the routed sum (a value of its own).
    """

    def __init__(self) -> None:
        super().__init__(norm=False)
        self.shared_expert = HFSwiGLUMLP(H, 2 * I)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        flat = hidden_states.view(-1, h)
        final_hidden_states = self.routed(flat)
        shared = self.shared_expert(flat)
        shared = F.sigmoid(self.shared_expert_gate(flat)) * shared
        return (final_hidden_states + shared).reshape(b, s, h)


class ArcticMoE(MixtralSparseMoeBlock):
    """Snowflake arctic ``modeling_arctic.py`` (HF remote code), ``ArcticMoE`` + residual MLP.

    Arctic's decoder layer runs a dense MLP in parallel with the MoE (``parallel_attn_mlp_res``):
    the layer output is ``moe(x) + residual_mlp(x)``; the MoE itself is the Mixtral loop.
    """

    def __init__(self) -> None:
        super().__init__()
        self.residual_mlp = HFSwiGLUMLP(H, 2 * I)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states) + self.residual_mlp(hidden_states)


class StackedExperts(nn.Module):
    """transformers 5.x ``*Experts`` (3-D ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``).

    The eager forward (``one_hot`` mask, ``torch.where``, ``F.linear`` of the expert slices,
    ``chunk(2)`` halves, ``index_add_``), as HunYuan-MoE-V1 and ERNIE-4.5-MoE have it.
    """

    def __init__(self, experts: int = E) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(experts, H, I))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current = F.silu(gate) * up
            current = F.linear(current, self.down_proj[expert_idx])
            current = current * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
        return final_hidden_states


class HunYuanMoEV1Moe(nn.Module):
    """transformers ``models/hunyuan_v1_moe/modeling_hunyuan_v1_moe.py``, ``HunYuanMoEV1Moe``.

    ``HunYuanMoEV1Gate`` (softmax, TopK, renormalise) + stacked experts + the shared MLP
    computed first and added last.
    """

    def __init__(self) -> None:
        super().__init__()
        self.wg = nn.Linear(H, E, bias=False)
        self.experts = StackedExperts()
        self.shared_mlp = HFSwiGLUMLP(H, I)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        hidden_states_mlp = self.shared_mlp(hidden_states)
        flat = hidden_states.view(-1, h)
        router_logits = self.wg(flat.float())
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, K, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        out = self.experts(flat, selected_experts, routing_weights.to(router_logits.dtype))
        return out.reshape(b, s, h) + hidden_states_mlp


class Ernie45MoeSparseMoeBlock(nn.Module):
    """transformers ``models/ernie4_5_moe/modeling_ernie4_5_moe.py``, ``Ernie4_5_MoeSparseMoeBlock``.

    ``Ernie4_5_MoeTopKRouter``: softmax, TopK of the scores plus ``e_score_correction_bias``
    (selection only), weights gathered from the unbiased scores and divided by
    ``clamp(sum, min=moe_norm_min)``; shared experts added.
    """

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, H))
        self.e_score_correction_bias = nn.Parameter(torch.empty(1, E), requires_grad=False)
        self.norm_min = 1e-12
        self.experts = StackedExperts()
        self.shared_experts = HFSwiGLUMLP(H, I)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        flat = hidden_states.view(-1, h)
        shared_output = self.shared_experts(flat)
        router_logits = F.linear(flat.float(), self.weight.float())
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        biased = routing_weights + self.e_score_correction_bias.squeeze()
        _, selected_experts = torch.topk(biased, K, dim=-1)
        routing_weights = torch.gather(routing_weights, dim=-1, index=selected_experts)
        routing_weights = routing_weights / torch.clamp(
            routing_weights.sum(dim=-1, keepdim=True), min=self.norm_min
        )
        out = self.experts(flat, selected_experts, routing_weights) + shared_output
        return out.reshape(b, s, h)


class DbrxFFN(nn.Module):
    """transformers ``models/dbrx/modeling_dbrx.py``, ``DbrxFFN`` + ``DbrxExperts`` + ``DbrxExpertGLU``.

    Softmax, TopK, weights divided by their p-norm (``moe_normalize_expert_weights=1``: L1);
    the experts' ``w1``/``v1``/``w2`` are ``[E*I, H]`` matrices viewed as ``[E, I, H]``; a
    ``one_hot`` mask of ``E + 1`` classes as upstream.
    """

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E * I, H))
        self.v1 = nn.Parameter(torch.empty(E * I, H))
        self.w2 = nn.Parameter(torch.empty(E * I, H))
        self.moe_normalize_expert_weights = 1.0

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size = hidden_states.shape[0]
        flat = hidden_states.view(-1, H)
        router_logits = torch.softmax(self.layer(flat), dim=1, dtype=flat.dtype)
        top_w, top_i = torch.topk(router_logits, K, dim=-1)
        top_w = top_w / torch.norm(top_w, p=self.moe_normalize_expert_weights, dim=-1, keepdim=True)
        next_states = torch.zeros_like(flat)
        expert_mask = F.one_hot(top_i, num_classes=E + 1).permute(2, 1, 0)
        split = (-1, I, H)
        for expert_idx in range(E):
            idx, token_idx = torch.where(expert_mask[expert_idx])
            v1 = self.v1.view(split)[expert_idx]
            w1 = self.w1.view(split)[expert_idx]
            w2 = self.w2.view(split)[expert_idx]
            x = flat[token_idx]
            states = (F.silu(x.matmul(w1.T)) * x.matmul(v1.T)).matmul(w2)
            states = states.view(-1, H) * top_w[token_idx, idx, None]
            next_states.index_add_(0, token_idx, states)
        return next_states.view(batch_size, -1, H)


class GptOssExpertsDense(nn.Module):
    """transformers ``models/gpt_oss/modeling_gpt_oss.py`` (4.55), ``GptOssMLP`` + ``GptOssExperts``.

    ``GptOssTopKRouter``: TopK of the biased logits, softmax over the k values scattered into a
    ``[T, E]`` zeros tensor; ``GptOssExperts`` at inference: every expert on every token by
    ``bmm`` over ``hidden_states.repeat(E, 1)``, interleaved clamped SwiGLU, the outputs times
    the transposed router scores summed over the experts.
    """

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E)
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, H))
        self.down_proj_bias = nn.Parameter(torch.empty(E, H))
        self.alpha, self.limit = 1.702, 7.0

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size = hidden_states.shape[0]
        flat = hidden_states.reshape(-1, H)
        router_logits = self.router(flat)
        router_top_value, router_indices = torch.topk(router_logits, K, dim=-1)
        router_top_value = F.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)
        routing_weights = torch.zeros_like(router_logits).scatter_(
            1, router_indices, router_top_value
        )
        h = flat.repeat(E, 1).view(E, -1, H)
        gate_up = torch.bmm(h, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        next_states = torch.bmm(((up + 1) * glu), self.down_proj)
        next_states = next_states + self.down_proj_bias[..., None, :]
        next_states = next_states.view(E, batch_size, -1, H)
        next_states = (
            next_states * routing_weights.transpose(0, 1).view(E, batch_size, -1)[..., None]
        )
        return next_states.sum(dim=0)


LAYERS = [
    Layer(
        "hf_mixtral_eager",
        MixtralSparseMoeBlock,
        "huggingface/transformers: src/transformers/models/mixtral/modeling_mixtral.py",
        "MixtralSparseMoeBlock (4.4x eager: one_hot mask, torch.where, index_add_)",
        True,
        "Softmax -> TopK -> renormalise, SwiGLU: MoE k=2, normalize 1",
        K,
        adaptations=(HIT,),
    ),
    Layer(
        "hf_olmoe_eager",
        lambda: MixtralSparseMoeBlock(experts=6, k=3, norm=False),
        "huggingface/transformers: src/transformers/models/olmoe/modeling_olmoe.py",
        "OlmoeSparseMoeBlock (norm_topk_prob=False)",
        True,
        "Softmax -> TopK, weights as they are: MoE k=3, normalize 0",
        3,
        experts=6,
        adaptations=(HIT,),
    ),
    Layer(
        "hf_qwen2_moe_eager",
        Qwen2MoeSparseMoeBlock,
        "huggingface/transformers: src/transformers/models/qwen2_moe/modeling_qwen2_moe.py",
        "Qwen2MoeSparseMoeBlock (norm_topk_prob=False, sigmoid-gated shared expert)",
        True,
        "Softmax -> TopK, weights as they are: MoE k=2, normalize 0; the gated shared expert "
        "is added to the routed sum outside the node",
        K,
        adaptations=(HIT,),
    ),
    Layer(
        "arctic_moe",
        ArcticMoE,
        "Snowflake-Labs/snowflake-arctic: modeling_arctic.py (HF remote code)",
        "ArcticMoE + the decoder layer's parallel residual MLP",
        True,
        "the Mixtral routing (renormalised top-2): MoE; the dense residual MLP stays",
        K,
        adaptations=(
            HIT,
            "the decoder's norms and attention are left out; the residual MLP "
            "reads the same input as the MoE",
        ),
    ),
    Layer(
        "hf_hunyuan_v1_moe",
        HunYuanMoEV1Moe,
        "huggingface/transformers: src/transformers/models/hunyuan_v1_moe/modeling_hunyuan_v1_moe.py",
        "HunYuanMoEV1Moe + HunYuanMoEV1Gate + HunYuanMoEV1Experts (eager)",
        True,
        "Softmax -> TopK -> renormalise, SwiGLU from gate_up_proj halves: MoE; shared MLP outside",
        K,
        adaptations=(HIT,),
    ),
    Layer(
        "hf_ernie4_5_moe",
        Ernie45MoeSparseMoeBlock,
        "huggingface/transformers: src/transformers/models/ernie4_5_moe/modeling_ernie4_5_moe.py",
        "Ernie4_5_MoeSparseMoeBlock + Ernie4_5_MoeTopKRouter (+ moe_statics) + experts (eager)",
        True,
        "softmax scores, biased selection, gathered unbiased weights over a clamped sum (the "
        "clamp at 1e-12 never binds: k softmax values sum to >= k/E): MoE via the selection "
        "construction; shared experts outside",
        K,
        adaptations=(HIT,),
    ),
    Layer(
        "hf_dbrx_ffn",
        DbrxFFN,
        "huggingface/transformers: src/transformers/models/dbrx/modeling_dbrx.py",
        "DbrxFFN + DbrxRouter + DbrxExperts + DbrxExpertGLU",
        True,
        "Softmax -> TopK -> divide by the L1 norm (= the sum, weights positive): MoE k=2, "
        "normalize 1",
        K,
        adaptations=(HIT,),
    ),
    Layer(
        "hf_gpt_oss_dense_experts",
        GptOssExpertsDense,
        "huggingface/transformers: src/transformers/models/gpt_oss/modeling_gpt_oss.py",
        "GptOssMLP + GptOssTopKRouter + GptOssExperts (4.55 inference branch: every expert, bmm)",
        True,
        "TopK(logits) -> Softmax over k scattered into [T, E] zeros; every expert weighed by "
        "its score (0 where unselected): MoE swiglu_fusion=1, alpha 1.702, beta 1, limit 7, biases",
        K,
    ),
]
