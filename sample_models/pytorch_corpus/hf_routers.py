"""Corpus layers after transformers' modeling files with their own routers and expert layouts.

DeepSeek-V2's grouped gate, JetMoE / Granite's ``ParallelExperts``, PhiMoE's sparse mixer,
Llama 4's input-scaled top-1, and Switch Transformers' top-1 (with and without its capacity).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import E, H, HFSwiGLUMLP, I, K, Layer
from .hf_style import HIT, MixtralBlockSparseTop2MLP


class DeepseekV2MoE(nn.Module):
    """deepseek-ai/DeepSeek-V2 ``modeling_deepseek.py`` (HF remote code), ``MoEGate`` + ``DeepseekV2MoE``.

    ``MoEGate``: softmax scores, ``group_limited_greedy`` (best score per group, TopK of the
    groups, the other groups' scores set to 0), TopK (unsorted), no renormalisation
    (``norm_topk_prob=False``), ``routed_scaling_factor``. The experts in the module's own
    ``training`` branch: tokens ``repeat_interleave``d k times, ``y[flat_topk_idx == i] =
    expert(x[flat_topk_idx == i])``, ``(y.view(T, k, H) * w.unsqueeze(-1)).sum(1)``; plus shared
    experts.
    """

    def __init__(self, experts: int = 6, groups: int = 3, topk_group: int = 2) -> None:
        super().__init__()
        self.n_routed_experts, self.n_group, self.topk_group = experts, groups, topk_group
        self.top_k, self.routed_scaling_factor = K, 1.5
        self.weight = nn.Parameter(torch.empty(experts, H))
        self.experts = nn.ModuleList([HFSwiGLUMLP() for _ in range(experts)])
        self.shared_experts = HFSwiGLUMLP(H, 2 * I)

    def gate(self, hidden_states: torch.Tensor):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states, self.weight, None)
        scores = logits.softmax(dim=-1)
        group_scores = scores.view(bsz * seq_len, self.n_group, -1).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(bsz * seq_len, self.n_group, self.n_routed_experts // self.n_group)
            .reshape(bsz * seq_len, -1)
        )
        tmp_scores = scores.masked_fill(~score_mask.bool(), 0.0)
        topk_weight, topk_idx = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=False)
        return topk_idx, topk_weight * self.routed_scaling_factor

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        hidden_states = hidden_states.repeat_interleave(self.top_k, dim=0)
        y = torch.empty_like(hidden_states)
        for i, expert in enumerate(self.experts):
            y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])
        y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
        y = y.view(*orig_shape)
        return y + self.shared_experts(identity)


class ParallelExperts(nn.Module):
    """transformers ``models/jetmoe/modeling_jetmoe.py``, ``JetMoeParallelExperts``.

    ``[E, out, in]`` weights; the expert-sorted rows split by ``expert_size`` (a host list)
    and one ``F.linear`` per expert.
    """

    def __init__(self, num_experts: int, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, output_size, input_size))
        self.num_experts = num_experts

    def forward(self, inputs, expert_size):
        input_list = inputs.split(expert_size, dim=0)
        output_list = [F.linear(input_list[i], self.weight[i]) for i in range(self.num_experts)]
        return torch.cat(output_list, dim=0)


class JetMoeMoE(nn.Module):
    """transformers ``models/jetmoe/modeling_jetmoe.py``, ``JetMoeMoE`` + ``JetMoeTopKGating``.

    TopK of the logits, softmax over the k values, the (token, slot) pairs sorted by expert,
    ``expert_size`` from a scatter of ones (``.tolist()``), ``ParallelExperts`` for FC1 (gate
    and linear halves by ``chunk(2)``) and FC2, ``zeros.index_add`` by ``batch_index``, the
    output bias. ``bias`` False is Granite-MoE's ``GraniteMoeMoE`` (same gating and experts).
    """

    def __init__(self, bias: bool = True, k: int = K) -> None:
        super().__init__()
        self.top_k = k
        self.bias = nn.Parameter(torch.empty(H)) if bias else None
        self.input_linear = ParallelExperts(E, H, I * 2)
        self.output_linear = ParallelExperts(E, I, H)
        self.layer = nn.Linear(H, E, bias=False)

    def router(self, hidden_states: torch.Tensor):
        logits = self.layer(hidden_states).float()
        top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
        top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
        zeros = torch.zeros([top_k_gates.size(0), E], dtype=top_k_gates.dtype)
        gates = zeros.scatter(1, top_k_indices, 1)
        expert_size = gates.long().sum(0).tolist()
        top_k_experts = top_k_indices.flatten()
        _, index_sorted_experts = top_k_experts.sort(0)
        batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
        batch_gates = top_k_gates.flatten()[index_sorted_experts]
        return batch_index, batch_gates, expert_size

    def forward(self, layer_input: torch.Tensor) -> torch.Tensor:
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        batch_index, batch_gates, expert_size = self.router(layer_input)
        expert_inputs = layer_input[batch_index]
        hidden_states = self.input_linear(expert_inputs, expert_size)
        chunked = hidden_states.chunk(2, dim=-1)
        hidden_states = F.silu(chunked[0]) * chunked[1]
        expert_outputs = self.output_linear(hidden_states, expert_size)
        expert_outputs = expert_outputs * batch_gates[:, None]
        zeros = torch.zeros((bsz * length, emb_size), dtype=expert_outputs.dtype)
        layer_output = zeros.index_add(0, batch_index, expert_outputs).view(bsz, length, emb_size)
        return layer_output + self.bias if self.bias is not None else layer_output


def sparsemixer_eval(scores: torch.Tensor, jitter_eps: float):
    """transformers ``models/phimoe/modeling_phimoe.py``, ``sparsemixer`` (``training=False``)."""
    mask_logits_threshold, max_ind = scores.max(dim=-1, keepdim=True)
    factor = scores.abs().clamp(min=mask_logits_threshold)
    mask_logits_threshold = ((mask_logits_threshold - scores) / factor) > (2 * jitter_eps)
    masked_gates = scores.masked_fill(mask_logits_threshold, float("-inf"))
    selected_experts = max_ind
    masked_gates = torch.softmax(masked_gates, dim=-1)
    multiplier_o = masked_gates.gather(dim=-1, index=selected_experts)
    masked_scores = torch.scatter(scores, -1, selected_experts, float("-inf"))
    mask_logits_threshold, max_ind = masked_scores.max(dim=-1, keepdim=True)
    factor = scores.abs().clamp(min=mask_logits_threshold)
    mask_logits_threshold = ((mask_logits_threshold - scores) / factor) > (2 * jitter_eps)
    masked_gates_top2 = masked_scores.masked_fill(mask_logits_threshold, float("-inf"))
    selected_experts_top2 = max_ind
    masked_gates_top2 = torch.softmax(masked_gates_top2, dim=-1)
    multiplier_top2_o = masked_gates_top2.gather(dim=-1, index=selected_experts_top2)
    multiplier = torch.concat((multiplier_o, multiplier_top2_o), dim=-1)
    selected_experts = torch.concat((selected_experts, selected_experts_top2), dim=-1)
    return multiplier, selected_experts


class PhimoeSparseMoeBlock(nn.Module):
    """transformers ``models/phimoe/modeling_phimoe.py`` (4.4x), ``PhimoeSparseMoeBlock``.

    ``sparsemixer`` routing (two argmax rounds, each weight a softmax masked around its round's
    maximum), then the Mixtral ``one_hot`` / ``index_add_`` loop.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP() for _ in range(E)])
        self.router_jitter_noise = 0.01

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        flat = hidden_states.view(-1, h)
        router_logits = self.gate(flat)
        routing_weights, selected_experts = sparsemixer_eval(
            router_logits, self.router_jitter_noise
        )
        final = torch.zeros_like(flat)
        expert_mask = F.one_hot(selected_experts, num_classes=E).permute(2, 1, 0)
        for expert_idx in range(E):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current = self.experts[expert_idx](flat[None, top_x].reshape(-1, h))
            final.index_add_(0, top_x, current * routing_weights[top_x, idx, None])
        return final.reshape(b, s, h)


