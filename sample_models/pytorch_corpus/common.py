"""Shared pieces of the PyTorch corpus layers: sizes, the layer record, seeded weights.

Every corpus layer is a small ``torch.nn.Module`` written in the style of one public PyTorch
implementation (the upstream file and the class or function it follows are in its ``Layer``
record and in the module's docstring). Sizes are tiny so that each export is a few KB:
``H`` (hidden) 8, ``I`` (expert intermediate) 12, ``E`` 4 experts unless a layer says otherwise.
No weight matrix is square (``I != H``, ``2I != H``), so a fuser that transposes or splits the
wrong axis fails on shapes. Only ``sample_models/export_pytorch_corpus.py`` imports this (torch).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

H, I, E, K = 8, 12, 4, 2  # noqa: E741 (I: the expert intermediate size, as in the docs)
#: the names of the modules holding router matrices (``seeded`` scales them up)
ROUTER_MODULES = ("gate", "router", "classifier", "wg", "layer", "topkroute_linear", "lin")


@dataclass(frozen=True)
class Layer:
    """One corpus layer: how to build it, what it follows, what one fused node could do with it.

    ``expressible`` is decided from the semantics (``/work/shared/notes/semantics.md``,
    ``docs/routing.md``: any top-k selection with per-selected non-negative weights over experts
    that are FFNs with one of the fused op's activations), never from what the tool does.
    ``why`` says why (the trap's reason when not expressible). ``expected`` is the fused op an
    ``ort-cpu`` fusion of a float32 layer gives (``MoE``), None for traps.
    """

    name: str
    build: Callable[[], nn.Module]
    upstream: str  # "owner/repo: path"
    follows: str  # the class / function the module is written after
    expressible: bool
    why: str
    k: int
    experts: int = E
    adaptations: tuple[str, ...] = field(default_factory=tuple)

    @property
    def expected(self) -> str | None:
        return "MoE" if self.expressible else None


def seeded(module: nn.Module, name: str) -> nn.Module:
    """Fill every float parameter and buffer of ``module`` from a seed fixed by ``name``.

    Random N(0, 1) scaled by 1/sqrt(fan-in) for matrices and 0.5 for vectors (biases, correction
    biases), never zeros; the router weights (a matrix held by a module named in
    ``ROUTER_MODULES``: ``gate.weight``, ``router.layer.weight``, ...) get a larger scale so ties are
    astronomically unlikely. Eval mode (dropout off).
    """
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    with torch.no_grad():
        tensors = list(module.named_parameters()) + list(module.named_buffers())
        for pname, t in tensors:
            if not t.is_floating_point():
                continue
            value = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            scale = 0.5 if t.dim() < 2 else 1.0 / float(t.shape[-1]) ** 0.5
            owner = pname.rsplit(".", 1)[0].rsplit(".", 1)[-1] if "." in pname else ""
            if owner in ROUTER_MODULES and t.dim() == 2:
                scale *= 3.0
            t.copy_(value * scale)
    return module.eval()


class SwiGLUExpert(nn.Module):
    """``w2(silu(w1 x) * w3 x)``, the Llama/Mistral expert FFN (``nn.Linear`` without biases)."""

    def __init__(self, hidden: int = H, inter: int = I) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class HFSwiGLUMLP(nn.Module):
    """transformers' ``*MLP``: ``down_proj(act(gate_proj x) * up_proj x)`` (shared experts too)."""

    def __init__(self, hidden: int = H, inter: int = I) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Flat(nn.Module):
    """Runs a token-major layer (``[T, H]`` in, ``[T, H]`` out) on ``[B, S, H]`` inputs.

    The inference repos (mistral-inference, gpt-fast, DeepSeek's and gpt-oss's reference code)
    call their MoE on flattened tokens; the corpus feeds every layer ``[B, S, H]``.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.reshape(-1, x.shape[-1])).reshape(x.shape)
