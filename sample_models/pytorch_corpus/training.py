"""Corpus layers after training frameworks: torchtitan, torchtune, Megablocks, DeepSpeed.

These sort the (token, slot) pairs by expert and run each expert on its contiguous rows
(a host-side list of counts splits them), or dispatch through a capacity buffer by einsum.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .common import E, H, I, K, Layer

TITAN = (
    "histc reads the indices as float (CPU histc takes no int64)",
    "argsort without stable=True (neither exporter converts a stable sort; the order of an "
    "expert's rows does not change the scatter_add sums)",
)


class GroupedExperts(nn.Module):
    """pytorch/torchtitan ``torchtitan/models/deepseek_v3/model/moe.py``, ``GroupedExperts``.

    ``w1``/``w3 [E, H, I]``, ``w2 [E, I, H]``; the for-loop implementation: the expert-sorted
    rows split by the token counts, ``silu(x w1) * (x w3)`` then ``w2``; ``counts=None`` is the
    3-D ``bmm`` path (the shared expert as a 1-expert group). torchtune's ``GroupedExperts``
    (``gate_proj``/``up_proj``/``down_proj``) is the same loop.
    """

    def __init__(self, experts: int = E, inter: int = I) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, H, inter))
        self.w2 = nn.Parameter(torch.empty(experts, inter, H))
        self.w3 = nn.Parameter(torch.empty(experts, H, inter))

    def forward(self, x: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        if counts is None:
            h = F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3)
            return torch.bmm(h, self.w2)
        outs = []
        for expert_idx, x_expert in enumerate(torch.split(x, split_size_or_sections=counts, dim=0)):
            h = F.silu(torch.matmul(x_expert, self.w1[expert_idx]))
            h = h * torch.matmul(x_expert, self.w3[expert_idx])
            outs.append(torch.matmul(h, self.w2[expert_idx]))
        return torch.cat(outs, dim=0)


class TokenChoiceMoE(nn.Module):
    """torchtitan ``MoE`` + ``TokenChoiceTopKRouter`` (``scale_before`` False), or torchtune's.

    Softmax (``sigmoid`` True: sigmoid) scores, TopK of ``scores + expert_bias`` (aux-loss-free
    balancing; the weights are gathered from the unbiased scores), ``histc`` counts,
    ``argsort`` of the flat indices, ``// k`` token indices, ``gather`` of the rows, the
    grouped experts, scores times the outputs (torchtune ``scale_before_experts``: times the
    inputs), ``scatter_add`` into the shared expert's output.
    """

    def __init__(
        self,
        k: int = K,
        sigmoid: bool = False,
        scale_before: bool = False,
        bias: bool = True,
        route_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.top_k, self.use_sigmoid, self.scale_before = k, sigmoid, scale_before
        self.route_scale = route_scale
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = GroupedExperts()
        self.shared_expert = GroupedExperts(experts=1)
        self.register_buffer("expert_bias", torch.zeros(E) if bias else None)

    def router(self, x: torch.Tensor):
        scores = self.gate(x)
        if self.use_sigmoid:
            scores = torch.sigmoid(scores.to(torch.float32))
        else:
            scores = F.softmax(scores.to(torch.float32), dim=1)
        biased = scores + self.expert_bias if self.expert_bias is not None else scores
        _, selected = torch.topk(biased, k=self.top_k, dim=1)
        top_scores = scores.gather(dim=1, index=selected)
        counts = torch.histc(selected.view(-1).float(), bins=E, min=0, max=E)
        sorted_idx = torch.argsort(selected.view(-1))
        top_scores = top_scores.view(-1)[sorted_idx]
        token_indices = sorted_idx // self.top_k
        return top_scores * self.route_scale, token_indices, counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        top_scores, token_indices, counts = self.router(x.reshape(bs * slen, dim))
        token_indices = token_indices.reshape(-1, 1).expand(-1, dim)
        routed_input = torch.gather(x.view(-1, dim), dim=0, index=token_indices)
        if self.scale_before:
            routed_input = routed_input * top_scores.reshape(-1, 1)
        routed_output = self.experts(routed_input, counts.long().tolist())
        if not self.scale_before:
            routed_output = routed_output * top_scores.unsqueeze(-1)
        out = self.shared_expert(x.reshape(1, bs * slen, dim)).reshape(bs * slen, dim)
        out = out.scatter_add(dim=0, index=token_indices, src=routed_output)
        return out.reshape(bs, slen, dim)


class MegablocksDMoE(nn.Module):
    """databricks/megablocks ``megablocks/layers/dmoe.py`` (``grouped_forward_once``) + ``router.py``.

    ``LearnedRouter``: softmax, TopK, weights over their p-norm (``moe_normalize_expert_weights
    =1``). dMoE (dropless): the flat expert ids sorted (``ops.sort``), ``ops.histogram`` counts,
    ``ops.gather`` of the token rows (``indices // top_k``), the grouped MLP (``gg.ops.gmm`` with
    host ``batch_sizes``: one matmul per expert here) with Megablocks' default tanh GELU,
    ``ops.scatter``: rows times their weights, put back in (token, slot) order and summed over
    the k slots (the reference ``scatter`` of Megablocks' op tests).
    """

    def __init__(self) -> None:
        super().__init__()
        self.top_k = K
        self.layer = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, H, 2 * I))
        self.w2 = nn.Parameter(torch.empty(E, 2 * I, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, H)
        scores = self.layer(x).softmax(dim=-1)
        expert_weights, expert_indices = torch.topk(scores, self.top_k, dim=-1)
        expert_weights = expert_weights / torch.norm(expert_weights, p=1, dim=-1, keepdim=True)
        top_experts = expert_indices.flatten()
        bin_ids, indices = torch.sort(top_experts)
        tokens_per_expert = F.one_hot(top_experts, E).sum(0)
        rows = x[indices // self.top_k]
        outs = []
        for e, chunk in enumerate(torch.split(rows, tokens_per_expert.tolist(), dim=0)):
            outs.append(F.gelu(chunk @ self.w1[e], approximate="tanh") @ self.w2[e])
        y = torch.cat(outs, dim=0) * expert_weights.flatten()[indices].unsqueeze(-1)
        out = torch.zeros_like(rows)
        out[indices] = y
        return out.view(-1, self.top_k, H).sum(dim=1).view(shape)


def _capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    """DeepSpeed ``sharded_moe._capacity``: ``ceil(tokens / experts * factor)``, at least the min."""
    return max(int(math.ceil(tokens / experts * factor)), min_capacity)


def top2gating(logits: torch.Tensor, drop_tokens: bool, capacity_factor: float = 1.0):
    """microsoft/DeepSpeed ``deepspeed/moe/sharded_moe.py``, ``top2gating``.

    ``top2_2nd_expert_sampling=False`` (no Gumbel noise). ``drop_tokens=False`` sets the capacity
    to ``max(exp_counts)`` upstream, a data-dependent size; here it is ``2 * tokens``, which
    bounds every location, so the combine tensor has only extra zero columns (same result).
    """
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    indices1_s = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1)
    mask2 = F.one_hot(indices2_s, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * 2, 1)
        mask1 = mask1 * torch.lt(locations1, capacity)
        mask2 = mask2 * torch.lt(locations2, capacity)
    else:
        capacity = 2 * num_tokens
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    mask1_float, mask2_float = mask1.float(), mask2.float()
    gates1_s = torch.einsum("se,se->s", gates, mask1_float)
    gates2_s = torch.einsum("se,se->s", gates, mask2_float)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates.dtype).eps)
    gates1_s = gates1_s / denom_s
    gates2_s = gates2_s / denom_s
    gates1 = torch.einsum("s,se->se", gates1_s, mask1_float)
    gates2 = torch.einsum("s,se->se", gates2_s, mask2_float)
    locations1_sc = F.one_hot(locations1_s, num_classes=capacity).float()
    locations2_sc = F.one_hot(locations2_s, num_classes=capacity).float()
    combine1_sec = torch.einsum("se,sc->sec", gates1, locations1_sc)
    combine2_sec = torch.einsum("se,sc->sec", gates2, locations2_sc)
    combine_weights = combine1_sec + combine2_sec
    return combine_weights, combine_weights.bool()


class DeepSpeedExpert(nn.Module):
    """A DeepSpeed-MoE example expert: ``Linear -> GELU(tanh) -> Linear`` with biases."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(H, I)
        self.fc2 = nn.Linear(I, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DeepSpeedMOELayer(nn.Module):
    """microsoft/DeepSpeed ``deepspeed/moe/sharded_moe.py``, ``MOELayer`` + ``TopKGate`` (k=2, one rank).

    ``TopKGate``'s ``wg`` Linear in float32, ``top2gating``; ``einsum("sec,sm->ecm")`` dispatch
    into the ``[E, C, M]`` capacity buffer, ``Experts`` on their chunks, ``einsum("sec,ecm->sm")``
    combine. ``residual`` is DeepSpeed's ``MoE(use_residual=True)`` (PR-MoE): the MoE output and
    a dense MLP mixed per token by ``softmax(coefficient(x))``.
    """

    def __init__(self, drop_tokens: bool, residual: bool = False) -> None:
        super().__init__()
        self.drop_tokens = drop_tokens
        self.wg = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([DeepSpeedExpert() for _ in range(E)])
        self.mlp = DeepSpeedExpert() if residual else None
        self.coefficient = nn.Linear(H, 2) if residual else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        d_model = hidden_states.shape[-1]
        reshaped_input = hidden_states.reshape(-1, d_model)
        logits = self.wg(reshaped_input.float())
        combine_weights, dispatch_mask = top2gating(logits, self.drop_tokens)
        dispatched_input = torch.einsum(
            "sec,sm->ecm", dispatch_mask.type_as(reshaped_input), reshaped_input
        )
        chunks = dispatched_input.chunk(E, dim=0)
        expert_output = torch.cat(
            [expert(c) for c, expert in zip(chunks, self.experts, strict=True)], dim=0
        )
        combined_output = torch.einsum(
            "sec,ecm->sm", combine_weights.type_as(reshaped_input), expert_output
        )
        output = combined_output.reshape(hidden_states.shape)
        if self.mlp is None:
            return output
        output_mlp = self.mlp(hidden_states)
        coef = F.softmax(self.coefficient(hidden_states), dim=-1)
        return output * coef[..., 0:1] + output_mlp * coef[..., 1:]


LAYERS = [
    Layer(
        "torchtitan_token_choice",
        lambda: TokenChoiceMoE(route_scale=2.0),
        "pytorch/torchtitan: torchtitan/models/deepseek_v3/model/moe.py",
        "MoE + TokenChoiceTopKRouter + GroupedExperts (for-loop path, use_grouped_mm=False)",
        True,
        "softmax scores, selection by scores + expert_bias, weights from the unbiased scores x2: "
        "MoE via the selection construction; the shared expert is scatter_add's base, outside",
        K,
        adaptations=TITAN,
    ),
    Layer(
        "torchtune_llama4_top1",
        lambda: TokenChoiceMoE(k=1, sigmoid=True, scale_before=True, bias=False),
        "pytorch/torchtune: torchtune/modules/moe/moe.py",
        "MoE(scale_before_experts=True) + TokenChoiceTopKRouter (sigmoid) + GroupedExperts (Llama 4)",
        True,
        "top-1, the routed input row scaled by its sigmoid score (SwiGLU maps 0 to 0): MoE on "
        "the scaled tokens, weight 1; shared expert outside",
        1,
        adaptations=TITAN,
    ),
    Layer(
        "torchtune_scale_before_top2",
        lambda: TokenChoiceMoE(k=2, sigmoid=True, scale_before=True, bias=False),
        "pytorch/torchtune: torchtune/modules/moe/moe.py",
        "MoE(scale_before_experts=True) with experts_per_token=2",
        False,
        "input scaling at top-2: a token enters its two experts at two different scales, "
        "expert(s_j x); one fused node feeds one input row per token",
        K,
        adaptations=TITAN,
    ),
    Layer(
        "megablocks_dmoe",
        MegablocksDMoE,
        "databricks/megablocks: megablocks/layers/dmoe.py",
        "dMoE.grouped_forward_once + LearnedRouter (router.py) + GroupedMLP, mlp_type 'mlp'",
        True,
        "Softmax -> TopK -> divide by the L1 norm, tanh-GELU experts: MoE gelu (ORT's gelu is "
        "the tanh form), k=2, normalize 1",
        K,
        adaptations=(
            "ops.sort/histogram/gather/scatter and gg.ops.gmm (CUDA kernels) written with "
            "torch.sort, a one-hot sum, indexing, one matmul per expert, and the rows put "
            "back in (token, slot) order and summed over k",
        ),
    ),
    Layer(
        "deepspeed_top2_nodrop",
        lambda: DeepSpeedMOELayer(drop_tokens=False),
        "microsoft/DeepSpeed: deepspeed/moe/sharded_moe.py",
        "MOELayer + TopKGate + top2gating(drop_tokens=False, top2_2nd_expert_sampling=False)",
        True,
        "top-2 by argmax rounds, weights renormalised over the two (clamp at eps never binds): "
        "MoE k=2 normalize 1; tanh-GELU experts with biases",
        K,
        adaptations=(
            "capacity 2*tokens instead of max(exp_counts) (same result, static size)",
            "experts: Linear-GELU(tanh)-Linear (Megatron's bias_gelu is the tanh form)",
        ),
    ),
    Layer(
        "deepspeed_top2_capacity",
        lambda: DeepSpeedMOELayer(drop_tokens=True),
        "microsoft/DeepSpeed: deepspeed/moe/sharded_moe.py",
        "top2gating(drop_tokens=True, capacity_factor=1.0, min_capacity=1)",
        False,
        "capacity drop: slots past ceil(2 T / E) per expert are masked out (cumsum locations)",
        K,
    ),
    Layer(
        "deepspeed_residual_moe",
        lambda: DeepSpeedMOELayer(drop_tokens=False, residual=True),
        "microsoft/DeepSpeed: deepspeed/moe/layer.py",
        "MoE(use_residual=True) (PR-MoE) over MOELayer + top2gating(drop_tokens=False)",
        True,
        "the top-2 MoE as deepspeed_top2_nodrop, its output times a per-token coefficient plus "
        "a dense MLP's: the fused node's output feeds the Mul",
        K,
        adaptations=("capacity 2*tokens instead of max(exp_counts) (same result, static size)",),
    ),
]
