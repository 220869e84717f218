"""Export transformers' sparse-MoE blocks to ONNX with torch.onnx, as real users get them.

Run it in the export venv (torch is never needed by the package, its tests or CI)::

    python3 -m venv .venv-export
    .venv-export/bin/pip install torch==2.13.0 transformers onnx onnxscript onnxruntime numpy
    .venv-export/bin/python sample_models/export_transformers.py [--only NAME ...]

For each model below it builds the MoE block module of a transformers model from a small
config made in code (no download), fills its parameters from a fixed torch seed, exports it, and
writes into ``sample_models/exported/``:

- ``<name>.onnx``: the export, weights as initializers inside the file.
- ``<name>.npz``: one random input (``hidden_states``, ``[2, 8, H]`` float32) and the PyTorch
  module's output on it (``output``): the reference ``tests/samples/test_exported_models.py``
  checks the committed model against without torch.
- ``<name>.json``: versions, the config, the input, what the layer computes, the fusion it should
  get, the export's op histogram and node listing, and the ORT-vs-PyTorch errors measured here.

and ``index.json`` listing them (plus the exports that failed, with the reason); ``--only``
rewrites just the named models and leaves ``index.json`` as it is.

The models:

- ``mixtral_batched_mm``, ``qwen3_moe_batched_mm``, ``qwen2_moe_batched_mm``,
  ``gpt_oss_batched_mm``: ``torch.onnx.export(..., dynamo=True)`` of ``MixtralSparseMoeBlock``,
  ``Qwen3MoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock`` (with its shared expert) and
  ``GptOssMLP``, with ``config._experts_implementation = "batched_mm"`` (the config keyword
  ``experts_implementation="batched_mm"``; the experts classes are decorated with
  ``transformers.integrations.moe.use_experts_implementation``, which dispatches ``forward`` on
  that config field through ``ALL_EXPERTS_FUNCTIONS``). Batch and sequence are dynamic.
- ``mixtral_batched_mm_hf_table``: ``mixtral_batched_mm`` exported with transformers' own
  translation table (see below), as transformers' ONNX exporter does: its ``repeat_interleave``
  translation repeats tokens with Unsqueeze/Tile/Reshape instead of Unsqueeze/Expand/Reshape.
- ``mixtral_grouped_mm``: the ``grouped_mm`` experts implementation (what ``from_pretrained``
  picks by default). Plain torch.onnx cannot translate it (no ONNX function for
  ``transformers::grouped_mm_fallback``), so this one passes transformers' own translation table
  (``transformers.exporters.exporter_onnx._ONNX_TRANSLATION_TABLE``, which transformers' ONNX
  exporter uses): rows sorted by expert, one Range/Gather/MatMul per expert, Concat.
- ``mixtral_eager_torchscript``: the eager per-expert loop (``experts_implementation`` unset).
  ``torch.onnx.export(dynamo=True)`` refuses it (the loop runs over a data-dependent number of
  hit experts: ``GuardOnDataDependentSymNode``; that failure is recorded in ``index.json``), so it
  is exported with the legacy TorchScript exporter (``dynamo=False``). The trace unrolls the loop
  once per expert hit by the example input, so the model only runs when every expert is hit
  (a single token fails in ORT): a form a fuser must leave alone.

``GptOssMLP`` returns ``(hidden_states, router_scores)``; the decoder layer drops the scores, so
the export wraps it and returns only ``hidden_states``, as a full model's graph would.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import math
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
import torch
import transformers

OUT_DIR = Path(__file__).resolve().parent / "exported"
SEED = 0
# Sizes: H = 64 and intermediate sizes (48, 40) chosen so that no expert weight is square
# (2I != H, I != H): a fuser that transposes or un-interleaves the wrong axis fails on shapes.
HIDDEN = 64
REF_SHAPE = (2, 8, HIDDEN)  # the stored reference input: 16 tokens
# Shapes the export is checked on here (besides the reference): odd sizes, one token, more tokens.
CHECK_SHAPES = [(1, 1, HIDDEN), (1, 7, HIDDEN), (3, 5, HIDDEN), (4, 33, HIDDEN)]
MAX_FILE_BYTES = 1 << 20


# -- the models ----------------------------------------------------------------------------------


class _FirstOutput(torch.nn.Module):
    """``GptOssMLP`` without its second output (the router scores the decoder layer drops)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MoE block's hidden states."""
        return self.block(hidden_states)[0]


