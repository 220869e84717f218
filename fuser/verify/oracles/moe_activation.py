"""The MoE activations of the oracles: relu, tanh GELU, silu, identity and SwiGLU's three packings.

``swiglu_fusion`` picks SwiGLU's operands: 0 = gate from FC1 and linear from FC3 (MoE only), 1 =
interleaved FC1 rows (row ``2j`` gate, ``2j + 1`` linear), 2 = concatenated FC1 rows. Computed
in float64.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from onnx_moe_fuse.contract.ops import ACTIVATION_TYPES, MOE

__all__ = ["ACTIVATIONS", "activation", "gelu_tanh"]

#: The ``activation_type`` values (ORT's, :data:`onnx_moe_fuse.contract.ops.ACTIVATION_TYPES`).
ACTIVATIONS: tuple[str, ...] = ACTIVATION_TYPES


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -x))


def gelu_tanh(x: npt.ArrayLike) -> np.ndarray:
    """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    v = np.asarray(x, dtype=np.float64)
    return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))


def activation(
    h: npt.ArrayLike,
    activation_type: str,
    *,
    swiglu_fusion: int = MOE.default("swiglu_fusion"),
    activation_alpha: float = MOE.default("activation_alpha"),
    activation_beta: float = MOE.default("activation_beta"),
    swiglu_limit: float | None = None,
    linear: npt.ArrayLike | None = None,
) -> np.ndarray:
    """Apply an MoE activation to FC1 outputs ``h [..., fusion * I]``; returns ``[..., I]``.

    ``linear`` is the FC3 output: the SwiGLU linear operand for ``swiglu_fusion=0``, or the
    multiplicative projection for ``silu``. Computed in float64.
    """
    hv = np.asarray(h, dtype=np.float64)
    lin = None if linear is None else np.asarray(linear, dtype=np.float64)
    if activation_type == "relu":
        return np.maximum(hv, 0.0)
    if activation_type == "gelu":
        return gelu_tanh(hv)
    if activation_type == "identity":
        return hv
    if activation_type == "silu":
        out = hv * _sigmoid(hv)
        return out if lin is None else out * lin
    if activation_type == "swiglu":
        if swiglu_fusion == 0:
            if lin is None:
                raise ValueError("swiglu with swiglu_fusion=0 needs the FC3 output (linear)")
            gate, lin_op = hv, lin
        elif swiglu_fusion == 1:
            gate, lin_op = hv[..., 0::2], hv[..., 1::2]
        elif swiglu_fusion == 2:
            half = hv.shape[-1] // 2
            gate, lin_op = hv[..., :half], hv[..., half:]
        else:
            raise ValueError(f"swiglu_fusion must be 0, 1 or 2, got {swiglu_fusion!r}")
        if swiglu_limit is not None:
            gate = np.minimum(gate, swiglu_limit)
            lin_op = np.clip(lin_op, -swiglu_limit, swiglu_limit)
        return gate * _sigmoid(activation_alpha * gate) * (lin_op + activation_beta)
    raise ValueError(f"activation_type must be one of {ACTIVATIONS}, got {activation_type!r}")
