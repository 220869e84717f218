"""Numpy oracles for ONNX Runtime's ``com.microsoft.MoE`` and ``com.microsoft.QMoE``.

Both take tokens ``input`` of shape ``[T, H]`` or ``[B, S, H]`` and router logits ``[T, E]``
(``T`` = product of the leading input dimensions) and return float32 of the input's shape.
Everything is computed in float64; quantized weights are dequantized exactly in float64.

Expert layout (output-major, as ORT): ``fc1 [E, fusion * I, H]``, ``fc2 [E, H, I]``,
``fc3 [E, I, H]``; each row is one output channel. For QMoE the last axis is packed
(:mod:`onnx_moe_fuse.verify.oracles.quant`). Per selected expert ``e`` and token ``x``::

    h = fc1[e] @ x + fc1_bias[e]          # bias before the activation
    a = activation(h)                     # [I]
    y = fc2[e] @ a + fc2_bias[e]          # bias before the routing weight
    out += routing_weight[e] * y

Activations: ``relu``; ``gelu`` in its tanh approximation (what ORT computes, not erf GELU);
``silu`` (``h * sigmoid(h)``, times ``fc3[e] @ x + fc3_bias[e]`` when MoE's ``fc3`` is given);
``identity``; ``swiglu``: gate ``g`` and linear ``l`` operands, clamped when ``swiglu_limit``
is set (``g = min(g, limit)``, ``l = clip(l, -limit, limit)``), then
``g * sigmoid(alpha * g) * (l + beta)``. ``swiglu_fusion`` picks the operands: 0 = ``g`` from
FC1 and ``l`` from FC3 (MoE only), 1 = interleaved FC1 rows (row ``2j`` gate, ``2j + 1`` linear),
2 = concatenated FC1 rows (first ``I`` gate, next ``I`` linear). ``activation_alpha`` and
``activation_beta`` are used by ``swiglu`` only.

Routing, as measured on ORT 1.32 CPU:

* QMoE: top-k of the logits, softmax over the ``k`` selected logits. ``normalize_routing_weights``
  0 and 1 give the same result (it only matters for ORT's separate ``router_weights`` input,
  which this oracle does not take).
* MoE: softmax over all ``E`` logits, top-k; the ``k`` probabilities are renormalised to sum 1
  only when ``normalize_routing_weights=1``.

Ties: on exactly equal logits this oracle selects the highest expert indices, as ORT's MoE and
QMoE do (the ONNX ``TopK`` op selects the lowest). Random inputs never tie.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from onnx_moe_fuse.verify.oracles.quant import QMOE_BITS, dequantize_qmoe, pack_size

__all__ = [
    "ACTIVATIONS",
    "select_top_k",
    "route_qmoe",
    "route_moe",
    "activation",
    "gelu_tanh",
    "qmoe",
    "moe",
]

ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "silu", "swiglu", "identity")
_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------


def select_top_k(logits: npt.ArrayLike, k: int) -> np.ndarray:
    """Return the indices ``[T, k]`` of the ``k`` largest logits per row, largest first.

    Exact ties go to the highest expert index (ORT MoE/QMoE behaviour): a stable descending
    sort of the reversed row.
    """
    a = np.asarray(logits, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"logits must have rank 2 [T, E], got shape {a.shape}")
    e = a.shape[1]
    k = _check_k(k, e)
    order = np.argsort(-a[:, ::-1], axis=1, kind="stable")[:, :k]
    return (e - 1 - order).astype(np.int64)


def route_qmoe(router_probs: npt.ArrayLike, k: int) -> tuple[np.ndarray, np.ndarray]:
    """QMoE routing: top-k logits, softmax over the ``k`` selected ones.

    Returns ``(expert_indices [T, k] int64, weights [T, k] float64)``.
    """
    logits = np.asarray(router_probs, dtype=np.float64)
    idx = select_top_k(logits, k)
    sel = np.take_along_axis(logits, idx, axis=1)
    if sel.shape[0] == 0:
        return idx, sel
    sel = np.exp(sel - sel.max(axis=1, keepdims=True))
    return idx, sel / sel.sum(axis=1, keepdims=True)


def route_moe(
    router_probs: npt.ArrayLike, k: int, normalize_routing_weights: int
) -> tuple[np.ndarray, np.ndarray]:
    """MoE routing: softmax over all experts, top-k, renormalise only when asked.

    Returns ``(expert_indices [T, k] int64, weights [T, k] float64)``.
    """
    normalize = _check_flag(normalize_routing_weights, "normalize_routing_weights")
    logits = np.asarray(router_probs, dtype=np.float64)
    idx = select_top_k(logits, k)
    if logits.shape[0] == 0:
        return idx, np.zeros(idx.shape)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    sel = np.take_along_axis(p, idx, axis=1)
    if normalize:
        sel = sel / sel.sum(axis=1, keepdims=True)
    return idx, sel


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


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
    swiglu_fusion: int = 0,
    activation_alpha: float = 1.0,
    activation_beta: float = 0.0,
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


# ---------------------------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------------------------


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_k(k: int, num_experts: int) -> int:
    if not _is_int(k):
        raise ValueError(f"k must be an integer, got {k!r}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"k = {k} must be in [1, E] = [1, {num_experts}]")
    return int(k)


def _check_flag(v: int, name: str) -> int:
    if not _is_int(v) or int(v) not in (0, 1):
        raise ValueError(f"{name} must be 0 or 1, got {v!r}")
    return int(v)


def _check_real(v: float, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a real number, got {v!r}")
    if not math.isfinite(float(v)):
        raise ValueError(f"{name} must be finite, got {v!r}")
    return float(v)


def _check_shape(name: str, arr: np.ndarray, expected: Sequence[int], dims: str) -> None:
    if arr.shape != tuple(expected):
        raise ValueError(f"{name} must have shape {dims} = {tuple(expected)}, got {arr.shape}")


def _check_rank(name: str, arr: np.ndarray, rank: int, dims: str) -> None:
    if arr.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} {dims}, got shape {arr.shape}")


def _check_float(name: str, arr: np.ndarray) -> None:
    if arr.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, float32 or float64, got dtype {arr.dtype}")


def _check_activation(
    activation_type: str, swiglu_fusion: int, allowed_fusions: tuple[int, ...]
) -> tuple[str, int]:
    if activation_type not in ACTIVATIONS:
        raise ValueError(f"activation_type must be one of {ACTIVATIONS}, got {activation_type!r}")
    if not _is_int(swiglu_fusion) or int(swiglu_fusion) not in (0, 1, 2):
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


def _check_swiglu_params(
    alpha: float, beta: float, limit: float | None
) -> tuple[float, float, float | None]:
    alpha = _check_real(alpha, "activation_alpha")
    beta = _check_real(beta, "activation_beta")
    if limit is not None:
        limit = _check_real(limit, "swiglu_limit")
        if limit <= 0:
            raise ValueError(f"swiglu_limit must be positive (or None for no clamp), got {limit}")
    return alpha, beta, limit


def _tokens(input_: np.ndarray, router: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Validate input/router ranks and shapes; return the ``[T, H]`` view, ``T`` and ``E``."""
    _check_float("input", input_)
    if input_.ndim not in (2, 3):
        raise ValueError(f"input must have rank 2 [T, H] or 3 [B, S, H], got shape {input_.shape}")
    hidden = input_.shape[-1]
    if hidden <= 0:
        raise ValueError(f"input has hidden size {hidden}; it must be positive")
    x = input_.reshape(-1, hidden)
    _check_float("router_probs", router)
    if router.dtype != input_.dtype:
        raise ValueError(
            f"router_probs has dtype {router.dtype}, but input has dtype {input_.dtype}"
        )
    _check_rank("router_probs", router, 2, "[T, E]")
    if router.shape[0] != x.shape[0]:
        raise ValueError(
            f"router_probs has {router.shape[0]} rows, but input has T = {x.shape[0]} tokens "
            f"(shape {input_.shape})"
        )
    if router.shape[1] <= 0:
        raise ValueError("router_probs has no experts (E = 0)")
    return x, x.shape[0], router.shape[1]


