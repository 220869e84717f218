"""Corpus layers after inference repositories: mistral-inference, gpt-fast, gpt-oss, DeepSeek-V3.

Each class says which upstream file and class it follows, and what it changed (only what
tracing needs; the arithmetic is the upstream's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import E, Flat, H, I, K, Layer, SwiGLUExpert


class MistralMoeLayer(nn.Module):
    """mistralai/mistral-inference ``src/mistral_inference/moe.py``, ``MoeLayer``.

    TopK of the gate logits, softmax over the k values, a Python loop over the experts with
    ``torch.where(selected_experts == i)`` and ``results[batch_idx] += w * expert(x[batch_idx])``.
    The experts are any list of modules (mistral's ``FeedForward``: ``w2(silu(w1 x) * w3 x)``).
    """

    def __init__(self, experts: list[nn.Module] | None = None, k: int = K) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts or [SwiGLUExpert() for _ in range(E)])
        self.gate = nn.Linear(H, len(self.experts), bias=False)
        self.k = k

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        gate_logits = self.gate(inputs)
        weights, selected_experts = torch.topk(gate_logits, self.k)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])
        return results


class ActExpert(nn.Module):
    """A mistral ``FeedForward`` whose gate activation is ``act`` (heterogeneous experts trap)."""

    def __init__(self, act) -> None:
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class GptFastConditionalFeedForward(nn.Module):
    """pytorch-labs/gpt-fast ``mixtral-moe/model.py``, ``ConditionalFeedForward``.

    Each token's k expert weights gathered by index (``self.w1[expert_indices]``) and applied by
    ``einsum('ti,taoi -> tao')``; FC2 by ``einsum('tao, taio -> tai')``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(E, I, H))
        self.w2 = nn.Parameter(torch.empty(E, H, I))
        self.w3 = nn.Parameter(torch.empty(E, I, H))

    def forward(self, x: torch.Tensor, expert_indices: torch.Tensor) -> torch.Tensor:
        w1_weights = self.w1[expert_indices]
        w3_weights = self.w3[expert_indices]
        w2_weights = self.w2[expert_indices]
        x1 = F.silu(torch.einsum("ti,taoi -> tao", x, w1_weights))
        x3 = torch.einsum("ti, taoi -> tao", x, w3_weights)
        return torch.einsum("tao, taio -> tai", (x1 * x3), w2_weights)