def _init(module: torch.nn.Module, stds: dict[str, float]) -> None:
    """Fill every parameter from N(0, std), std picked by the first matching name fragment.

    transformers' experts classes allocate with ``torch.empty``: nothing here may stay unset.
    """
    for name, param in module.named_parameters():
        std = next((s for frag, s in stds.items() if frag in name), None)
        if std is None:
            raise KeyError(f"no init std for parameter {name}")
        with torch.no_grad():
            param.normal_(0.0, std)


def build_mixtral(impl: str | None) -> tuple[torch.nn.Module, Any]:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        experts_implementation=impl,
    )
    block = MixtralSparseMoeBlock(cfg)
    _init(block, {"gate.weight": 0.2, "gate_up_proj": 0.1, "down_proj": 0.1})
    return block, cfg


def build_qwen3(impl: str | None) -> tuple[torch.nn.Module, Any]:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=40,
        num_experts=8,
        num_experts_per_tok=4,
        norm_topk_prob=True,  # as in Qwen3-30B-A3B's config.json (the class default is False)
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        experts_implementation=impl,
    )
    block = Qwen3MoeSparseMoeBlock(cfg)
    _init(block, {"gate.weight": 0.2, "gate_up_proj": 0.1, "down_proj": 0.1})
    return block, cfg


def build_qwen2(impl: str | None) -> tuple[torch.nn.Module, Any]:
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=40,
        shared_expert_intermediate_size=80,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,  # Qwen1.5-MoE / Qwen2-57B-A14B: the top-k softmax values as they are
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        experts_implementation=impl,
    )
    block = Qwen2MoeSparseMoeBlock(cfg)
    _init(
        block,
        {
            "shared_expert_gate": 0.1,
            "gate.weight": 0.2,
            "gate_up_proj": 0.1,
            "experts.down_proj": 0.1,
            "shared_expert.": 0.1,
        },
    )
    return block, cfg


def build_gpt_oss(impl: str | None) -> tuple[torch.nn.Module, Any]:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        experts_implementation=impl,
    )
    block = GptOssMLP(cfg)
    # gate_up std 0.6 makes |gate|, |up| pass the limit 7 often, so the clamps matter.
    _init(
        block,
        {
            "router.weight": 0.2,
            "router.bias": 0.2,
            "gate_up_proj_bias": 0.5,
            "gate_up_proj": 0.6,
            "down_proj_bias": 0.5,
            "down_proj": 0.1,
        },
    )
    return _FirstOutput(block), cfg


# What each family computes, read from transformers' modeling code (checked against the export).
_SWIGLU_CONCAT = {
    "activation": "SwiGLU: silu(gate) * up, silu(g) = g * sigmoid(g)",
    "swiglu_order": "gate_up_proj [E, 2I, H] concatenated: rows 0..I-1 gate, rows I..2I-1 up "
    "(chunk(2, dim=-1) of x @ W[e].T)",
    "clamp": None,
    "expert_weight_layout": "gate_up_proj [E, 2I, H], down_proj [E, H, I] (out, in): "
    "bmm(W[ids], x[..., None])",
    "biases": "none (router and experts)",
}
_RENORM = "softmax over all experts (float32), top-k, divide by the sum of the k values"
_NO_RENORM = "softmax over all experts (float32), top-k, the k softmax values as they are"


def _num_experts(cfg: Any) -> int:
    return cfg.num_local_experts if hasattr(cfg, "num_local_experts") else cfg.num_experts


def _mixtral_computes(cfg: Any) -> dict[str, Any]:
    return {
        "module": "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "router": "logits = x @ gate.weight.T (no bias)",
        "routing": _RENORM,
        "renormalised": True,
        "top_k": cfg.num_experts_per_tok,
        "num_experts": _num_experts(cfg),
        **_SWIGLU_CONCAT,
        "combine": "sum over k of routing weight * expert output",
        "shared_expert": None,
    }


def _qwen3_computes(cfg: Any) -> dict[str, Any]:
    return {
        **_mixtral_computes(cfg),
        "module": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
        "routing": _RENORM + " (norm_topk_prob=True)",
        "num_experts": cfg.num_experts,
    }


