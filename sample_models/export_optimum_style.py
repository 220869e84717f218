"""Export MoE blocks the way optimum-onnx exports them: its patched forwards, through torch.onnx.

optimum-onnx (0.1.0, transformers < 4.58) does not export transformers' own MoE forwards: its
``model_patcher.py`` swaps them for export-friendly ones, and those are what its users' ONNX files
hold. This script reproduces them without optimum (which pins transformers < 4.58, while the
project's export venv has 5.x): the modules are written here as transformers 4.57 defines them
(``Qwen3MoeSparseMoeBlock`` with a ``ModuleList`` of ``Qwen3MoeMLP`` experts, separate
``gate_proj``/``up_proj``/``down_proj`` ``Linear`` layers without bias; gpt-oss's ``GptOssExperts``
with stacked ``gate_up_proj``/``down_proj`` and biases) and their forwards copied from optimum's
patcher:

- ``qwen3_moe_optimum``: the loop over **all** experts (optimum: "we loop over all possible
  experts instead of hit ones to avoid issues in graph execution"): ``one_hot`` expert mask,
  ``torch.where`` per expert (NonZero), the expert's MLP on the gathered rows, times the gathered
  routing weight, ``index_add_`` into the output (ScatterND with add);
- ``gpt_oss_optimum``: every expert on every token (``repeat`` + ``bmm``), weighted by the
  router's dense ``[T, E]`` scores (zero where not chosen: a ScatterElements of the top-k
  softmax), summed over experts.

Both are exported with the legacy TorchScript exporter (what optimum-onnx 0.1.0 calls:
``torch.onnx.export(..., dynamo=False)``) at opset 18, batch and sequence dynamic, random weights
from ``torch.manual_seed(0)``. ``qwen3_moe_optimum_dynamo`` is the same Qwen3 module through
``torch.onnx.export(..., dynamo=True)`` (what a user of a newer optimum or of torch.onnx directly
gets). torch.onnx (2.13) writes the loop's ``expert_mask[e].squeeze(0)``, a no-op in torch because
axis 0 is k = 2, as an ONNX ``Squeeze(axes=[0])``, which ONNX Runtime refuses ("Dimension of input
0 must be 1 instead of 2"): :func:`drop_noop_squeezes` removes each Squeeze whose axis the
export's own shapes give as a size other than 1 (torch's meaning), and the script records that it
did so in ``index.json``. Run in the export venv (see docs/exported-models.md)::

    .venv-export/bin/python sample_models/export_optimum_style.py

It writes ``sample_models/exported/optimum/<name>.onnx`` and ``<name>.npz`` (``hidden_states``
``[2, 8, 64]`` and the module's ``output``), and checks ORT CPU against PyTorch on several token
counts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

OUT_DIR = Path(__file__).resolve().parent / "exported" / "optimum"
HIDDEN = 64
CHECK_SHAPES = [(2, 8), (1, 1), (1, 7), (3, 5), (4, 33)]


class Qwen3MoeMLP(nn.Module):
    """transformers 4.57 ``Qwen3MoeMLP``: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Qwen3MoeSparseMoeBlockOptimum(nn.Module):
    """transformers 4.57 ``Qwen3MoeSparseMoeBlock`` with optimum-onnx's patched forward."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, norm: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = experts, top_k, norm
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Qwen3MoeMLP(hidden, inter) for _ in range(experts))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # optimum/exporters/onnx/model_patcher.py qwen3_moe_forward_patched (router logits dropped
        # as the decoder layer drops them)
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = torch.nn.functional.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim),
            dtype=hidden_states.dtype,
            device=hidden_states.device,
        )
        expert_mask = torch.nn.functional.one_hot(
            selected_experts, num_classes=self.num_experts
        ).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)


class GptOssOptimum(nn.Module):
    """gpt-oss's router + ``GptOssExperts`` with optimum-onnx's dense patched forward."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.hidden_size, self.top_k, self.num_experts = hidden, top_k, experts
        self.router_weight = nn.Parameter(torch.empty(experts, hidden))
        self.router_bias = nn.Parameter(torch.empty(experts))
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.alpha, self.limit = 1.702, 7.0

    def _router(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # transformers 4.57 GptOssTopKRouter: top-k of the logits, softmax over the k, scattered
        logits = torch.nn.functional.linear(hidden_states, self.router_weight, self.router_bias)
        top_value, top_index = torch.topk(logits, self.top_k, dim=-1)
        top_value = torch.nn.functional.softmax(top_value, dim=1, dtype=top_value.dtype)
        return torch.zeros_like(logits).scatter_(1, top_index, top_value)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = hidden_states.shape
        flat = hidden_states.reshape(-1, self.hidden_size)
        routing_weights = self._router(flat)
        # optimum/exporters/onnx/model_patcher.py gpt_oss_forward
        batch_size = hidden_states.shape[0]
        hs = hidden_states.reshape(-1, self.hidden_size)
        num_experts = routing_weights.shape[1]
        hs = hs.repeat(num_experts, 1)
        hs = hs.view(num_experts, -1, self.hidden_size)
        gate_up = torch.bmm(hs, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        next_states = torch.bmm(((up + 1) * glu), self.down_proj)
        next_states = next_states + self.down_proj_bias[..., None, :]
        next_states = next_states.view(num_experts, batch_size, -1, self.hidden_size)
        next_states = (
            next_states
            * routing_weights.transpose(0, 1).view(num_experts, batch_size, -1)[..., None]
        )
        return next_states.sum(dim=0).reshape(batch, seq, self.hidden_size)


def _fill(module: nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.2)


MODELS = {
    "qwen3_moe_optimum": lambda: Qwen3MoeSparseMoeBlockOptimum(HIDDEN, 40, 8, 2, True),
    "qwen3_moe_optimum_dynamo": lambda: Qwen3MoeSparseMoeBlockOptimum(HIDDEN, 40, 8, 2, True),
    "qwen3_moe_optimum_no_norm": lambda: Qwen3MoeSparseMoeBlockOptimum(HIDDEN, 40, 8, 2, False),
    "gpt_oss_optimum": lambda: GptOssOptimum(HIDDEN, 48, 4, 2),
}


def _dims(value_info: onnx.ValueInfoProto) -> list:
    return list(value_info.type.tensor_type.shape.dim)


def drop_noop_squeezes(model: onnx.ModelProto) -> list[str]:
    """Remove each ``Squeeze`` of an axis whose declared size is not 1; return their names.

    torch's ``squeeze(dim)`` leaves a tensor alone when that dim is not 1; ONNX's Squeeze
    refuses it. Only axes the export itself declares (``value_info``) as an int other than 1
    are taken as no-ops; every other Squeeze stays.
    """
    shapes = {
        vi.name: [d.dim_value if d.HasField("dim_value") else None for d in _dims(vi)]
        for vi in [*model.graph.value_info, *model.graph.input]
    }
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    dropped, keep = [], []
    renames: dict[str, str] = {}
    for node in model.graph.node:
        dims = shapes.get(node.input[0]) if node.op_type == "Squeeze" else None
        axes = consts.get(node.input[1]) if dims is not None and len(node.input) > 1 else None
        if axes is not None and all(dims[int(a)] not in (None, 1) for a in axes.reshape(-1)):
            renames[node.output[0]] = node.input[0]
            dropped.append(node.name)
            continue
        keep.append(node)
    for node in keep:
        for i, name in enumerate(node.input):
            node.input[i] = renames.get(name, name)
    del model.graph.node[:]
    model.graph.node.extend(keep)
    return dropped


def _export_onnx(module: nn.Module, x: torch.Tensor, path: Path, dynamo: bool) -> list[str]:
    """Write ``path``; returns the no-op Squeezes removed from a dynamo export."""
    if not dynamo:
        torch.onnx.export(
            module,
            (x,),
            str(path),
            dynamo=False,
            opset_version=18,
            input_names=["hidden_states"],
            output_names=["output"],
            dynamic_axes={"hidden_states": {0: "batch", 1: "sequence"}, "output": {0: "batch", 1: "sequence"}},
        )  # fmt: skip
        return []
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    program = torch.onnx.export(
        module,
        (x,),
        dynamo=True,
        opset_version=18,
        input_names=["hidden_states"],
        output_names=["output"],
        dynamic_shapes={"hidden_states": {0: batch, 1: sequence}},
    )
    model = program.model_proto
    dropped = drop_noop_squeezes(model)
    onnx.save(model, str(path))
    return dropped


def export(name: str) -> dict:
    """Export one module, check it in ORT against PyTorch, write .onnx/.npz; return a record."""
    module = MODELS[name]()
    _fill(module)
    module.eval()
    x = torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(1))
    path = OUT_DIR / f"{name}.onnx"
    dropped = _export_onnx(module, x, path, dynamo=name.endswith("_dynamo"))
    with torch.no_grad():
        ref = module(x).numpy()
    np.savez(OUT_DIR / f"{name}.npz", hidden_states=x.numpy(), output=ref)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    errors = {}
    for b, s in CHECK_SHAPES:
        xi = torch.randn(b, s, HIDDEN, generator=torch.Generator().manual_seed(b * 100 + s))
        with torch.no_grad():
            want = module(xi).numpy()
        got = sess.run(None, {"hidden_states": xi.numpy()})[0]
        errors[f"{b}x{s}"] = float(np.abs(got - want).max() / np.abs(want).max())
    record = {"name": name, "max_rel_err_vs_torch": errors, "torch": torch.__version__}
    if dropped:
        record["noop_squeezes_removed"] = dropped
    return record


def main() -> int:
    """Export every model; print the ORT-vs-PyTorch errors."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    records = [export(name) for name in MODELS]
    (OUT_DIR / "index.json").write_text(json.dumps(records, indent=1) + "\n")
    for r in records:
        print(r["name"], {k: f"{v:.1e}" for k, v in r["max_rel_err_vs_torch"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