# ---------------------------------------------------------------------------------------------
# Shared expert evaluation
# ---------------------------------------------------------------------------------------------


def _run_experts(
    x: np.ndarray,
    idx: np.ndarray,
    weights: np.ndarray,
    fc1: np.ndarray,
    fc1_bias: np.ndarray | None,
    fc2: np.ndarray,
    fc2_bias: np.ndarray | None,
    fc3: np.ndarray | None,
    fc3_bias: np.ndarray | None,
    act: dict[str, object],
) -> np.ndarray:
    """Evaluate the routed experts in float64; all weight arrays are float64 and output-major."""
    x64 = x.astype(np.float64)
    out = np.zeros((x.shape[0], fc2.shape[1]), dtype=np.float64)
    for e in np.unique(idx):
        rows, slots = np.nonzero(idx == e)  # each row selects an expert at most once
        xs = x64[rows]
        h = xs @ fc1[e].T
        if fc1_bias is not None:
            h = h + fc1_bias[e]
        linear = None
        if fc3 is not None:
            linear = xs @ fc3[e].T
            if fc3_bias is not None:
                linear = linear + fc3_bias[e]
        a = activation(h, linear=linear, **act)  # type: ignore[arg-type]
        y = a @ fc2[e].T
        if fc2_bias is not None:
            y = y + fc2_bias[e]
        out[rows] += weights[rows, slots][:, None] * y
    return out