def _qwen2_computes(cfg: Any) -> dict[str, Any]:
    return {
        **_mixtral_computes(cfg),
        "module": "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "routing": _NO_RENORM + " (norm_topk_prob=False)",
        "renormalised": False,
        "num_experts": cfg.num_experts,
        "shared_expert": "sigmoid(x @ shared_expert_gate.weight.T) * "
        "down(silu(gate_proj(x)) * up_proj(x)), three bias-free Linears of intermediate "
        f"{cfg.shared_expert_intermediate_size}, added to the routed experts' sum",
    }


def _gpt_oss_computes(cfg: Any) -> dict[str, Any]:
    return {
        "module": "transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP (first output only)",
        "router": "logits = x @ router.weight.T + router.bias",
        "routing": "top-k of the logits, then softmax over the k values (= softmax, top-k, renormalise)",
        "renormalised": True,
        "top_k": cfg.num_experts_per_tok,
        "num_experts": cfg.num_local_experts,
        "activation": f"gpt-oss SwiGLU: g = min(g, {cfg.swiglu_limit}); "
        f"u = clamp(u, -{cfg.swiglu_limit}, {cfg.swiglu_limit}); "
        f"(u + 1) * g * sigmoid({cfg.swiglu_alpha} * g)",
        "swiglu_order": "interleaved: gate = gate_up[..., ::2] (even columns), up = gate_up[..., 1::2]",
        "clamp": {"gate": [None, cfg.swiglu_limit], "up": [-cfg.swiglu_limit, cfg.swiglu_limit]},
        "swiglu_alpha": cfg.swiglu_alpha,
        "swiglu_beta": 1.0,
        "expert_weight_layout": "gate_up_proj [E, H, 2I], down_proj [E, I, H] (in, out: "
        "transposed against MoE's [E, out, in]): bmm(x[:, None], W[ids])",
        "biases": "router bias [E]; gate_up_proj_bias [E, 2I] (interleaved like the weights); "
        "down_proj_bias [E, H]",
        "combine": "sum over k of routing weight * expert output",
        "shared_expert": None,
    }


def _moe_expected(cfg: Any, k: int, normalize: int, **extra: Any) -> dict[str, Any]:
    attrs = {
        "k": k,
        "normalize_routing_weights": normalize,
        "activation_type": "swiglu",
        "swiglu_fusion": 1,
        "activation_alpha": 1.0,
        "activation_beta": 0.0,
    }
    attrs.update(extra)
    return attrs


@dataclass
class Spec:
    """One export: how to build the module, how to export it, what it should fuse into."""

    name: str
    family: str
    build: Callable[[str | None], tuple[torch.nn.Module, Any]]
    impl: str | None
    exporter: str  # "dynamo", "dynamo+transformers-table" or "torchscript"
    computes: Callable[[Any], dict[str, Any]]
    expected: list[list[Any]]
    expected_attributes: Callable[[Any], dict[str, Any]] | None
    expected_note: str
    # For an export that must not fuse although it computes a MoE: the attributes of the MoE it
    # equals (checked by a hand-built node like the expected ones).
    equivalent_attributes: Callable[[Any], dict[str, Any]] | None = None
    # Ops the fused model must still hold, exactly (as sample_models/generate.py's kept_ops): the
    # router Gemm stays, as the MoE's router_probs input.
    kept_ops: list[list[Any]] = field(default_factory=list)
    # Shapes this export cannot run (recorded, checked to fail): the TorchScript loop's trap.
    failing_shapes: list[tuple[int, int, int]] = field(default_factory=list)