class Llama4TextMoe(nn.Module):
    """transformers ``models/llama4/modeling_llama4.py``, ``Llama4TextMoe`` + ``Llama4TextExperts``.

    TopK(1) of the router logits scattered into ``-inf``, sigmoid, every expert on every token
    with its input rows scaled by the score (``hidden_states.repeat(E, 1) * scores``), ``bmm``
    with ``gate_up_proj [E, H, 2I]`` halves, summed over the experts, plus the shared expert.
    """

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, H))
        self.shared_expert = HFSwiGLUMLP(H, I)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, H)
        router_logits = self.router(hidden_states)
        router_top_value, router_indices = torch.topk(router_logits, 1, dim=1)
        router_scores = (
            torch.full_like(router_logits, float("-inf"))
            .scatter_(1, router_indices, router_top_value)
            .transpose(0, 1)
        )
        router_scores = torch.sigmoid(router_scores.float()).to(hidden_states.dtype)
        routed_in = hidden_states.repeat(E, 1) * router_scores.reshape(-1, 1)
        routed_in = routed_in.view(E, -1, H)
        gate_up = torch.bmm(routed_in, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        routed_out = torch.bmm(up * F.silu(gate), self.down_proj).view(-1, H)
        out = self.shared_expert(hidden_states)
        out.add_(routed_out.reshape(E, -1, H).sum(dim=0))
        return out.reshape(shape)


class DenseReluDense(nn.Module):
    """transformers ``models/switch_transformers/modeling_switch_transformers.py``, ``SwitchTransformersDenseActDense``."""

    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(H, 2 * I, bias=False)
        self.wo = nn.Linear(2 * I, H, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.wo(F.relu(self.wi(hidden_states)))


class SwitchSparseMLP(nn.Module):
    """transformers ``models/switch_transformers/modeling_switch_transformers.py`` (4.4x).

    ``SwitchTransformersTop1Router``: softmax, argmax, one-hot; with ``capacity`` the upstream
    ``cumsum`` over the sequence and ``<= expert_capacity`` mask drops the tokens past an
    expert's capacity; the weight is the max probability. ``SwitchTransformersSparseMLP``:
    ``next_states[token_indices] = expert(hidden_states[token_indices])`` per expert (a dropped
    token keeps its input row, as upstream's ``next_states = hidden_states.clone()``), then
    ``router_probs * next_states``.
    """

    def __init__(self, capacity: int | None) -> None:
        super().__init__()
        self.classifier = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([DenseReluDense() for _ in range(E)])
        self.expert_capacity = capacity

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.classifier(hidden_states)
        router_probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        expert_index = torch.argmax(router_probs, dim=-1)
        expert_index = F.one_hot(expert_index, num_classes=E)
        if self.expert_capacity is not None:
            token_priority = torch.cumsum(expert_index, dim=-2)
            expert_index = expert_index * (token_priority <= self.expert_capacity)
        router_probs = torch.max(router_probs, dim=-1).values.unsqueeze(-1)
        router_mask = expert_index.bool()
        next_states = hidden_states.clone()
        for idx, expert in enumerate(self.experts):
            token_indices = router_mask[:, :, idx]
            next_states[token_indices] = expert(hidden_states[token_indices]).to(next_states.dtype)
        return router_probs * next_states


LAYERS = [
    Layer(
        "deepseek_v2_moe",
        DeepseekV2MoE,
        "deepseek-ai/DeepSeek-V2: modeling_deepseek.py (HF remote code, transformers' deepseek_v2 port)",
        "MoEGate (group_limited_greedy) + DeepseekV2MoE (the repeat_interleave branch) + shared experts",
        True,
        "softmax scores, group-limited top-2, weights x1.5 (not renormalised): any non-negative "
        "per-selected weights, MoE via the selection construction; shared experts outside",
        K,
        experts=6,
        adaptations=(
            "the expert computation is the module's training branch (repeat_interleave, boolean "
            "mask, view(T, k, H).sum(1)); its inference branch moe_infer goes through numpy on "
            "the host and cannot be traced; both compute the same",
        ),
    ),
    Layer(
        "jetmoe_parallel_experts",
        JetMoeMoE,
        "huggingface/transformers: src/transformers/models/jetmoe/modeling_jetmoe.py",
        "JetMoeMoE + JetMoeTopKGating + JetMoeParallelExperts",
        True,
        "TopK(logits) -> Softmax over k, SwiGLU from the chunked halves: MoE k=2, normalize 1; "
        "the output bias is an Add after the node",
        K,
    ),
    Layer(
        "granitemoe_parallel_experts",
        lambda: JetMoeMoE(bias=False, k=1),
        "huggingface/transformers: src/transformers/models/granitemoe/modeling_granitemoe.py (4.4x)",
        "GraniteMoeMoE + GraniteMoeTopKGating + GraniteMoeParallelExperts (top-1)",
        True,
        "TopK(logits, 1) -> Softmax over the one value (= 1): MoE k=1",
        1,
    ),
    Layer(
        "hf_phimoe_sparsemixer",
        PhimoeSparseMoeBlock,
        "huggingface/transformers: src/transformers/models/phimoe/modeling_phimoe.py",
        "PhimoeSparseMoeBlock + sparsemixer (training=False)",
        True,
        "two argmax rounds (the columns of TopK(logits, 2)) with non-negative masked-softmax "
        "weights: MoE via the selection construction",
        K,
        adaptations=(HIT,),
    ),
    Layer(
        "hf_llama4_text_moe_top1",
        Llama4TextMoe,
        "huggingface/transformers: src/transformers/models/llama4/modeling_llama4.py",
        "Llama4TextMoe + Llama4TextExperts (top-1, input scaled by sigmoid score)",
        True,
        "top-1 with the input row scaled by its score (every expert maps 0 to 0): MoE on the "
        "scaled tokens, weight 1; shared expert outside",
        1,
    ),
    Layer(
        "hf_switch_top1",
        lambda: SwitchSparseMLP(None),
        "huggingface/transformers: src/transformers/models/switch_transformers/modeling_switch_transformers.py",
        "SwitchTransformersSparseMLP + SwitchTransformersTop1Router without the capacity mask",
        True,
        "argmax top-1 weighted by the max softmax probability: MoE k=1 via the selection "
        "construction (ReLU experts)",
        1,
        adaptations=(
            "the router's capacity mask (cumsum <= expert_capacity) is left out: "
            "capacity >= tokens; the trap twin hf_switch_top1_capacity keeps it",
        ),
    ),
    Layer(
        "hf_switch_top1_capacity",
        lambda: SwitchSparseMLP(1),
        "huggingface/transformers: src/transformers/models/switch_transformers/modeling_switch_transformers.py",
        "SwitchTransformersTop1Router (expert_capacity=1) + SwitchTransformersSparseMLP",
        False,
        "capacity drop: a token past its expert's capacity (cumsum over the sequence > 1) is "
        "not routed and passes through as its input row times the probability",
        1,
    ),
]
