"""Numpy oracles for ONNX Runtime's ``com.microsoft.MoE`` and ``com.microsoft.QMoE``.

Both take tokens ``input`` of shape ``[T, H]`` or ``[B, S, H]`` and router logits ``[T, E]``
(``T`` = product of the leading input dimensions) and return float32 of the input's shape.
Everything is computed in float64; quantized weights are dequantized exactly in float64.

Expert layout (output-major, as ORT): ``fc1 [E, fusion * I, H]``, ``fc2 [E, H, I]``,
``fc3 [E, I, H]``; each row is one output channel. For QMoE the last axis is packed
(:mod:`onnx_moe_fuse.contract.packing`). Per selected expert ``e`` and token ``x``::

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
  0 and 1 give the same result. With QMoE's optional ``router_weights [T, E]`` (input 14) the
  top-k of ``router_probs`` still selects the experts, and the mixing weights are
  ``router_weights`` gathered at the selected experts, divided by their sum when
  ``normalize_routing_weights=1`` (weights 0 where that sum is 0) and used as they are with 0.
* MoE: softmax over all ``E`` logits, top-k; the ``k`` probabilities are renormalised to sum 1
  only when ``normalize_routing_weights=1``.

``router_weights`` in ONNX Runtime's sources (microsoft/onnxruntime, read for this oracle):

* CPU (``onnxruntime/contrib_ops/cpu/moe/moe_quantization_cpu.cc`` at 0aab72a,
  ``QMoECPU::ComputeCommon``): as above, with the sum in float32 and the weights multiplied by ``1 / sum`` (0 for a zero
  sum); the shape must be ``[T, E]``. It also skips every selected expert whose final weight is
  ``<= 1e-8``: a zero weight gives the same result either way (unless that expert's output is
  not finite), but a negative or tiny positive one contributes nothing on ORT CPU. This oracle
  does not model that skip: it computes every selected expert with its weight. (Measured: ORT
  1.32 and 1.30 CPU, and onnxruntime-webgpu 1.27's CPU provider, compute exactly this.)
* WebGPU (``onnxruntime/contrib_ops/webgpu/moe/qmoe.cc``, ``gate_1token.wgsl.template``):
  older versions refuse ``router_weights`` (NOT_IMPLEMENTED, 02b0534) or, older still, ignore
  input 14 (f79a393); the newest version read takes it with the same weights (``weight / sum`` when normalising,
  0 for a zero sum, the shape of ``router_probs``) and no skip: every selected expert runs.
* CUDA (``onnxruntime/contrib_ops/cuda/moe/moe_quantization.cc`` at 00d47b6,
  ``QMoE::ComputeInternal``): input 14 is not read; the weights come from ``router_probs`` (softmax top-k) whatever
  ``router_weights`` holds.

Ties: on exactly equal logits this oracle selects the highest expert indices, as ORT's MoE and
QMoE do (the ONNX ``TopK`` op selects the lowest). Random inputs never tie.

The parts live beside this module: :mod:`.moe_routing` (top-k and the softmax orders),
:mod:`.moe_activation` (the activations), :mod:`.moe_checks` (argument checks); their public
names are re-exported here. Defaults of the keyword arguments are ORT's
(:mod:`onnx_moe_fuse.contract.ops`).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from onnx_moe_fuse.contract.ops import MOE, QMOE
from onnx_moe_fuse.contract.packing import QMOE_BITS, pack_size, unpack_qmoe_zero_points
from onnx_moe_fuse.verify.oracles.moe_activation import ACTIVATIONS, activation, gelu_tanh
from onnx_moe_fuse.verify.oracles.moe_checks import (
    check_activation,
    check_flag,
    check_float,
    check_k,
    check_rank,
    check_router_weights,
    check_shape,
    check_swiglu_params,
    check_tokens,
    is_int,
    optional_float,
)
from onnx_moe_fuse.verify.oracles.moe_routing import route_moe, route_qmoe, select_top_k
from onnx_moe_fuse.verify.oracles.quant import dequantize_qmoe

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
    activation_alpha: float = QMOE.default("activation_alpha"),
    activation_beta: float = QMOE.default("activation_beta"),
    swiglu_limit: float | None = None,
    fc1_bias: npt.ArrayLike | None = None,
    fc2_bias: npt.ArrayLike | None = None,
    normalize_routing_weights: int = QMOE.default("normalize_routing_weights"),
    router_weights: npt.ArrayLike | None = None,
    fc1_zero_points: npt.ArrayLike | None = None,
    fc2_zero_points: npt.ArrayLike | None = None,
) -> np.ndarray:
    """Compute ORT ``com.microsoft.QMoE`` with int weights (no FC3).

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
        normalize_routing_weights: 0 or 1; without ``router_weights`` no effect (ORT QMoE
            always softmaxes the k logits); with them, 1 renormalises the k gathered weights.
        router_weights: optional ``[T, E]`` (the input's dtype): the mixing weights, read at
            the experts the top-k of ``router_probs`` selects.
        fc1_zero_points: optional uint8 zero points in ORT's packed layout
            (:func:`onnx_moe_fuse.contract.packing.pack_qmoe_zero_points`): ``[E, fusion*I /
            pack]`` column-wise, ``[E, fusion*I, (H / block_size) / pack]`` block-wise
            (rounded up to whole bytes); absent: the symmetric point.
        fc2_zero_points: the same for FC2: ``[E, H / pack]`` or ``[E, H, (I / block_size) /
            pack]``.

    Returns:
        float32 array of ``input``'s shape.
    """
    x_in = np.asarray(input)
    router = np.asarray(router_probs)
    x, tokens, num_experts = check_tokens(x_in, router)
    hidden = x.shape[1]
    k = check_k(k, num_experts)
    normalize = check_flag(normalize_routing_weights, "normalize_routing_weights")
    mix = check_router_weights(router_weights, x_in, tokens, num_experts)
    activation_type, swiglu_fusion = check_activation(activation_type, swiglu_fusion, (1, 2))
    alpha, beta, limit = check_swiglu_params(activation_alpha, activation_beta, swiglu_limit)
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
        check_float(name, s)
    check_rank("fc2", w2, 3, "[E, H, I/pack]")
    check_rank("fc1", w1, 3, "[E, fusion*I, H/pack]")
    inter = w2.shape[2] * pack
    if inter <= 0:
        raise ValueError(f"fc2 has shape {w2.shape}: inter size I must be positive")
    check_shape("fc2", w2, (num_experts, hidden, inter // pack), "[E, H, I/pack]")
    if hidden % pack:
        raise ValueError(f"input hidden size H = {hidden} must be even for 4-bit weights")
    check_shape("fc1", w1, (num_experts, fusion * inter, hidden // pack), "[E, fusion*I, H/pack]")

    if block_size is None:
        check_shape("fc1_scales", s1, (num_experts, fusion * inter), "[E, fusion*I]")
        check_shape("fc2_scales", s2, (num_experts, hidden), "[E, H]")
    else:
        if not is_int(block_size) or block_size < 16 or block_size & (block_size - 1):
            raise ValueError(
                f"block_size must be None or a power of two >= 16 (ORT's rule), got {block_size!r}"
            )
        block_size = int(block_size)
        if hidden % block_size or inter % block_size:
            raise ValueError(
                f"block_size = {block_size} must divide both H = {hidden} and I = {inter}"
            )
        check_shape(
            "fc1_scales",
            s1,
            (num_experts, fusion * inter, hidden // block_size),
            "[E, fusion*I, H/block_size]",
        )
        check_shape(
            "fc2_scales", s2, (num_experts, hidden, inter // block_size), "[E, H, I/block_size]"
        )

    b1 = optional_float("fc1_bias", fc1_bias, (num_experts, fusion * inter), "[E, fusion*I]")
    b2 = optional_float("fc2_bias", fc2_bias, (num_experts, hidden), "[E, H]")

    z1, z2 = (
        None
        if z is None
        else unpack_qmoe_zero_points(z, bits, s.shape[1], s.shape[2] if s.ndim == 3 else None)
        for z, s in ((fc1_zero_points, s1), (fc2_zero_points, s2))
    )
    if block_size is None:
        z1, z2 = (None if z is None else z[:, :, 0] for z in (z1, z2))
    w1f = dequantize_qmoe(w1, s1, bits, block_size, dtype=np.float64, zero_points=z1)
    w2f = dequantize_qmoe(w2, s2, bits, block_size, dtype=np.float64, zero_points=z2)
    idx, weights = route_qmoe(router, k, router_weights=mix, normalize_routing_weights=normalize)
    act = {
        "activation_type": activation_type,
        "swiglu_fusion": swiglu_fusion,
        "activation_alpha": alpha,
        "activation_beta": beta,
        "swiglu_limit": limit,
    }
    out = _run_experts(x, idx, weights, w1f, b1, w2f, b2, None, None, act)
    return out.reshape(x_in.shape).astype(np.float32)


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
    swiglu_fusion: int = MOE.default("swiglu_fusion"),
    normalize_routing_weights: int = MOE.default("normalize_routing_weights"),
    activation_alpha: float = MOE.default("activation_alpha"),
    activation_beta: float = MOE.default("activation_beta"),
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
    x, _, num_experts = check_tokens(x_in, router)
    hidden = x.shape[1]
    k = check_k(k, num_experts)
    normalize = check_flag(normalize_routing_weights, "normalize_routing_weights")
    activation_type, swiglu_fusion = check_activation(activation_type, swiglu_fusion, (0, 1, 2))
    alpha, beta, limit = check_swiglu_params(activation_alpha, activation_beta, swiglu_limit)
    fusion = 2 if activation_type == "swiglu" and swiglu_fusion in (1, 2) else 1

    w1 = np.asarray(fc1)
    w2 = np.asarray(fc2)
    for name, w in (("fc1", w1), ("fc2", w2)):
        check_float(name, w)
        if w.dtype != x_in.dtype:
            raise ValueError(f"{name} has dtype {w.dtype}, but input has dtype {x_in.dtype}")
    check_rank("fc2", w2, 3, "[E, H, I]")
    check_rank("fc1", w1, 3, "[E, fusion*I, H]")
    inter = w2.shape[2]
    if inter <= 0:
        raise ValueError(f"fc2 has shape {w2.shape}: inter size I must be positive")
    check_shape("fc2", w2, (num_experts, hidden, inter), "[E, H, I]")
    check_shape("fc1", w1, (num_experts, fusion * inter, hidden), "[E, fusion*I, H]")

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
        check_float("fc3", w3)
        check_shape("fc3", w3, (num_experts, inter, hidden), "[E, I, H]")
        w3 = w3.astype(np.float64)

    b1 = optional_float("fc1_bias", fc1_bias, (num_experts, fusion * inter), "[E, fusion*I]")
    b2 = optional_float("fc2_bias", fc2_bias, (num_experts, hidden), "[E, H]")
    b3 = optional_float("fc3_bias", fc3_bias, (num_experts, inter), "[E, I]")

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
