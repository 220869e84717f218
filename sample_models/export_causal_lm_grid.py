"""The export grid of ``export_causal_lm.py`` and what each variant's record expects.

:class:`Variant` is one export of one family (experts implementation, dynamic or static shapes,
opset, dtype); :func:`variants` is a family's grid and :func:`priority` its order across
families; :func:`expected_record` says what a correct fuser does with each decoder layer of a
variant, for the default target ort-cpu and for ort-cuda, from the family's modeling code and
the kernels each target has per dtype (not from what the fuser does). Split out of
``export_causal_lm.py``, which builds, exports and checks the models.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
from export_causal_lm_families import Family

__all__ = [
    "BF16_OPSET",
    "DTYPE_TAIL",
    "HALF_OPSET18",
    "Variant",
    "expected_record",
    "priority",
    "variants",
]

#: The file-name tail of each half-precision dtype.
DTYPE_TAIL = {"float32": "", "float16": "_fp16", "bfloat16": "_bf16"}
#: The families also exported in float16 and bfloat16 at opset 18 (dynamic, batched_mm): one of
#: each router kind the fuser meets in half precision (softmax top-k renormalised, upcast before
#: or after the softmax; top-k then softmax with clamped SwiGLU and biases; DeepSeek-V3's
#: sigmoid group-limited top-k).
HALF_OPSET18 = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3")
#: Families whose bfloat16 export cannot be typed at opset 18: their router's TopK reads
#: bfloat16 (TopK takes bfloat16 from opset 24 on), or a ConstantOfShape makes bfloat16 (from
#: opset 20); measured, ``onnx.checker`` full check: "X typestr: T, has unsupported type:
#: tensor(bfloat16)". They are exported at opset 24 instead.
BF16_OPSET = {"gpt_oss": 24, "deepseek_v3": 24}


@dataclass(frozen=True)
class Variant:
    """One export of one family."""

    family: Family
    impl: str  # "batched_mm" or "grouped_mm" (ignored by families that do not dispatch)
    dynamic: bool
    opset: int
    dtype: str  # "float32", "float16" or "bfloat16"

    @property
    def name(self) -> str:
        """``<family>_<impl>_<dynamic|static>_op<opset>[_fp16|_bf16]``."""
        impl = self.impl if self.family.dispatches_experts else self.family.experts_tag
        shape = "dynamic" if self.dynamic else "static"
        return f"{self.family.name}_{impl}_{shape}_op{self.opset}{DTYPE_TAIL[self.dtype]}"


def priority(variant: Variant) -> int:
    """Export order: the most telling variants of every family first (a slow run stops early)."""
    tiers = [
        ("batched_mm", True, 18, "float32"),
        ("grouped_mm", True, 18, "float32"),
        ("batched_mm", True, 23, "float16"),
        ("batched_mm", False, 18, "float32"),
        ("batched_mm", True, 23, "float32"),
        ("grouped_mm", False, 18, "float32"),
        ("grouped_mm", True, 23, "float32"),
        ("batched_mm", False, 23, "float32"),
        ("grouped_mm", False, 23, "float32"),
        ("grouped_mm", True, 23, "float16"),
        ("batched_mm", False, 23, "float16"),
        ("batched_mm", True, 18, "float16"),
        ("batched_mm", True, 18, "bfloat16"),
        ("batched_mm", True, 24, "bfloat16"),
    ]
    return tiers.index((variant.impl, variant.dynamic, variant.opset, variant.dtype))


def variants(family: Family) -> list[Variant]:
    """Every export of ``family``: the float32 grid, plus float16 opset 23 (dynamic, or static too).

    The families of :data:`HALF_OPSET18` also in float16 and bfloat16 at opset 18 (bfloat16 at
    :data:`BF16_OPSET` where opset 18 cannot type it).
    """
    impls = ["batched_mm", "grouped_mm"] if family.dispatches_experts else ["batched_mm"]
    out = [
        Variant(family, impl, dynamic, opset, "float32")
        for impl in impls
        for dynamic in (True, False)
        for opset in (18, 23)
    ]
    out += [Variant(family, impl, True, 23, "float16") for impl in impls]
    if family.static_fp16:
        out.append(Variant(family, "batched_mm", False, 23, "float16"))
    if family.name in HALF_OPSET18:
        out.append(Variant(family, "batched_mm", True, 18, "float16"))
        out.append(Variant(family, "batched_mm", True, BF16_OPSET.get(family.name, 18), "bfloat16"))
    return out


#: The fused ops' kernels per (target, dtype) the records state outcomes for, as measured
#: (``scripts/measure_half_kernels.py``; ``fuser/contract/targets.py`` is the fuser's copy):
#: ORT 1.32 CPU has no bfloat16 MoE; ORT CUDA registers MoE for float, float16 and bfloat16.
_NO_KERNEL = {("ort-cpu", "bfloat16"): "ort-cpu has no bfloat16 MoE kernel (ORT 1.32 CPU)"}


def _layer_outcome(family: Family, cfg: Any, dtype: str, target: str) -> dict[str, Any]:
    """What a correct fuser does with one MoE layer of ``family`` in ``dtype`` for ``target``.

    A half-precision layer fuses in its own dtype where the target has the kernel, fed as its
    selection and weights (the model's own experts per token, whatever the rounding of its
    router): its routing attributes are the construction's, so only the layer's own (k, the
    activation, its constants as the export rounds them) are pinned; where the target has no
    kernel it is refused naming the target.
    """
    outcome = family.expected_layer(cfg)
    if dtype == "float32" or outcome["outcome"] != "MoE":
        return outcome
    if (target, dtype) in _NO_KERNEL:
        return {"outcome": "refused", "refusal_names": "target", "why": _NO_KERNEL[(target, dtype)]}
    attrs = {k: v for k, v in outcome["attributes"].items() if k != "normalize_routing_weights"}
    for name in ("activation_alpha", "activation_beta", "swiglu_limit"):
        if name in attrs:  # the export holds the constant in its dtype (1.702 -> 1.7021484375)
            attrs[name] = float(torch.tensor(attrs[name], dtype=getattr(torch, dtype)).item())
    return {"outcome": "MoE", "attributes": attrs}


def expected_record(family: Family, cfg: Any, layers: list[tuple[int, str]], dtype: str) -> Any:
    """What a correct fuser does with each layer: records for the default target, and CUDA.

    ``expected`` (fused ops, ``[[op, count]]``) and ``expected_layers`` (per decoder layer) for
    ort-cpu; ``expected_ort_cuda`` (``[[op, count]]``) for ort-cuda (kept for half precision).
    """
    per_layer = []
    cuda = collections.Counter()
    for index, block in layers:
        if not block:
            per_layer.append({"layer": index, "block": "dense MLP", "outcome": "no MoE"})
            continue
        outcome = _layer_outcome(family, cfg, dtype, "ort-cpu")
        per_layer.append({"layer": index, "block": block, **outcome})
        if _layer_outcome(family, cfg, dtype, "ort-cuda")["outcome"] == "MoE":
            cuda["MoE"] += 1
    fused = collections.Counter(e["outcome"] for e in per_layer if e["outcome"] == "MoE")
    expected = [[op, n] for op, n in sorted(fused.items())]
    return expected, per_layer, [[op, n] for op, n in sorted(cuda.items())]