# ---------------------------------------------------------------------------------------------
# QMoE
# ---------------------------------------------------------------------------------------------


def qmoe(
    input: npt.ArrayLike,  # named after the ONNX input
    router_probs: npt.ArrayLike,
    fc1: npt.ArrayLike,
    fc1_scales: npt.ArrayLike,
    fc2: npt.ArrayLike,
    fc2_scales: npt.ArrayLike,
    *,
    k: int,
    activation_type: str,
    expert_weight_bits: int,
    block_size: int | None = None,
    swiglu_fusion: int,
    activation_alpha: float = 1.0,
    activation_beta: float = 0.0,
    swiglu_limit: float | None = None,
    fc1_bias: npt.ArrayLike | None = None,
    fc2_bias: npt.ArrayLike | None = None,
    normalize_routing_weights: int = 0,
) -> np.ndarray:
    """Compute ORT ``com.microsoft.QMoE`` with symmetric int weights (no zero points, no FC3).

    Args:
        input: ``[T, H]`` or ``[B, S, H]`` float tokens.
        router_probs: ``[T, E]`` router logits (same dtype as ``input``).
        fc1: ``[E, fusion * I, H / pack]`` uint8; ``fusion`` is 2 for swiglu, else 1.
        fc1_scales: ``[E, fusion * I]`` (column-wise) or ``[E, fusion * I, H / block_size]``.
        fc2: ``[E, H, I / pack]`` uint8.
        fc2_scales: ``[E, H]`` or ``[E, H, I / block_size]``.
        k: experts per token, ``1 <= k <= E``.
        activation_type: ``relu``, ``gelu`` (tanh form), ``silu``, ``identity`` or ``swiglu``.
        expert_weight_bits: 4 (zero point 8, two codes a byte, low nibble first) or 8 (zp 128).
        block_size: ``None`` for column-wise scales, else a power of two >= 16 (ORT refuses
            others) that divides both ``H`` and ``I``.
        swiglu_fusion: 1 (interleaved, what ORT CPU runs) or 2 (concatenated) for swiglu;
            0 for every other activation.
        activation_alpha: swiglu ``alpha``.
        activation_beta: swiglu ``beta``.
        swiglu_limit: swiglu clamp, ``None`` for none.
        fc1_bias: optional ``[E, fusion * I]``, added before the activation.
        fc2_bias: optional ``[E, H]``, added before the routing weight.
        normalize_routing_weights: 0 or 1; no effect (ORT QMoE always softmaxes the k logits).

    Returns:
        float32 array of ``input``'s shape.
    """
    x_in = np.asarray(input)
    router = np.asarray(router_probs)
    x, _, num_experts = _tokens(x_in, router)
    hidden = x.shape[1]
    k = _check_k(k, num_experts)
    _check_flag(normalize_routing_weights, "normalize_routing_weights")
    activation_type, swiglu_fusion = _check_activation(activation_type, swiglu_fusion, (1, 2))
    alpha, beta, limit = _check_swiglu_params(activation_alpha, activation_beta, swiglu_limit)
    if isinstance(expert_weight_bits, bool) or expert_weight_bits not in QMOE_BITS:
        raise ValueError(
            f"expert_weight_bits must be one of {QMOE_BITS}, got {expert_weight_bits!r}"
        )
    bits = int(expert_weight_bits)
    pack = pack_size(bits)
    fusion = 2 if activation_type == "swiglu" else 1

    w1 = np.asarray(fc1)
    w2 = np.asarray(fc2)
    s1 = np.asarray(fc1_scales)
    s2 = np.asarray(fc2_scales)
    for name, w in (("fc1", w1), ("fc2", w2)):
        if w.dtype != np.uint8:
            raise ValueError(f"{name} must be uint8 (packed codes), got dtype {w.dtype}")
    for name, s in (("fc1_scales", s1), ("fc2_scales", s2)):
        _check_float(name, s)
    _check_rank("fc2", w2, 3, "[E, H, I/pack]")
    _check_rank("fc1", w1, 3, "[E, fusion*I, H/pack]")
    inter = w2.shape[2] * pack
    if inter <= 0:
        raise ValueError(f"fc2 has shape {w2.shape}: inter size I must be positive")
    _check_shape("fc2", w2, (num_experts, hidden, inter // pack), "[E, H, I/pack]")
    if hidden % pack:
        raise ValueError(f"input hidden size H = {hidden} must be even for 4-bit weights")
    _check_shape("fc1", w1, (num_experts, fusion * inter, hidden // pack), "[E, fusion*I, H/pack]")

    if block_size is None:
        _check_shape("fc1_scales", s1, (num_experts, fusion * inter), "[E, fusion*I]")
        _check_shape("fc2_scales", s2, (num_experts, hidden), "[E, H]")
    else:
        if not _is_int(block_size) or block_size < 16 or block_size & (block_size - 1):
            raise ValueError(
                f"block_size must be None or a power of two >= 16 (ORT's rule), got {block_size!r}"
            )
        block_size = int(block_size)
        if hidden % block_size or inter % block_size:
            raise ValueError(
                f"block_size = {block_size} must divide both H = {hidden} and I = {inter}"
            )
        _check_shape(
            "fc1_scales",
            s1,
            (num_experts, fusion * inter, hidden // block_size),
            "[E, fusion*I, H/block_size]",
        )
        _check_shape(
            "fc2_scales", s2, (num_experts, hidden, inter // block_size), "[E, H, I/block_size]"
        )

    b1 = _optional_float("fc1_bias", fc1_bias, (num_experts, fusion * inter), "[E, fusion*I]")
    b2 = _optional_float("fc2_bias", fc2_bias, (num_experts, hidden), "[E, H]")

    w1f = dequantize_qmoe(w1, s1, bits, block_size, dtype=np.float64)
    w2f = dequantize_qmoe(w2, s2, bits, block_size, dtype=np.float64)
    idx, weights = route_qmoe(router, k)
    act = {
        "activation_type": activation_type,
        "swiglu_fusion": swiglu_fusion,
        "activation_alpha": alpha,
        "activation_beta": beta,
        "swiglu_limit": limit,
    }
    out = _run_experts(x, idx, weights, w1f, b1, w2f, b2, None, None, act)
    return out.reshape(x_in.shape).astype(np.float32)


def _optional_float(
    name: str, value: npt.ArrayLike | None, shape: Sequence[int], dims: str
) -> np.ndarray | None:
    if value is None:
        return None
    arr = np.asarray(value)
    _check_float(name, arr)
    _check_shape(name, arr, shape, dims)
    return arr.astype(np.float64)


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------


def moe(
    input: npt.ArrayLike,  # named after the ONNX input
    router_probs: npt.ArrayLike,
    fc1: npt.ArrayLike,
    fc2: npt.ArrayLike,
    *,
    fc1_bias: npt.ArrayLike | None = None,
    fc2_bias: npt.ArrayLike | None = None,
    fc3: npt.ArrayLike | None = None,
    fc3_bias: npt.ArrayLike | None = None,
    k: int,
    activation_type: str,
    swiglu_fusion: int = 0,
    normalize_routing_weights: int = 0,
    activation_alpha: float = 1.0,
    activation_beta: float = 0.0,
    swiglu_limit: float | None = None,
) -> np.ndarray:
    """Compute ORT ``com.microsoft.MoE`` (float weights, dense routing).

    Args:
        input: ``[T, H]`` or ``[B, S, H]`` float tokens.
        router_probs: ``[T, E]`` router logits (same dtype as ``input``).
        fc1: ``[E, fusion * I, H]``; ``fusion`` is 2 for swiglu with ``swiglu_fusion`` 1 or 2.
        fc2: ``[E, H, I]``.
        fc1_bias: optional ``[E, fusion * I]``, added before the activation.
        fc2_bias: optional ``[E, H]``, added before the routing weight.
        fc3: ``[E, I, H]``: required for swiglu with ``swiglu_fusion=0`` (the linear operand),
            optional for silu (``silu(fc1 x) * fc3 x``), refused for other activations.
        fc3_bias: optional ``[E, I]``, only with ``fc3``.
        k: experts per token, ``1 <= k <= E``.
        activation_type: ``relu``, ``gelu`` (tanh form), ``silu``, ``identity`` or ``swiglu``.
        swiglu_fusion: 0 (FC1 gate + FC3 linear), 1 (interleaved) or 2 (concatenated) for
            swiglu; 0 for every other activation.
        normalize_routing_weights: 1 renormalises the top-k softmax probabilities to sum 1.
        activation_alpha: swiglu ``alpha``.
        activation_beta: swiglu ``beta``.
        swiglu_limit: swiglu clamp, ``None`` for none.

    Returns:
        float32 array of ``input``'s shape.
    """
    x_in = np.asarray(input)
    router = np.asarray(router_probs)
    x, _, num_experts = _tokens(x_in, router)
    hidden = x.shape[1]
    k = _check_k(k, num_experts)
    normalize = _check_flag(normalize_routing_weights, "normalize_routing_weights")
    activation_type, swiglu_fusion = _check_activation(activation_type, swiglu_fusion, (0, 1, 2))
    alpha, beta, limit = _check_swiglu_params(activation_alpha, activation_beta, swiglu_limit)
    fusion = 2 if activation_type == "swiglu" and swiglu_fusion in (1, 2) else 1

    w1 = np.asarray(fc1)
    w2 = np.asarray(fc2)
    for name, w in (("fc1", w1), ("fc2", w2)):
        _check_float(name, w)
        if w.dtype != x_in.dtype:
            raise ValueError(f"{name} has dtype {w.dtype}, but input has dtype {x_in.dtype}")
    _check_rank("fc2", w2, 3, "[E, H, I]")
    _check_rank("fc1", w1, 3, "[E, fusion*I, H]")
    inter = w2.shape[2]
    if inter <= 0:
        raise ValueError(f"fc2 has shape {w2.shape}: inter size I must be positive")
    _check_shape("fc2", w2, (num_experts, hidden, inter), "[E, H, I]")
    _check_shape("fc1", w1, (num_experts, fusion * inter, hidden), "[E, fusion*I, H]")

    needs_fc3 = activation_type == "swiglu" and swiglu_fusion == 0
    takes_fc3 = needs_fc3 or activation_type == "silu"
    if fc3 is None:
        if needs_fc3:
            raise ValueError("fc3 is required for activation_type='swiglu' with swiglu_fusion=0")
        if fc3_bias is not None:
            raise ValueError("fc3_bias is given without fc3")
        w3 = None
    else:
        if not takes_fc3:
            raise ValueError(
                f"fc3 is only used by swiglu with swiglu_fusion=0 or by silu, not by "
                f"activation_type={activation_type!r} with swiglu_fusion={swiglu_fusion}"
            )
        w3 = np.asarray(fc3)
        _check_float("fc3", w3)
        _check_shape("fc3", w3, (num_experts, inter, hidden), "[E, I, H]")
        w3 = w3.astype(np.float64)

    b1 = _optional_float("fc1_bias", fc1_bias, (num_experts, fusion * inter), "[E, fusion*I]")
    b2 = _optional_float("fc2_bias", fc2_bias, (num_experts, hidden), "[E, H]")
    b3 = _optional_float("fc3_bias", fc3_bias, (num_experts, inter), "[E, I]")

    idx, weights = route_moe(router, k, normalize)
    act = {
        "activation_type": activation_type,
        "swiglu_fusion": swiglu_fusion,
        "activation_alpha": alpha,
        "activation_beta": beta,
        "swiglu_limit": limit,
    }
    out = _run_experts(
        x, idx, weights, w1.astype(np.float64), b1, w2.astype(np.float64), b2, w3, b3, act
    )
    return out.reshape(x_in.shape).astype(np.float32)