SPECS = [
    Spec(
        name="mixtral_batched_mm",
        family="mixtral",
        build=build_mixtral,
        impl="batched_mm",
        exporter="dynamo",
        computes=_mixtral_computes,
        expected=[["MoE", 1]],
        expected_attributes=lambda c: _moe_expected(c, c.num_experts_per_tok, 1),
        expected_note="One MoE; FC1 = gate_up_proj re-interleaved (row 2j gate j, row 2j+1 up j), "
        "FC2 = down_proj as is; router_probs = the Gemm's logits.",
        kept_ops=[["Gemm", 1]],
    ),
    Spec(
        name="qwen3_moe_batched_mm",
        family="qwen3_moe",
        build=build_qwen3,
        impl="batched_mm",
        exporter="dynamo",
        computes=_qwen3_computes,
        expected=[["MoE", 1]],
        expected_attributes=lambda c: _moe_expected(c, c.num_experts_per_tok, 1),
        expected_note="One MoE, as Mixtral's (renormalised top-k).",
        kept_ops=[["Gemm", 1]],
    ),
    Spec(
        name="qwen2_moe_batched_mm",
        family="qwen2_moe",
        build=build_qwen2,
        impl="batched_mm",
        exporter="dynamo",
        computes=_qwen2_computes,
        expected=[["MoE", 1]],
        expected_attributes=lambda c: _moe_expected(c, c.num_experts_per_tok, 0),
        expected_note="One MoE with normalize_routing_weights=0 (not renormalised: MoE only, never "
        "QMoE); the shared expert (its gate Gemm, three Gemms, two Sigmoids) stays as it is and "
        "its output is still added to the MoE's; the router Gemm stays as the MoE's router_probs.",
        kept_ops=[["Gemm", 5], ["Sigmoid", 2]],
    ),
    Spec(
        name="gpt_oss_batched_mm",
        family="gpt_oss",
        build=build_gpt_oss,
        impl="batched_mm",
        exporter="dynamo",
        computes=_gpt_oss_computes,
        expected=[["MoE", 1]],
        expected_attributes=lambda c: _moe_expected(
            c,
            c.num_experts_per_tok,
            1,
            activation_alpha=c.swiglu_alpha,
            activation_beta=1.0,
            swiglu_limit=c.swiglu_limit,
        ),
        expected_note="One MoE; FC1 = gate_up_proj transposed to [E, 2I, H] (already interleaved), "
        "fc1 bias = gate_up_proj_bias, FC2 = down_proj transposed to [E, H, I], fc2 bias = "
        "down_proj_bias; router_probs = the Gemm's logits including the router bias.",
        kept_ops=[["Gemm", 1]],
    ),
    Spec(
        name="mixtral_batched_mm_hf_table",
        family="mixtral",
        build=build_mixtral,
        impl="batched_mm",
        exporter="dynamo+transformers-table",
        computes=_mixtral_computes,
        expected=[["MoE", 1]],
        expected_attributes=lambda c: _moe_expected(c, c.num_experts_per_tok, 1),
        expected_note="As mixtral_batched_mm (same weights); only the token repeat differs: "
        "transformers' translation of repeat_interleave gives Unsqueeze/Tile/Reshape, not "
        "torchlib's Unsqueeze/Expand/Reshape.",
        kept_ops=[["Gemm", 1]],
    ),
    Spec(
        name="mixtral_grouped_mm",
        family="mixtral",
        build=build_mixtral,
        impl="grouped_mm",
        exporter="dynamo+transformers-table",
        computes=_mixtral_computes,
        expected=[],
        expected_attributes=None,
        equivalent_attributes=lambda c: _moe_expected(c, c.num_experts_per_tok, 1),
        expected_note="None for the issue's spellings: the grouped_mm form sorts the routed rows by "
        "expert (ArgSort as TopK over all rows), slices one contiguous group per expert "
        "(CumSum, Range, Gather, MatMul per expert, Concat) and un-sorts with ScatterND. It "
        "computes the same as mixtral_batched_mm (same weights), so a dedicated rule could "
        "fuse it into the same MoE; until one exists it must come out unchanged, explained.",
    ),
    Spec(
        name="mixtral_eager_torchscript",
        family="mixtral",
        build=build_mixtral,
        impl=None,
        exporter="torchscript",
        computes=_mixtral_computes,
        expected=[],
        expected_attributes=None,
        equivalent_attributes=lambda c: _moe_expected(c, c.num_experts_per_tok, 1),
        expected_note="None: the legacy exporter unrolled the eager loop once per expert hit by the "
        "example input (Split of the hit-expert list into E pieces, NonZero per expert, "
        "ScatterElements accumulation). It is input-dependent (fails in ORT when some expert is "
        "not hit, e.g. one token), so fusing it would change its meaning; leave it unchanged.",
        failing_shapes=[(1, 1, HIDDEN)],
    ),
]


# -- export --------------------------------------------------------------------------------------