class GptFastMOEFeedForward(nn.Module):
    """pytorch-labs/gpt-fast ``mixtral-moe/model.py``, ``MOEFeedForward``.

    Softmax over all experts, TopK, in-place renormalisation, the weighted sum by
    ``einsum('tai,ta -> ti')``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.cond_ffn = GptFastConditionalFeedForward()
        self.dim = H
        self.num_activated_experts = K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, self.dim)
        scores = self.gate(x)
        expert_weights = F.softmax(scores, dim=-1)
        expert_weights, expert_indices = torch.topk(
            expert_weights, self.num_activated_experts, dim=-1
        )
        expert_weights /= expert_weights.sum(dim=-1, keepdim=True)
        expert_outs = self.cond_ffn(x, expert_indices)
        return torch.einsum("tai,ta -> ti", expert_outs, expert_weights).view(shape)


def gpt_oss_swiglu(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """openai/gpt-oss ``gpt_oss/torch/model.py``, ``swiglu``: interleaved, clamped, ``(l + 1)``."""
    x_glu, x_linear = x[..., ::2], x[..., 1::2]
    x_glu = x_glu.clamp(min=None, max=limit)
    x_linear = x_linear.clamp(min=-limit, max=limit)
    out_glu = x_glu * torch.sigmoid(alpha * x_glu)
    return out_glu * (x_linear + 1)


class GptOssRMSNorm(nn.Module):
    """openai/gpt-oss ``gpt_oss/torch/model.py``, ``RMSNorm``."""

    def __init__(self, num_features: int, eps: float = 1e-05) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(num_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.float()
        t = t * torch.rsqrt(torch.mean(t**2, dim=-1, keepdim=True) + self.eps)
        return (t * self.scale).to(x.dtype)


class GptOssMLPBlock(nn.Module):
    """openai/gpt-oss ``gpt_oss/torch/model.py``, ``MLPBlock`` (float32, one rank).

    RMSNorm, router Linear with bias, sorted TopK of the logits, softmax over the k values,
    expert weights and biases gathered by index, ``einsum("beck,bk->bec")``, the clamped
    interleaved SwiGLU, ``einsum("beck,bek->bec")``, the weighted sum
    ``einsum("bec,be->bc")`` and the residual.
    """

    def __init__(self) -> None:
        super().__init__()
        self.experts_per_token = K
        self.swiglu_limit = 7.0
        self.norm = GptOssRMSNorm(H)
        self.gate = nn.Linear(H, E)
        self.mlp1_weight = nn.Parameter(torch.empty(E, I * 2, H))
        self.mlp1_bias = nn.Parameter(torch.empty(E, I * 2))
        self.mlp2_weight = nn.Parameter(torch.empty(E, H, I))
        self.mlp2_bias = nn.Parameter(torch.empty(E, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.norm(x)
        g = self.gate(t)
        experts = torch.topk(g, k=self.experts_per_token, dim=-1, sorted=True)
        expert_weights = torch.nn.functional.softmax(experts.values, dim=1)
        expert_indices = experts.indices
        mlp1_weight = self.mlp1_weight[expert_indices, ...]
        mlp1_bias = self.mlp1_bias[expert_indices, ...]
        t = torch.einsum("beck,bk->bec", mlp1_weight, t) + mlp1_bias
        t = gpt_oss_swiglu(t, limit=self.swiglu_limit)
        mlp2_weight = self.mlp2_weight[expert_indices, ...]
        mlp2_bias = self.mlp2_bias[expert_indices, ...]
        t = torch.einsum("beck,bek->bec", mlp2_weight, t)
        t += mlp2_bias
        t = torch.einsum("bec,be->bc", t, expert_weights)
        return x + t


class DeepSeekV3Gate(nn.Module):
    """deepseek-ai/DeepSeek-V3 ``inference/model.py``, ``Gate`` (sigmoid, bias, groups).

    The correction bias is used only for the selection (the weights are gathered from the
    unbiased sigmoid scores), groups ranked by the sum of their two best biased scores, the
    selected weights renormalised and multiplied by ``route_scale``.
    """

    def __init__(self, experts: int, groups: int, topk_groups: int, k: int, scale: float) -> None:
        super().__init__()
        self.topk, self.n_groups, self.topk_groups, self.route_scale = k, groups, topk_groups, scale
        self.weight = nn.Parameter(torch.empty(experts, H))
        self.bias = nn.Parameter(torch.empty(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x, self.weight)
        scores = scores.sigmoid()
        original_scores = scores
        scores = scores + self.bias
        scores = scores.view(x.size(0), self.n_groups, -1)
        group_scores = scores.topk(2, dim=-1)[0].sum(dim=-1)
        indices = group_scores.topk(self.topk_groups, dim=-1)[1]
        mask = scores.new_ones(x.size(0), self.n_groups, dtype=torch.bool).scatter_(
            1, indices, False
        )
        scores = scores.masked_fill_(mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = torch.topk(scores, self.topk, dim=-1)[1]
        weights = original_scores.gather(1, indices)
        weights /= weights.sum(dim=-1, keepdim=True)
        weights *= self.route_scale
        return weights.type_as(x), indices


class DeepSeekV3MoE(nn.Module):
    """deepseek-ai/DeepSeek-V3 ``inference/model.py``, ``MoE`` (one rank).

    ``torch.where(indices == i)`` per expert, ``y[idx] += expert(x[idx]) * weights[idx, top,
    None]``, plus the shared experts' MLP.
    """

    def __init__(self, experts: int = 6) -> None:
        super().__init__()
        self.gate = DeepSeekV3Gate(experts, groups=3, topk_groups=2, k=K, scale=2.5)
        self.experts = nn.ModuleList([SwiGLUExpert() for _ in range(experts)])
        self.shared_experts = SwiGLUExpert(H, 2 * I)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, H)
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            idx, top = torch.where(indices == i)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        z = self.shared_experts(x)
        return (y + z).view(shape)


class Grok1MoELayer(nn.Module):
    """xai-org/grok-1 ``model.py``, ``MoELayer`` / ``Router`` (JAX), as PyTorch ports write it.

    Softmax of the router logits, top-2 probabilities used as they are, experts
    ``linear_1(gelu(linear x) * linear_v x)`` with JAX's default (tanh) GELU: a gated GELU.
    """

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.linear = nn.Parameter(torch.empty(E, H, I))
        self.linear_v = nn.Parameter(torch.empty(E, H, I))
        self.linear_1 = nn.Parameter(torch.empty(E, I, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, H)
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, selected = torch.topk(probs, K)
        out = torch.zeros_like(x)
        for e in range(E):
            rows, slot = torch.where(selected == e)
            h = x[rows]
            a = F.gelu(h @ self.linear[e], approximate="tanh") * (h @ self.linear_v[e])
            out = out.index_add(0, rows, (a @ self.linear_1[e]) * weights[rows, slot, None])
        return out.reshape(shape)


LAYERS = [
    Layer(
        "mistral_inference_moe",
        lambda: Flat(MistralMoeLayer()),
        "mistralai/mistral-inference: src/mistral_inference/moe.py",
        "MoeLayer (experts: transformer_layers.py FeedForward)",
        True,
        "TopK(logits) -> Softmax over k, SwiGLU experts: MoE k=2, normalize 1",
        K,
    ),
    Layer(
        "mistral_inference_mixed_activations",
        lambda: Flat(
            MistralMoeLayer([ActExpert(a) for a in (F.silu, F.gelu, torch.relu, torch.tanh)])
        ),
        "mistralai/mistral-inference: src/mistral_inference/moe.py",
        "MoeLayer with a heterogeneous experts list (MoeLayer takes any list of modules)",
        False,
        "each expert has another gate activation (silu, erf GELU, ReLU, tanh): one fused node "
        "has one activation_type for all experts",
        K,
    ),
    Layer(
        "gpt_fast_moe",
        GptFastMOEFeedForward,
        "pytorch-labs/gpt-fast: mixtral-moe/model.py",
        "MOEFeedForward + ConditionalFeedForward (gathered-weight einsum)",
        True,
        "Softmax -> TopK -> renormalise, SwiGLU: MoE k=2, normalize 1",
        K,
    ),
    Layer(
        "gpt_oss_reference_mlpblock",
        lambda: Flat(GptOssMLPBlock()),
        "openai/gpt-oss: gpt_oss/torch/model.py",
        "MLPBlock + swiglu + RMSNorm (float32, world_size 1)",
        True,
        "TopK(logits) -> Softmax over k; interleaved clamped SwiGLU (alpha 1.702, beta 1, "
        "limit 7) with fc1/fc2 biases: MoE swiglu_fusion=1; RMSNorm before and residual after stay",
        K,
    ),
    Layer(
        "deepseek_v3_reference_moe",
        lambda: DeepSeekV3MoE(),
        "deepseek-ai/DeepSeek-V3: inference/model.py",
        "MoE + Gate (sigmoid, correction bias, grouped top-k, route_scale) + Expert + MLP",
        True,
        "any top-k selection with non-negative per-selected weights (sigmoid, renormalised, "
        "x2.5): MoE through the selection/weights construction; shared MLP added outside",
        K,
        experts=6,
        adaptations=(
            "the host-side `counts[i] == 0: continue` skip (bincount(...).tolist()) is dropped: it "
            "changes no value and stops torch.export",
            "the gate's bias exists for every size (upstream: only dim 7168, the V3 size)",
        ),
    ),
    Layer(
        "grok1_moe",
        Grok1MoELayer,
        "xai-org/grok-1: model.py",
        "MoELayer + Router (JAX; written as the PyTorch ports do)",
        False,
        "gated GELU experts (gelu(x W) * (x V)): MoE/QMoE offer swiglu as the only gated "
        "activation, no GeGLU",
        K,
    ),
]
