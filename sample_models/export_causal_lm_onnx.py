"""The torch.onnx side of ``export_causal_lm.py``: one export call, and its opset-23 faults.

``export`` runs ``torch.onnx.export(..., dynamo=True)`` for one variant (transformers'
translation table for ``grouped_mm``), saves the model with its weights inside and drops
torch.onnx's per-node provenance. Two of onnxscript's opset-23 fusions, which torch.onnx runs
by default, can make a model ORT rejects; ``broken_fusion`` names the one that did, and
``export(..., off=...)`` exports again with it turned off. A family whose modeling code has no
ONNX translation at all names an export patch (``PATCHES``: the same arithmetic in other torch
ops), used only when the plain export fails (``export(..., patch=...)``).
"""

from __future__ import annotations

import contextlib
import importlib
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import torch

if TYPE_CHECKING:
    from export_causal_lm_grid import Variant


# -- export --------------------------------------------------------------------------------------


# onnxscript's opset-23 fusions that torch.onnx.export runs (``optimize=True``) and that can give
# a model ORT rejects; each is turned off only for the export it broke (see ``run_variant``).
#
# - ``RotaryEmbedding23Fusion`` (``onnxscript/rewriter/rules/fusion/_rotary_embedding.py``) fuses
#   transformers' rotate-half into ``RotaryEmbedding(x, cos, sin)`` with the cos/sin cache of
#   ``position_ids`` ``[1, S]``, so the cache has batch 1; ONNX's RotaryEmbedding (without
#   ``position_ids``) wants ``[B, S, D/2]`` and ORT rejects batch > 1.
# - the RMSNormalization fusion (``_rms_normalization.py``) fuses the float16 RMSNorms that upcast
#   their weight (gpt-oss: ``(weight.float() * norm(x.float())).half()``; Qwen3-Next:
#   ``norm(x.float()) * (1 + weight.float())``) into ``RMSNormalization(x16, weight32)`` typed
#   float16, where ONNX makes Y the scale's type: an invalid model ORT refuses to load.
OPSET23_FUSIONS = {
    "RotaryEmbedding": ("_rotary_embedding", "fuse_rotary_embedding"),
    "RMSNormalization": ("_rms_normalization", "fuse_rms_normalization"),
}


@contextlib.contextmanager
def fusions_off(names: tuple[str, ...]) -> Any:
    """Turn off the named ``OPSET23_FUSIONS`` inside ``torch.onnx.export``; the rest runs."""
    patched = []
    for name in names:
        module_name, func = OPSET23_FUSIONS[name]
        module = importlib.import_module(f"onnxscript.rewriter.rules.fusion.{module_name}")
        patched.append((module, func, getattr(module, func)))
        setattr(module, func, lambda model, debug=False: 0)
    try:
        yield
    finally:
        for module, func, original in patched:
            setattr(module, func, original)


# -- export patches ------------------------------------------------------------------------------


def _real_rotary_forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``DeepseekV2RotaryEmbedding.forward`` with ``(cos, sin)`` stacked last, not a complex."""
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.stack((freqs.cos(), freqs.sin()), dim=-1) * self.attention_scaling


def _real_apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_emb`` of DeepSeek-V2: each (even, odd) pair times ``cos + i sin``, in reals."""
    freqs = freqs_cis.unsqueeze(1).to(xq.device)  # [B, 1, S, D/2, 2]
    cos, sin = freqs[..., 0], freqs[..., 1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)
        re, im = pairs[..., 0], pairs[..., 1]
        out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1)
        return out.flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


@contextlib.contextmanager
def _deepseek_v2_real_rotary() -> Any:
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as mod

    saved = mod.DeepseekV2RotaryEmbedding.forward, mod.apply_rotary_emb
    mod.DeepseekV2RotaryEmbedding.forward = _real_rotary_forward
    mod.apply_rotary_emb = _real_apply_rotary_emb
    try:
        yield
    finally:
        mod.DeepseekV2RotaryEmbedding.forward, mod.apply_rotary_emb = saved


def _real_apply_rotary_emb_llama4(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama4's ``apply_rotary_emb`` in reals: its x is ``[B, S, heads, D]`` (heads after S)."""
    freqs = freqs_cis[:, :, None].to(xq.device)  # [B, S, 1, D/2, 2]
    cos, sin = freqs[..., 0], freqs[..., 1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)
        re, im = pairs[..., 0], pairs[..., 1]
        out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1)
        return out.flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


@contextlib.contextmanager
def _llama4_real_rotary() -> Any:
    from transformers.models.llama4 import modeling_llama4 as mod

    saved = mod.Llama4TextRotaryEmbedding.forward, mod.apply_rotary_emb
    mod.Llama4TextRotaryEmbedding.forward = _real_rotary_forward
    mod.apply_rotary_emb = _real_apply_rotary_emb_llama4
    try:
        yield
    finally:
        mod.Llama4TextRotaryEmbedding.forward, mod.apply_rotary_emb = saved


