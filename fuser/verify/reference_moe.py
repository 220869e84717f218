"""The reference path's ``com.microsoft.MoE`` and ``QMoE``: ORT nodes through the numpy oracles.

Each ``OpRun`` reads its node's inputs by name at the positions of
:mod:`onnx_moe_fuse.contract.ops` (``onnx.reference`` hands them over by position, an absent
optional one as None) and its attributes over ORT's defaults from the same contract, then calls
:func:`onnx_moe_fuse.verify.oracles.moe.moe` or :func:`~onnx_moe_fuse.verify.oracles.moe.qmoe`.
QMoE's zero-point inputs (11, 12) go to the oracle in ORT's packed layout; ``router_weights`` (input 14) goes to the oracle (selection by ``router_probs``, mixing
by the gathered ``router_weights``); FC3, the sparse mixer and the FP4/FP8 extras are refused
with ``NotImplementedError``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from onnx.reference.op_run import OpRun

from onnx_moe_fuse.contract.ops import MOE, MS_DOMAIN, QMOE
from onnx_moe_fuse.verify.kernel_specs import text_value
from onnx_moe_fuse.verify.nodes import not_supported
from onnx_moe_fuse.verify.oracles.moe import moe, qmoe

__all__ = ["MoE", "QMoE", "run_qmoe", "swiglu_limit"]


def swiglu_limit(value: float | None) -> float | None:
    """ORT's ``swiglu_limit``: absent or infinite means no clamp."""
    if value is None or math.isinf(value):
        return None
    return float(value)


def _refuse(op: str, what: str) -> NotImplementedError:
    return not_supported(f"{MS_DOMAIN}.{op}", what)


class MoE(OpRun):
    """ORT ``com.microsoft.MoE`` through the numpy oracle (inputs at ORT's positions)."""

    op_domain = MS_DOMAIN

    def _run(self, *inputs: np.ndarray | None, **attrs: Any) -> tuple[np.ndarray]:
        x = MOE.named_inputs(inputs)
        a = MOE.checked_attributes(attrs)
        if x["fc2_experts_weights"] is None:
            raise ValueError(
                f"{MOE.qualified_name}: fc2_experts_weights "
                f"(input {MOE.index('fc2_experts_weights')}) is required"
            )
        if a["use_sparse_mixer"]:
            raise _refuse("MoE", "use_sparse_mixer=1")
        if a["swiglu_limit_after_activation"]:
            raise _refuse("MoE", "swiglu_limit_after_activation=1")
        tokens = x["input"]
        out = moe(
            tokens,
            x["router_probs"],
            x["fc1_experts_weights"],
            x["fc2_experts_weights"],
            fc1_bias=x["fc1_experts_bias"],
            fc2_bias=x["fc2_experts_bias"],
            fc3=x["fc3_experts_weights"],
            fc3_bias=x["fc3_experts_bias"],
            k=int(a["k"]),
            activation_type=text_value(a["activation_type"]),
            swiglu_fusion=int(a["swiglu_fusion"]),
            normalize_routing_weights=int(a["normalize_routing_weights"]),
            activation_alpha=float(a["activation_alpha"]),
            activation_beta=float(a["activation_beta"]),
            swiglu_limit=swiglu_limit(a.get("swiglu_limit")),
        )
        return (out.astype(tokens.dtype, copy=False),)


#: QMoE's inputs past ``router_weights``: the FP4/FP8 global and activation scales.
_QMOE_FP_EXTRAS = QMOE.input_names[QMOE.index("router_weights") + 1 :]


class QMoE(OpRun):
    """ORT ``com.microsoft.QMoE`` through the numpy oracle (inputs at ORT's positions)."""

    op_domain = MS_DOMAIN

    def _run(self, *inputs: np.ndarray | None, **attrs: Any) -> tuple[np.ndarray]:
        return run_qmoe(inputs, attrs)


def run_qmoe(inputs: Any, attrs: dict[str, Any]) -> tuple[np.ndarray]:
    """One QMoE node's output from its inputs (ORT's positions) and attributes, by the oracle.

    What :class:`QMoE` runs; the wgpu evaluator calls it too for a node its kernel cannot take
    (asymmetric zero points), and says so in its report.
    """
    x = QMOE.named_inputs(inputs)
    a = QMOE.checked_attributes(attrs)  # accuracy_level: ORT numerics only; this is exact
    if any(x[n] is None for n in ("fc2_experts_weights", "fc1_scales", "fc2_scales")):
        raise ValueError(f"{QMOE.qualified_name}: fc1/fc2 weights and scales are required")
    if any(x[n] is not None for n in ("fc3_experts_weights", "fc3_scales", "fc3_zero_points")):
        raise _refuse("QMoE", "FC3")
    if x["fc3_experts_bias"] is not None:
        raise _refuse("QMoE", "fc3_experts_bias")
    if any(x[n] is not None for n in _QMOE_FP_EXTRAS):
        raise _refuse("QMoE", f"FP4/FP8 inputs ({QMOE.index(_QMOE_FP_EXTRAS[0])}+)")
    if a["use_sparse_mixer"]:
        raise _refuse("QMoE", "use_sparse_mixer=1")
    if a["swiglu_limit_after_activation"]:
        raise _refuse("QMoE", "swiglu_limit_after_activation=1")
    quant_type = text_value(a["quant_type"])
    if quant_type != "int":
        raise _refuse("QMoE", f"quant_type={quant_type!r}")
    if a["weights_prepacked"] == 1:
        raise _refuse("QMoE", "weights_prepacked=1")
    bits = int(a["expert_weight_bits"])
    for name in ("fc1", "fc2"):  # fc3's width means nothing without FC3 (refused above)
        b = a.get(f"{name}_expert_weight_bits")
        if b is not None and int(b) != bits:
            raise _refuse("QMoE", f"{name}_expert_weight_bits={b} != expert_weight_bits={bits}")
    block_size = a.get("block_size")
    tokens = x["input"]
    out = qmoe(
        tokens,
        x["router_probs"],
        x["fc1_experts_weights"],
        x["fc1_scales"],
        x["fc2_experts_weights"],
        x["fc2_scales"],
        k=int(a["k"]),
        activation_type=text_value(a["activation_type"]),
        expert_weight_bits=bits,
        block_size=int(block_size) if block_size else None,
        swiglu_fusion=int(a["swiglu_fusion"]),
        activation_alpha=float(a["activation_alpha"]),
        activation_beta=float(a["activation_beta"]),
        swiglu_limit=swiglu_limit(a.get("swiglu_limit")),
        fc1_bias=x["fc1_experts_bias"],
        fc2_bias=x["fc2_experts_bias"],
        normalize_routing_weights=int(a["normalize_routing_weights"]),
        router_weights=x["router_weights"],
        fc1_zero_points=x["fc1_zero_points"],
        fc2_zero_points=x["fc2_zero_points"],
    )
    return (out.astype(tokens.dtype, copy=False),)