def export(spec: Spec, module: torch.nn.Module, path: Path) -> None:
    """Export ``module`` with ``spec.exporter`` to ``path`` (weights inside the file)."""
    example = torch.randn(2, 16, HIDDEN, generator=torch.Generator().manual_seed(SEED + 1))
    if spec.exporter == "torchscript":
        torch.onnx.export(
            module,
            (example,),
            str(path),
            dynamo=False,
            input_names=["hidden_states"],
            output_names=["output"],
            dynamic_axes={
                "hidden_states": {0: "batch", 1: "sequence"},
                "output": {0: "batch", 1: "sequence"},
            },
        )
        return
    table = None
    if spec.exporter == "dynamo+transformers-table":
        from transformers.exporters.exporter_onnx import _ONNX_TRANSLATION_TABLE

        table = _ONNX_TRANSLATION_TABLE
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
    program = torch.onnx.export(
        module,
        (example,),
        dynamo=True,
        dynamic_shapes={"hidden_states": dims},
        input_names=["hidden_states"],
        output_names=["output"],
        custom_translation_table=table,
        verbose=False,
    )
    program.save(str(path), external_data=False)


def try_dynamo_eager(spec: Spec, module: torch.nn.Module) -> str | None:
    """The error of ``torch.onnx.export(dynamo=True)`` on the eager loop, or None if it worked."""
    example = torch.randn(2, 16, HIDDEN)
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
    noise = io.StringIO()  # torch.export prints the whole traced graph on this failure
    try:
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
            torch.onnx.export(
                module, (example,), dynamo=True, dynamic_shapes={"hidden_states": dims}
            )
    except Exception as exc:  # noqa: BLE001 (recorded, not raised)
        cause = exc.__cause__ or exc
        return f"{type(cause).__name__}: {str(cause).splitlines()[0]}"
    return None


# -- checks and records --------------------------------------------------------------------------


def ort_session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected|."""
    return float(np.abs(actual.astype(np.float64) - expected).max() / np.abs(expected).max())


def _attr_text(attr: onnx.AttributeProto) -> str:
    if attr.type in (onnx.AttributeProto.TENSOR, onnx.AttributeProto.GRAPH):
        return f"{attr.name}=<{onnx.AttributeProto.AttributeType.Name(attr.type).lower()}>"
    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, float):
        value = round(value, 6)
    return f"{attr.name}={value}"


def node_listing(model: onnx.ModelProto) -> list[str]:
    """The graph as text, one line a node: ``out = Op(in, ...) attrs``.

    Initializers show as ``name[shape]``; small constants (initializers or Constant nodes) by value.
    """
    shapes = {init.name: list(init.dims) for init in model.graph.initializer}
    small: dict[str, list[Any]] = {}
    for init in model.graph.initializer:
        if (
            init.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.FLOAT)
            and math.prod(init.dims) <= 4
        ):
            small[init.name] = onnx.numpy_helper.to_array(init).ravel().tolist()
    for node in model.graph.node:
        if (
            node.op_type == "Constant"
            and node.attribute
            and node.attribute[0].type == onnx.AttributeProto.TENSOR
        ):
            arr = onnx.numpy_helper.to_array(node.attribute[0].t)
            if arr.size <= 4:
                small[node.output[0]] = arr.ravel().tolist()

    def arg(name: str) -> str:
        if name in small:
            vals = small[name]
            vals = [round(v, 6) if isinstance(v, float) else v for v in vals]
            return f"{name}={vals}"
        if name in shapes:
            return f"{name}{shapes[name]}"
        return name

    lines = []
    for node in model.graph.node:
        if node.op_type == "Constant":
            continue
        attrs = " ".join(_attr_text(a) for a in node.attribute)
        domain = f"{node.domain}." if node.domain not in ("", "ai.onnx") else ""
        ins = ", ".join(arg(i) for i in node.input)
        outs = ", ".join(node.output)
        lines.append(f"{outs} = {domain}{node.op_type}({ins}) {attrs}".rstrip())
    return lines


def io_record(values: Any) -> list[dict[str, Any]]:
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_param if d.HasField("dim_param") else d.dim_value for d in t.shape.dim]
        out.append(
            {"name": v.name, "dtype": onnx.TensorProto.DataType.Name(t.elem_type), "shape": dims}
        )
    return out


def spellings(model: onnx.ModelProto) -> dict[str, Any]:
    """The op spellings of the MoE parts, read off the graph (what a rule must match)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name: i for i in model.graph.initializer}
    consts = {
        n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t)
        for n in model.graph.node
        if n.op_type == "Constant"
        and n.attribute
        and n.attribute[0].type == onnx.AttributeProto.TENSOR
    }

    def const(name: str) -> Any:
        if name in inits:
            return onnx.numpy_helper.to_array(inits[name]).tolist()
        if name in consts:
            return consts[name].tolist()
        return None

    def chain(name: str, depth: int = 3) -> str:
        node = producers.get(name)
        if node is None or depth == 0:
            return "initializer" if name in inits else ("input" if name else "")
        return f"{node.op_type}({chain(node.input[0], depth - 1)})" if node.input else node.op_type

    rec: dict[str, Any] = {}
    rec["router"] = sorted(
        {
            f"{producers[n.input[0]].op_type} -> {n.op_type}"
            for n in model.graph.node
            if n.op_type in ("Softmax", "TopK") and n.input[0] in producers
        }
    )
    rec["stacked_weight_consumers"] = sorted(
        {
            f"{n.op_type}({i}{list(inits[i].dims)})"
            for n in model.graph.node
            for i in n.input
            if i in inits
            and inits[i].data_type == onnx.TensorProto.FLOAT
            and len(inits[i].dims) == 3
        }
    )
    rec["gemms"] = [
        f"Gemm({', '.join(n.input)}) " + " ".join(_attr_text(a) for a in n.attribute)
        for n in model.graph.node
        if n.op_type == "Gemm"
    ]
    rec["matmuls"] = [
        f"MatMul({chain(n.input[0], 1)}, {chain(n.input[1], 1)})"
        for n in model.graph.node
        if n.op_type == "MatMul"
    ]
    rec["splits"] = [
        "Split(" + chain(n.input[0], 1) + ") " + " ".join(_attr_text(a) for a in n.attribute)
        for n in model.graph.node
        if n.op_type == "Split"
    ]
    rec["slices"] = [
        {
            "starts": const(n.input[1]),
            "ends": const(n.input[2]),
            "axes": const(n.input[3]) if len(n.input) > 3 else None,
            "steps": const(n.input[4]) if len(n.input) > 4 else None,
        }
        for n in model.graph.node
        if n.op_type == "Slice"
    ]
    rec["clips"] = [
        {
            "min": const(n.input[1]) if len(n.input) > 1 and n.input[1] else None,
            "max": const(n.input[2]) if len(n.input) > 2 and n.input[2] else None,
        }
        for n in model.graph.node
        if n.op_type == "Clip"
    ]
    rec["repeat_tokens"] = [
        chain(n.output[0], 3) for n in model.graph.node if n.op_type in ("Expand", "Tile")
    ]
    return rec


