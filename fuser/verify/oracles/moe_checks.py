"""Argument checks the MoE and QMoE oracles share: integers, flags, shapes, dtypes, activations.

Each raises ``ValueError`` with a message naming the argument, the expected value or shape (its
dims spelled out) and what was given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from onnx_moe_fuse.contract.ops import ACTIVATION_TYPES

__all__ = [
    "check_activation",
    "check_flag",
    "check_float",
    "check_k",
    "check_rank",
    "check_real",
    "check_router_weights",
    "check_shape",
    "check_swiglu_params",
    "check_tokens",
    "is_int",
    "optional_float",
]

_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def is_int(v: object) -> bool:
    """True for an integer that is not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_k(k: int, num_experts: int) -> int:
    """``k`` as an int in ``[1, E]``."""
    if not is_int(k):
        raise ValueError(f"k must be an integer, got {k!r}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"k = {k} must be in [1, E] = [1, {num_experts}]")
    return int(k)


def check_flag(v: int, name: str) -> int:
    """A 0/1 flag as an int."""
    if not is_int(v) or int(v) not in (0, 1):
        raise ValueError(f"{name} must be 0 or 1, got {v!r}")
    return int(v)


def check_real(v: float, name: str) -> float:
    """A finite real number as a float."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a real number, got {v!r}")
    if not math.isfinite(float(v)):
        raise ValueError(f"{name} must be finite, got {v!r}")
    return float(v)


def check_shape(name: str, arr: np.ndarray, expected: Sequence[int], dims: str) -> None:
    """``arr`` has the shape ``expected`` (named ``dims`` in the message)."""
    if arr.shape != tuple(expected):
        raise ValueError(f"{name} must have shape {dims} = {tuple(expected)}, got {arr.shape}")


def check_rank(name: str, arr: np.ndarray, rank: int, dims: str) -> None:
    """``arr`` has rank ``rank`` (named ``dims`` in the message)."""
    if arr.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} {dims}, got shape {arr.shape}")


def check_float(name: str, arr: np.ndarray) -> None:
    """``arr`` is float16, float32 or float64."""
    if arr.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, float32 or float64, got dtype {arr.dtype}")


def check_activation(
    activation_type: str, swiglu_fusion: int, allowed_fusions: tuple[int, ...]
) -> tuple[str, int]:
    """A known ``activation_type`` and a ``swiglu_fusion`` it allows (0 unless swiglu)."""
    if activation_type not in ACTIVATION_TYPES:
        raise ValueError(
            f"activation_type must be one of {ACTIVATION_TYPES}, got {activation_type!r}"
        )
    if not is_int(swiglu_fusion) or int(swiglu_fusion) not in (0, 1, 2):
        raise ValueError(f"swiglu_fusion must be 0, 1 or 2, got {swiglu_fusion!r}")
    swiglu_fusion = int(swiglu_fusion)
    if activation_type == "swiglu":
        if swiglu_fusion not in allowed_fusions:
            raise ValueError(
                f"swiglu_fusion = {swiglu_fusion} is not supported here "
                f"(allowed with swiglu: {allowed_fusions})"
            )
    elif swiglu_fusion != 0:
        raise ValueError(
            f"swiglu_fusion = {swiglu_fusion} only applies to activation_type='swiglu'; "
            f"use 0 with {activation_type!r}"
        )
    return activation_type, swiglu_fusion


def check_swiglu_params(
    alpha: float, beta: float, limit: float | None
) -> tuple[float, float, float | None]:
    """SwiGLU's alpha, beta (finite) and limit (positive, or None for no clamp)."""
    alpha = check_real(alpha, "activation_alpha")
    beta = check_real(beta, "activation_beta")
    if limit is not None:
        limit = check_real(limit, "swiglu_limit")
        if limit <= 0:
            raise ValueError(f"swiglu_limit must be positive (or None for no clamp), got {limit}")
    return alpha, beta, limit


def check_tokens(input_: np.ndarray, router: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Validate input/router ranks and shapes; return the ``[T, H]`` view, ``T`` and ``E``."""
    check_float("input", input_)
    if input_.ndim not in (2, 3):
        raise ValueError(f"input must have rank 2 [T, H] or 3 [B, S, H], got shape {input_.shape}")
    hidden = input_.shape[-1]
    if hidden <= 0:
        raise ValueError(f"input has hidden size {hidden}; it must be positive")
    x = input_.reshape(-1, hidden)
    check_float("router_probs", router)
    if router.dtype != input_.dtype:
        raise ValueError(
            f"router_probs has dtype {router.dtype}, but input has dtype {input_.dtype}"
        )
    check_rank("router_probs", router, 2, "[T, E]")
    if router.shape[0] != x.shape[0]:
        raise ValueError(
            f"router_probs has {router.shape[0]} rows, but input has T = {x.shape[0]} tokens "
            f"(shape {input_.shape})"
        )
    if router.shape[1] <= 0:
        raise ValueError("router_probs has no experts (E = 0)")
    return x, x.shape[0], router.shape[1]


def check_router_weights(
    value: npt.ArrayLike | None, input_: np.ndarray, num_tokens: int, num_experts: int
) -> np.ndarray | None:
    """QMoE's optional ``router_weights``: ``[T, E]``, the input's float dtype; or None."""
    if value is None:
        return None
    arr = np.asarray(value)
    check_float("router_weights", arr)
    if arr.dtype != input_.dtype:
        raise ValueError(
            f"router_weights has dtype {arr.dtype}, but input has dtype {input_.dtype}"
        )
    check_shape("router_weights", arr, (num_tokens, num_experts), "[T, E]")
    return arr


def optional_float(
    name: str, value: npt.ArrayLike | None, shape: Sequence[int], dims: str
) -> np.ndarray | None:
    """An optional float array of ``shape`` as float64, or None."""
    if value is None:
        return None
    arr = np.asarray(value)
    check_float(name, arr)
    check_shape(name, arr, shape, dims)
    return arr.astype(np.float64)
