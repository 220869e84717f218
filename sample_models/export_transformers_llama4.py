"""The Llama4 MoE block exports of ``export_transformers.py`` (its ``SPECS`` take these too).

A whole ``Llama4ForCausalLM`` cannot be exported with torch.onnx 2.13 (its rotary embedding
multiplies complex tensors: "No decompositions registered for the complex-valued input", see
``sample_models/causal_lm/index.json``), so the MoE layer is exported alone, as
``Llama4TextMoe``: top-k of the router logits, the sigmoid of the selected logits scattered
into a ``[T, E]`` tensor (0 elsewhere), every expert run on every token with its input scaled
by that score (``Llama4TextExperts``: bmm over all experts), summed, plus the shared expert.

* ``llama4_text_moe``: ``num_experts_per_tok=1``, as Llama 4 Scout and Maverick: fuses into one
  MoE over the scaled tokens (``x * score``) with weight 1 (``docs/routing.md``);
* ``llama4_text_moe_top2``: the same block with k = 2: one token would enter two experts at two
  different scales, which no fused node computes, so it must come out unchanged, explained.
"""

from __future__ import annotations

from typing import Any

import torch
from export_transformers_specs import HIDDEN, Spec, _FirstOutput, _init, _moe_expected

__all__ = ["LLAMA4_SPECS", "build_llama4", "llama4_moe_inputs"]


def build_llama4(impl: str | None, top_k: int = 1) -> tuple[torch.nn.Module, Any]:
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    cfg = Llama4TextConfig(
        hidden_size=HIDDEN,
        intermediate_size=48,
        intermediate_size_mlp=96,
        num_local_experts=4,
        num_experts_per_tok=top_k,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    block = Llama4TextMoe(cfg)
    _init(block, {"router": 0.2, "gate_up_proj": 0.1, "down_proj": 0.1, "shared_expert": 0.1})
    return _TokenRows(block), cfg


class _TokenRows(_FirstOutput):
    """The block's first output, reshaped back to ``[B, S, H]`` as the decoder layer does.

    ``Llama4TextMoe`` returns ``(out [T, H], router_logits)``; ``Llama4TextDecoderLayer``
    keeps ``out`` and views it as the residual's shape.
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MoE block's output in the input's shape."""
        return self.block(hidden_states)[0].reshape(hidden_states.shape)


def llama4_moe_inputs(block: torch.nn.Module, h: torch.Tensor):
    """What a hand-built MoE node gets for ``block`` (top-1): the tokens scaled by their score.

    ``(scaled tokens, router logits, routed experts' output, fc1 [E, 2I, H] interleaved,
    fc2 [E, H, I])``; the routed output is the block's less its shared expert.
    """
    import numpy as np

    scores, logits = block.router(h)  # scores [T, E]: the selected sigmoid, 0 elsewhere
    scaled = h * scores.sum(dim=1, keepdim=True)
    want = (block(h.unsqueeze(0))[0].reshape(h.shape) - block.shared_expert(h)).numpy()
    gate_up = block.experts.gate_up_proj.transpose(1, 2).numpy()  # [E, 2I, H]
    inter = gate_up.shape[1] // 2
    fc1 = np.empty_like(gate_up)
    fc1[:, 0::2], fc1[:, 1::2] = gate_up[:, :inter], gate_up[:, inter:]
    fc2 = block.experts.down_proj.transpose(1, 2).numpy()  # [E, H, I]
    return scaled, logits, want, fc1, fc2


def _llama4_computes(cfg: Any) -> dict[str, Any]:
    return {
        "module": "transformers.models.llama4.modeling_llama4.Llama4TextMoe (first output only)",
        "router": "logits = x @ router.weight.T (no bias)",
        "routing": "top-k of the logits; scores = sigmoid of the top-k logits scattered into -inf "
        "elsewhere (0 after the sigmoid), [T, E]",
        # the expert outputs are summed with weight 1: a renormalised top-1
        "renormalised": cfg.num_experts_per_tok == 1,
        "top_k": cfg.num_experts_per_tok,
        "num_experts": cfg.num_local_experts,
        "activation": "SwiGLU: silu(gate) * up",
        "swiglu_order": "gate_up_proj [E, H, 2I] concatenated: columns 0..I-1 gate, I..2I-1 up",
        "clamp": None,
        "expert_weight_layout": "gate_up_proj [E, H, 2I], down_proj [E, I, H] (in, out): bmm",
        "biases": "none (router and experts)",
        "combine": "every expert on every token, input scaled by its score, summed over E",
        "shared_expert": "ungated Llama4TextMLP (silu(gate(x)) * up(x), down), added",
    }


LLAMA4_SPECS = [
    Spec(
        name="llama4_text_moe",
        family="llama4",
        build=build_llama4,
        impl=None,
        exporter="dynamo",
        computes=_llama4_computes,
        expected=[["MoE", 1]],
        expected_attributes=lambda c: _moe_expected(c, 1, 1),
        expected_note="One MoE over the tokens scaled by the sigmoid score of their expert "
        "(GatherElements of the scores at the selection, Mul), weight 1 (the softmax of the one "
        "selected logit: normalize_routing_weights=1, router_probs = the logits); the router "
        "(Gemm, TopK, scatter, Sigmoid) and the shared expert stay as written.",
        kept_ops=[["Gemm", 4], ["ScatterElements", 1]],
    ),
    Spec(
        name="llama4_text_moe_top2",
        family="llama4",
        build=lambda impl: build_llama4(impl, top_k=2),
        impl=None,
        exporter="dynamo",
        computes=_llama4_computes,
        expected=[],
        expected_attributes=None,
        expected_note="None: with k = 2 each selected expert reads the token at its own scale; a "
        "fused node has one input row per token, so the layer is left unchanged and the near "
        "miss names the router's k.",
    ),
]