def versions() -> dict[str, str]:
    import onnxscript

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def run_spec(spec: Spec, out_dir: Path) -> dict[str, Any]:
    torch.manual_seed(SEED)
    module, cfg = spec.build(spec.impl)
    module.eval()
    path = out_dir / f"{spec.name}.onnx"
    with torch.no_grad():
        export(spec, module, path)
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise RuntimeError(f"{path.name} is {size} bytes, over {MAX_FILE_BYTES}")

    session = ort_session(path)
    gen = torch.Generator().manual_seed(SEED + 2)

    def compare(shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, float]:
        x = torch.randn(*shape, generator=gen)
        with torch.no_grad():
            want = module(x).numpy()
        got = session.run(None, {"hidden_states": x.numpy()})[0]
        assert got.shape == want.shape, (got.shape, want.shape)
        return x.numpy(), want, rel_err(got, want)

    ref_x, ref_y, ref_err = compare(REF_SHAPE)
    np.savez_compressed(out_dir / f"{spec.name}.npz", hidden_states=ref_x, output=ref_y)
    checks = {"x".join(map(str, REF_SHAPE)): ref_err}
    for shape in CHECK_SHAPES:
        if shape in spec.failing_shapes:
            continue
        checks["x".join(map(str, shape))] = compare(shape)[2]
    failures = {}
    for shape in spec.failing_shapes:
        try:
            compare(shape)
        except Exception as exc:  # noqa: BLE001 (the expected failure is the record)
            failures["x".join(map(str, shape))] = str(exc).splitlines()[0][:300]
        else:
            raise RuntimeError(f"{spec.name}: expected {shape} to fail in ORT, it ran")

    extra: dict[str, Any] = {}
    if spec.family == "gpt_oss":
        extra["clamp_active_fraction_on_reference"] = _gpt_oss_clamp_fraction(module, ref_x, cfg)

    if spec.expected_attributes is not None:
        extra["expected_fusion_check"] = expected_moe_check(
            spec.expected_attributes(cfg), module, ref_x
        )
    if spec.equivalent_attributes is not None:
        extra["equivalent_moe_attributes"] = spec.equivalent_attributes(cfg)
        extra["equivalent_moe_check"] = expected_moe_check(
            spec.equivalent_attributes(cfg), module, ref_x
        )

    hist = collections.Counter(n.op_type for n in model.graph.node)
    record = {
        "name": spec.name,
        "file": path.name,
        "file_bytes": size,
        "family": spec.family,
        "exporter": {
            "dynamo": "torch.onnx.export(module, (x,), dynamo=True, dynamic_shapes=...) (optimize=True, default opset)",
            "dynamo+transformers-table": "torch.onnx.export(..., dynamo=True, custom_translation_table="
            "transformers.exporters.exporter_onnx._ONNX_TRANSLATION_TABLE)",
            "torchscript": "torch.onnx.export(..., dynamo=False, dynamic_axes=...) (legacy TorchScript exporter)",
        }[spec.exporter],
        "exporter_kind": spec.exporter,
        "experts_implementation": spec.impl or "eager (config._experts_implementation unset)",
        "versions": versions(),
        "seed": SEED,
        "config_class": type(cfg).__name__,
        "config": _jsonable(cfg.to_diff_dict()),
        "opset_import": {(o.domain or "ai.onnx"): o.version for o in model.opset_import},
        "inputs": io_record(model.graph.input),
        "outputs": io_record(model.graph.output),
        "initializers": {
            i.name: list(i.dims) for i in model.graph.initializer if math.prod(i.dims) > 4
        },
        "computes": spec.computes(cfg),
        "expected": spec.expected,
        "expected_attributes": spec.expected_attributes(cfg) if spec.expected_attributes else None,
        "expected_note": spec.expected_note,
        "kept_ops": spec.kept_ops,
        "reference": {
            "file": f"{spec.name}.npz",
            "input": {"name": "hidden_states", "shape": list(REF_SHAPE), "dtype": "float32"},
            "output": {"name": "output", "shape": list(ref_y.shape), "dtype": "float32"},
        },
        "ort_vs_torch_max_rel_err": checks,
        "ort_fails_on": failures,
        **extra,
        "op_histogram": dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))),
        "node_count": len(model.graph.node),
        "spellings": spellings(model),
        "nodes": node_listing(model),
    }
    (out_dir / f"{spec.name}.json").write_text(
        json.dumps(record, indent=2) + "\n", encoding="utf-8"
    )
    return record