# Export patches by name (``Family.export_patch``): what each does, and its context manager.
# Each is active inside ``torch.onnx.export`` only; the PyTorch reference the export is checked
# against is the unpatched model, so the check also shows that the patch computes the same.
#
# - ``deepseek_v2_real_rotary``: DeepSeek-V2's rotary embedding is complex
#   (``torch.polar`` for the frequencies, ``torch.view_as_complex`` of (even, odd) pairs), which
#   torch.onnx cannot translate ("No decompositions registered for the complex-valued input", as
#   Llama4's). The patch computes the same product with real tensors: ``(cos, sin)`` stacked
#   last, ``(a, b) -> (a cos - b sin, a sin + b cos)``, flattened back to interleaved pairs.
# - ``llama4_real_rotary``: the same for Llama4, whose query/key are ``[B, S, heads, D]``.
PATCHES = {
    "llama4_real_rotary": (
        "Llama4's complex rotary embedding (torch.polar, view_as_complex) computed with real "
        "tensors inside torch.onnx.export (export_causal_lm_onnx.PATCHES), heads after the "
        "sequence axis; the MoE layers are untouched",
        _llama4_real_rotary,
    ),
    "deepseek_v2_real_rotary": (
        "DeepSeek-V2's complex rotary embedding (torch.polar, view_as_complex) computed with "
        "real tensors inside torch.onnx.export (export_causal_lm_onnx.PATCHES); the MoE layers "
        "are untouched",
        _deepseek_v2_real_rotary,
    ),
}


@contextlib.contextmanager
def patched(name: str | None) -> Any:
    """The export patch ``name`` (``PATCHES``) in force; nothing when ``name`` is None."""
    if name is None:
        yield
        return
    with PATCHES[name][1]():
        yield


def broken_fusion(path: Path, exc: Exception) -> str | None:
    """Which of ``OPSET23_FUSIONS`` made the export at ``path`` fail as ``exc``, if one did."""
    if "RotaryEmbedding" in str(exc):
        return "RotaryEmbedding"
    try:
        onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as invalid:
        if "op_type:RMSNormalization" in str(invalid):
            return "RMSNormalization"
    return None


def export(
    variant: Variant,
    module: torch.nn.Module,
    ids: torch.Tensor,
    path: Path,
    off: tuple[str, ...] = (),
    patch: str | None = None,
) -> str:
    """Export ``module`` to ``path``; returns the call, in words, for the record.

    ``off``: onnxscript fusions turned off (:func:`fusions_off`); ``patch``: an export patch
    (:data:`PATCHES`) in force during the export.
    """
    table = None
    if variant.family.dispatches_experts and variant.impl == "grouped_mm":
        from transformers.exporters.exporter_onnx import _ONNX_TRANSLATION_TABLE

        table = _ONNX_TRANSLATION_TABLE
    dynamic_shapes = None
    if variant.dynamic:
        dynamic_shapes = {
            "input_ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
        }
    noise = io.StringIO()  # torch.export prints whole graphs on some failures
    with contextlib.redirect_stdout(noise), torch.no_grad(), fusions_off(off), patched(patch):
        program = torch.onnx.export(
            module,
            (ids,),
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            input_names=["input_ids"],
            output_names=["logits"],
            opset_version=variant.opset,
            custom_translation_table=table,
            verbose=False,
        )
    program.save(str(path), external_data=False)
    _strip_provenance(path)
    call = f"torch.onnx.export(model, (input_ids,), dynamo=True, opset_version={variant.opset}"
    if variant.dynamic:
        call += ", dynamic_shapes={'input_ids': {0: Dim('batch'), 1: Dim('sequence')}}"
    if table is not None:
        call += (
            ", custom_translation_table=transformers.exporters.exporter_onnx."
            "_ONNX_TRANSLATION_TABLE"
        )
    call += ")"
    if off:
        call += f" with onnxscript's {' and '.join(off)} fusion off (export_causal_lm.fusions_off)"
    if patch is not None:
        call += f" with the export patch {patch} (export_causal_lm_onnx.PATCHES)"
    return call


def _strip_provenance(path: Path) -> None:
    """Drop torch.onnx's per-node provenance (``metadata_props``), which means nothing to ONNX.

    ``namespace``, ``pkg.torch.onnx.class_hierarchy`` / ``fx_node`` / ``stack_trace`` are over
    half of a file this small; dropping them keeps the whole set small enough to commit.
    """
    model = onnx.load(str(path))
    for graph in [model.graph, *model.functions]:
        for node in graph.node:
            del node.metadata_props[:]
    onnx.save(model, str(path))


def first_line(exc: BaseException) -> str:
    """The exception's type and first line (its cause's, when torch.onnx wraps it)."""
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0][:400] if text else ''}"
