"""Corpus layers after tutorial code: makeMoE (with and without capacity), a shared expert inside.

AviSoori1x/makeMoE is the "sparse mixture of experts from scratch" tutorial (Hugging Face blog
"makeMoE"); its router is written noiseless here (``NoisyTopkRouter`` in eval keeps adding
noise upstream, which no export can reproduce).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import E, H, K, Layer, SwiGLUExpert


class MakeMoEExpert(nn.Module):
    """AviSoori1x/makeMoE ``makeMoE.py``, ``Expert``: ``Linear(n, 4n) -> ReLU -> Linear -> Dropout``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(H, 4 * H), nn.ReLU(), nn.Linear(4 * H, H), nn.Dropout(0.1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class MakeMoESparseMoE(nn.Module):
    """AviSoori1x/makeMoE ``SparseMoE`` + ``NoisyTopkRouter`` without the noise term.

    TopK of the logits scattered into ``-inf`` and softmaxed (a softmax over the k), then per
    expert ``(indices == i).any(-1)`` masks. ``capacity_factor`` None is the notebook's first
    version (``makeMoE_from_Scratch.ipynb``: ``final_output[expert_mask] += weighted``); a factor
    is ``makeMoE.py``'s: ``nonzero`` rows cut at ``int(T * k / E * factor)``, ``index_add_``.
    """

    def __init__(self, capacity_factor: float | None) -> None:
        super().__init__()
        self.topkroute_linear = nn.Linear(H, E)
        self.experts = nn.ModuleList([MakeMoEExpert() for _ in range(E)])
        self.top_k, self.capacity_factor = K, capacity_factor

    def router(self, x: torch.Tensor):
        logits = self.topkroute_linear(x)
        top_k_logits, indices = logits.topk(self.top_k, dim=-1)
        zeros = torch.full_like(logits, float("-inf"))
        sparse_logits = zeros.scatter(-1, indices, top_k_logits)
        return F.softmax(sparse_logits, dim=-1), indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, seq_len, _ = x.shape
        gating_output, indices = self.router(x)
        final_output = torch.zeros_like(x)
        flat_x = x.view(-1, x.size(-1))
        flat_gating_output = gating_output.view(-1, gating_output.size(-1))
        if self.capacity_factor is None:
            for i, expert in enumerate(self.experts):
                expert_mask = (indices == i).any(dim=-1)
                flat_mask = expert_mask.view(-1)
                expert_output = expert(flat_x[flat_mask])
                gating_scores = flat_gating_output[flat_mask, i].unsqueeze(1)
                final_output[expert_mask] += expert_output * gating_scores
            return final_output
        expert_capacity = int((batch_size * seq_len * self.top_k / E) * self.capacity_factor)
        updates = torch.zeros_like(flat_x)
        for i, expert in enumerate(self.experts):
            flat_mask = (indices == i).any(dim=-1).view(-1)
            limited_indices = torch.nonzero(flat_mask).squeeze(-1)[:expert_capacity]
            expert_output = expert(flat_x[limited_indices])
            gating_scores = flat_gating_output[limited_indices, i].unsqueeze(1)
            updates.index_add_(0, limited_indices, expert_output * gating_scores)
        return final_output + updates.view(batch_size, seq_len, -1)


class SharedInsideCombine(nn.Module):
    """The shared expert summed inside the weighted combine: ``sum_j w_j (E_j(x) + S(x))``.

    Written in the style of mistral-inference's ``MoeLayer`` loop (softmax over all experts,
    TopK, no renormalisation), with each selected expert's output plus the shared expert's
    weighed together. Expressible by one node with widened experts: ``E_e + S`` is itself an
    FFN (FC1 rows of ``E_e`` and ``S`` stacked, FC2 columns side by side, same activation), so
    ``MoE`` with ``I_e + I_s`` computes it exactly.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([SwiGLUExpert() for _ in range(E)])
        self.shared = SwiGLUExpert()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        inputs = x.reshape(-1, H)
        probs = F.softmax(self.gate(inputs), dim=-1)
        weights, selected = torch.topk(probs, K)
        shared = self.shared(inputs)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            batch_idx, nth = torch.where(selected == i)
            results[batch_idx] += weights[batch_idx, nth, None] * (
                expert(inputs[batch_idx]) + shared[batch_idx]
            )
        return results.reshape(shape)


LAYERS = [
    Layer(
        "makemoe_sparse_moe",
        lambda: MakeMoESparseMoE(None),
        "AviSoori1x/makeMoE: makeMoE_from_Scratch.ipynb",
        "SparseMoE + NoisyTopkRouter (noise term left out) + Expert",
        True,
        "TopK(logits) -> Softmax over k (via -inf scatter), ReLU experts with biases: MoE relu, "
        "k=2, normalize 1",
        K,
        adaptations=(
            "no router noise (randn_like in eval upstream)",
            "no `if flat_mask.any()` skip",
        ),
    ),
    Layer(
        "makemoe_capacity",
        lambda: MakeMoESparseMoE(1.0),
        "AviSoori1x/makeMoE: makeMoE.py",
        "SparseMoE(capacity_factor=1.0) + NoisyTopkRouter (noise term left out)",
        False,
        "capacity drop: each expert keeps only its first int(T k / E) tokens (nonzero rows cut)",
        K,
        adaptations=(
            "no router noise",
            "the `numel() > capacity` branch is the slice itself "
            "(slicing past the end keeps all rows)",
        ),
    ),
    Layer(
        "shared_inside_combine",
        SharedInsideCombine,
        "mistralai/mistral-inference: src/mistral_inference/moe.py",
        "MoeLayer loop with the shared expert inside the weighted sum",
        True,
        "sum_j w_j (E_j(x) + S(x)) = MoE over widened experts [E_e; S] (I + I_s): one node "
        "computes it exactly; Softmax -> TopK without renormalisation: normalize 0",
        K,
    ),
]