def _gpt_oss_clamp_fraction(module: torch.nn.Module, x: np.ndarray, cfg: Any) -> dict[str, float]:
    """How often the reference input's routed gate/up values pass the limit (the clamps matter)."""
    experts = module.block.experts
    with torch.no_grad():
        h = torch.from_numpy(x).reshape(-1, HIDDEN)
        _, _, idx = module.block.router(h)
        rows = h.repeat_interleave(idx.shape[1], dim=0)
        ids = idx.reshape(-1)
        gate_up = (
            torch.bmm(rows[:, None], experts.gate_up_proj[ids]).squeeze(1)
            + experts.gate_up_proj_bias[ids]
        )
        gate, up = gate_up[:, ::2], gate_up[:, 1::2]
    lim = cfg.swiglu_limit
    return {
        "gate_above_limit": float((gate > lim).float().mean()),
        "up_outside_limit": float((up.abs() > lim).float().mean()),
    }


def expected_moe_check(
    attrs: dict[str, Any], module: torch.nn.Module, x: np.ndarray
) -> dict[str, Any]:
    """Check a MoE with ``attrs`` computes the module's routed experts.

    Builds one ``com.microsoft.MoE`` node by hand from the module's weights and runs it in ORT CPU
    against the routed experts' PyTorch output, so the expected attributes and weight layout are
    right. (Not a rule: the fuser must find all of this in the graph.)
    """
    from onnx import TensorProto, helper

    block = module.block if isinstance(module, _FirstOutput) else module
    router = block.router if hasattr(block, "router") else block.gate
    experts = block.experts
    with torch.no_grad():
        h = torch.from_numpy(x).reshape(-1, HIDDEN)
        logits, top_w, top_i = router(h)
        want = experts(h, top_i, top_w).numpy()
        if getattr(experts, "is_transposed", False):  # gpt-oss: [E, in, out], interleaved
            fc1 = experts.gate_up_proj.transpose(1, 2).numpy()
            fc2 = experts.down_proj.transpose(1, 2).numpy()
            fc1_bias = experts.gate_up_proj_bias.numpy()
            fc2_bias = experts.down_proj_bias.numpy()
        else:  # [E, out, in], [gate; up] halves: interleave rows (2j gate j, 2j+1 up j)
            gate_up = experts.gate_up_proj.numpy()
            inter = gate_up.shape[1] // 2
            fc1 = np.empty_like(gate_up)
            fc1[:, 0::2], fc1[:, 1::2] = gate_up[:, :inter], gate_up[:, inter:]
            fc2 = experts.down_proj.numpy()
            fc1_bias = fc2_bias = None
    inits = [
        onnx.numpy_helper.from_array(np.ascontiguousarray(fc1), "fc1"),
        onnx.numpy_helper.from_array(np.ascontiguousarray(fc2), "fc2"),
    ]
    if fc1_bias is not None:
        inits += [
            onnx.numpy_helper.from_array(fc1_bias, "fc1_bias"),
            onnx.numpy_helper.from_array(fc2_bias, "fc2_bias"),
        ]
    names = ["input", "router_probs", "fc1", "fc1_bias" if fc1_bias is not None else "", "fc2"]
    names += ["fc2_bias"] if fc2_bias is not None else []
    node = helper.make_node("MoE", names, ["output"], domain="com.microsoft", **attrs)
    tokens, n_exp = logits.shape
    graph = helper.make_graph(
        [node],
        "expected_moe",
        [
            helper.make_tensor_value_info("input", TensorProto.FLOAT, [tokens, HIDDEN]),
            helper.make_tensor_value_info("router_probs", TensorProto.FLOAT, [tokens, n_exp]),
        ],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [tokens, HIDDEN])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    )
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input": h.numpy(), "router_probs": logits.numpy()})[0]
    return {
        "what": "one hand-built com.microsoft.MoE with expected_attributes, router_probs = the router's "
        "logits, run in ORT CPU on the reference input, against the routed experts' PyTorch output "
        "(without any shared expert)",
        "max_rel_err": rel_err(got, want),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="export only these")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    names = [s.name for s in SPECS]
    unknown = [n for n in args.only or [] if n not in names]
    if unknown:
        parser.error(f"unknown model(s): {', '.join(unknown)}; known: {', '.join(names)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    entries = []
    for spec in SPECS:
        if args.only and spec.name not in args.only:
            continue
        print(f"== {spec.name}", flush=True)
        try:
            rec = run_spec(spec, args.out_dir)
        except Exception:
            traceback.print_exc()
            return 1
        print(
            f"   {rec['file_bytes']} bytes, {rec['node_count']} nodes, errors {rec['ort_vs_torch_max_rel_err']}"
        )
        entries.append(
            {
                k: rec[k]
                for k in (
                    "name",
                    "file",
                    "family",
                    "experts_implementation",
                    "expected",
                    "file_bytes",
                )
            }
        )

    failed = []
    if not args.only:
        # The eager loop through the dynamo exporter: recorded as it fails.
        torch.manual_seed(SEED)
        module, _ = build_mixtral(None)
        err = try_dynamo_eager(SPECS[0], module.eval())
        failed.append(
            {
                "name": "mixtral_eager_dynamo",
                "what": "torch.onnx.export(MixtralSparseMoeBlock, dynamo=True) with the eager experts loop",
                "error": err or "(exported: this record is stale, update the script)",
            }
        )
        index = {
            "generator": "sample_models/export_transformers.py",
            "versions": versions(),
            "models": entries,
            "failed_exports": failed,
        }
        # export_causal_lm.py's pointer to its own index (causal_lm/index.json): kept.
        old_path = args.out_dir / "index.json"
        if old_path.exists():
            old_index = json.loads(old_path.read_text(encoding="utf-8"))
            if "causal_lm" in old_index:
                index["causal_lm"] = old_index["causal_lm"]
        (args.out_dir / "index.json").write_text(
            json.dumps(index, indent=2) + "\n", encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
