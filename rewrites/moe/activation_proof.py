"""Proof step 5: the activation (relu, tanh gelu, silu, identity, SwiGLU) and the quantization granularity.

:func:`activation_step`: the activation, FC1's columns in the fused node's order and (alpha,
beta, limit). SwiGLU: which FC1 columns are the gate and the linear operand (any Slice/Split),
the clamp limit, alpha and beta; exact (Erf) GELU is refused; an activation no spelling matched
(kind ``behaviour``) is proved by probing (:mod:`.behaviour.activation`). :func:`_granularity` proves one bit width and
one block size for a QMoE.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import (
    attr_float,
    attr_int,
    attr_str,
    const_float,
    const_ints,
    label,
    normalize_axes,
    value_label,
)
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.moe.behaviour.activation import prove_activation
from onnx_moe_fuse.rewrites.moe.behaviour.interpret import numpy_dtype
from onnx_moe_fuse.rewrites.moe.plan import MOE_ACTIVATIONS, QMOE_ACTIVATIONS, ExpertWeights

# -- 5. activation -----------------------------------------------------------------------------


def elementwise_activation(b: Mapping[str, Any]) -> str:
    tag = b.get("activation")
    act: ir.Value = b["act"]
    node = act.producer()
    if tag == "relu":
        return "relu"
    if tag == "identity":
        return "identity"
    if tag in ("silu_mul", "silu_mul_r"):
        return "silu"
    if tag == "swish":
        alpha = attr_float(node, "alpha", 1.0) if node is not None else None
        if alpha != 1.0:
            raise Refusal(f"Swish '{label(node)}' has alpha {alpha}; MoE's silu has alpha 1", node)
        return "silu"
    if tag == "fast_gelu":
        return "gelu"
    if tag == "gelu":
        assert node is not None
        approx = attr_str(node, "approximate", "none")
        if approx == "tanh":
            return "gelu"
        raise Refusal(
            f"exact GELU: Gelu '{label(node)}' computes the erf form (approximate='{approx}'); "
            "ORT's MoE 'gelu' is the tanh approximation, 1e-4 to 3e-4 apart, so fusing would "
            "change the numbers",
            node,
        )
    if tag in ("erf_gelu", "ms_gelu"):
        raise Refusal(
            f"exact GELU: the activation '{value_label(act)}' is the erf form of GELU "
            "(x * 0.5 * (1 + Erf(x / sqrt 2))); ORT's MoE 'gelu' is the tanh approximation, so "
            "fusing would change the numbers",
            node,
        )
    raise Refusal(f"unknown activation form {tag!r}", node)


def gate_up_columns(src: ir.Value, fc1_out: ir.Value, n1: int, last: int, role: str) -> np.ndarray:
    """Which FC1 output columns the gate / linear operand ``src`` selects.

    ``last`` is FC1's feature axis (its output has rank ``last + 1``).
    """
    node = src.producer()
    if node is None or node.inputs[0] is not fc1_out:
        raise Refusal(f"SwiGLU {role} operand '{value_label(src)}' is not a slice of FC1", src)
    if node.op_type == "Slice":
        starts, ends = const_ints(node.inputs[1]), const_ints(node.inputs[2])
        axes_v = node.inputs[3] if len(node.inputs) > 3 else None
        steps_v = node.inputs[4] if len(node.inputs) > 4 else None
        if axes_v is None:  # ONNX default: axes 0, 1, ... len(starts) - 1
            axes = None if starts is None else list(range(len(starts)))
        else:
            axes = const_ints(axes_v)
        steps = [1] if steps_v is None else const_ints(steps_v)
        if None in (starts, ends, axes, steps) or not (
            len(starts) == len(ends) == len(axes) == len(steps) == 1  # type: ignore[arg-type]
        ):
            raise Refusal(
                f"SwiGLU {role}: Slice '{label(node)}' is not a constant one-axis slice", node
            )
        if normalize_axes(axes, last + 1) != [last]:  # type: ignore[arg-type]
            raise Refusal(f"SwiGLU {role}: Slice '{label(node)}' does not cut the last axis", node)
        if steps[0] <= 0:  # type: ignore[index]
            raise Refusal(f"SwiGLU {role}: Slice '{label(node)}' has a non-positive step", node)
        return np.arange(n1)[slice(starts[0], ends[0], steps[0])]  # type: ignore[index]
    if node.op_type == "Split":
        axis = attr_int(node, "axis", 0)
        if normalize_axes([axis or 0], last + 1) != [last]:
            raise Refusal(f"SwiGLU {role}: Split '{label(node)}' does not cut the last axis", node)
        parts = len(node.outputs)
        split_v = node.inputs[1] if len(node.inputs) > 1 else None
        if split_v is not None:
            sizes = const_ints(split_v)
            if sizes is None or sum(sizes) != n1:
                raise Refusal(f"SwiGLU {role}: Split '{label(node)}' sizes are not constant", node)
        else:
            split_attr = node.attributes.get("split")
            if split_attr is not None:
                sizes = [int(v) for v in split_attr.value]
            else:
                if n1 % parts:
                    raise Refusal(f"SwiGLU {role}: Split '{label(node)}' is uneven", node)
                sizes = [n1 // parts] * parts
        which = src.index()
        start = sum(sizes[:which])
        return np.arange(start, start + sizes[which])
    raise Refusal(f"SwiGLU {role} operand comes from {node.op_type} '{label(node)}'", node)


def _clip_bounds(clip: ir.Node) -> tuple[float | None, float | None]:
    if len(clip.inputs) > 1 or "min" not in clip.attributes:
        lo_v = clip.inputs[1] if len(clip.inputs) > 1 else None
        hi_v = clip.inputs[2] if len(clip.inputs) > 2 else None
        lo = None if lo_v is None else const_float(lo_v)
        hi = None if hi_v is None else const_float(hi_v)
        if (lo_v is not None and lo is None) or (hi_v is not None and hi is None):
            raise Refusal(f"Clip '{label(clip)}' has bounds that are not constant", clip)
    else:  # opset < 11: attributes
        lo, hi = attr_float(clip, "min", None), attr_float(clip, "max", None)
    lo = None if lo is not None and math.isinf(lo) and lo < 0 else lo
    hi = None if hi is not None and math.isinf(hi) and hi > 0 else hi
    return lo, hi


def _is_clip(value: ir.Value) -> bool:
    node = value.producer()
    return node is not None and node.op_type == "Clip"


def swiglu_params(b: Mapping[str, Any]) -> tuple[float, float, float | None]:
    gate_c: ir.Value = b["swiglu_gate"]
    lin_c: ir.Value = b["swiglu_linear"]
    gate_clip = gate_c.producer() if _is_clip(gate_c) else None
    lin_clip = lin_c.producer() if _is_clip(lin_c) else None
    limit = None
    if gate_clip is not None or lin_clip is not None:
        if gate_clip is None or lin_clip is None:
            which = gate_clip or lin_clip
            raise Refusal(
                f"SwiGLU clamps only one operand (Clip '{label(which)}'); MoE's swiglu_limit "
                "clamps the gate from above and the linear operand on both sides",
                which,
            )
        g_lo, g_hi = _clip_bounds(gate_clip)
        l_lo, l_hi = _clip_bounds(lin_clip)
        if g_lo is not None or g_hi is None or g_hi <= 0:
            raise Refusal(
                f"SwiGLU gate Clip '{label(gate_clip)}' is not min(gate, limit) (bounds "
                f"{g_lo}, {g_hi})",
                gate_clip,
            )
        if l_hi is None or l_lo is None or l_hi != g_hi or l_lo != -g_hi:
            raise Refusal(
                f"SwiGLU linear Clip '{label(lin_clip)}' is not clamp(x, -{g_hi}, {g_hi}) "
                f"(bounds {l_lo}, {l_hi})",
                lin_clip,
            )
        limit = float(g_hi)
    alpha = 1.0
    if b.get("alpha_form") == "scaled":
        a = const_float(b.get("swiglu_alpha"))
        if a is None:
            raise Refusal("SwiGLU: the Sigmoid's scale factor (alpha) is not a constant scalar")
        alpha = a
    beta = 0.0
    if b.get("beta_form") == "shifted":
        bb = const_float(b.get("swiglu_beta"))
        if bb is None:
            raise Refusal("SwiGLU: the linear operand's offset (beta) is not a constant scalar")
        beta = bb
    return alpha, beta, limit


def activation_step(
    b: Mapping[str, Any],
    family: str,
    fc1: tuple[ExpertWeights, ...],
    fc2: ExpertWeights,
    fc1_last_axis: int,
) -> tuple[str, np.ndarray, tuple[float, float, float | None]]:
    """The activation, FC1's columns in the fused node's order, and (alpha, beta, limit)."""
    inter = fc2.shape[1]
    n1 = sum(w.shape[2] for w in fc1)
    if b.get("activation") == "behaviour":  # no spelling matched: proved by probing
        return prove_activation(
            b["act_region"],
            [w.shape[2] for w in fc1],
            fc1_last_axis + 1,
            np.dtype(numpy_dtype(fc1[0].dtype) or np.float32),
            inter,
            MOE_ACTIVATIONS | QMOE_ACTIVATIONS,
        )
    if family == "elementwise":
        activation = elementwise_activation(b)
        if n1 != inter:
            raise Refusal(f"FC1 has {n1} outputs but FC2 reads {inter}", fc1[0].value)
        return activation, np.arange(n1), (1.0, 0.0, None)
    params = swiglu_params(b)
    if family == "gated":
        if fc1[0].shape != fc1[1].shape:
            raise Refusal("the gate and up experts have different shapes", fc1[1].value)
        gate_cols = np.arange(fc1[0].shape[2])
        lin_cols = fc1[0].shape[2] + np.arange(fc1[1].shape[2])
    else:
        fc1_out: ir.Value = b["fc1_out"]
        gate_cols = gate_up_columns(b["swiglu_gate_src"], fc1_out, n1, fc1_last_axis, "gate")
        lin_cols = gate_up_columns(b["swiglu_linear_src"], fc1_out, n1, fc1_last_axis, "linear")
    if len(gate_cols) != inter or len(lin_cols) != inter:
        raise Refusal(
            f"the SwiGLU gate/linear operands have {len(gate_cols)}/{len(lin_cols)} columns "
            f"but FC2 reads {inter}",
            fc2.value,
        )
    columns = np.stack([gate_cols, lin_cols], axis=1).reshape(-1)  # row 2j gate, 2j+1 lin
    return "swiglu", columns, params


def granularity(
    fc1: tuple[ExpertWeights, ...], fc2: ExpertWeights, hidden: int, inter: int
) -> tuple[int, int]:
    """One bit width and one block size (0: per output channel) for all the projections.

    A projection with a single block over K can be read either way. 8-bit prefers per channel
    (ORT's block-wise 8-bit QMoE quantises the activations, see semantics.md); 4-bit keeps the
    block size the source declares when every projection declares the same one.
    """
    parts = (*fc1, fc2)
    text = ", ".join(f"{w.role}: {w.describe()}" for w in parts)
    bit_set = {w.bits for w in parts}
    if len(bit_set) != 1:
        raise Refusal(
            f"the expert projections have different bit widths ({text}); one QMoE node takes one",
            fc2.value,
        )
    bits = bit_set.pop()
    if bits == 4 and (hidden % 2 or inter % 2):
        raise Refusal(f"4-bit QMoE packs pairs along K; H = {hidden}, I = {inter}", fc2.value)
    per_channel = all(w.per_channel for w in parts)
    blocks = {w.block for w in parts}
    common = blocks.pop() if len(blocks) == 1 else 0
    valid = (
        common >= 16 and not common & (common - 1) and not hidden % common and not inter % common
    )
    if per_channel and (bits == 8 or not valid):
        return bits, 0
    if valid and bits == 8:
        # measured (shared/notes/semantics.md): ORT CPU's block-wise 8-bit QMoE quantises the
        # activations to int8 per block, 6e-3 to 2e-2 off the layer it replaces
        raise Refusal(
            f"8-bit weights in blocks of {common} along K ({text}): ONNX Runtime's block-wise "
            "8-bit QMoE quantises the activations too, so the fused node would not compute the "
            "same (per-channel 8-bit and every 4-bit form are exact)",
            fc2.value,
        )
    if valid:
        return bits, common
    if common:
        raise Refusal(
            f"block size {common} is not usable by QMoE (a power of two >= 16 that divides "
            f"H = {hidden} and I = {inter}) ({text})",
            fc2.value,
        )
    raise Refusal(
        f"the expert projections are quantized with different granularity ({text}); one QMoE "
        "node takes one block size",
        fc2.value,
    )
