"""The measured error of a float MoE layer quantised on request (``--quantize``).

:func:`measure_quantization_error` is the ``error_meter`` the fronts give the rules
(:class:`onnx_moe_fuse.rewrites.moe.quantize.Quantization`): it runs the float layer (the MoE
node's inputs, :func:`onnx_moe_fuse.verify.oracles.moe.moe`) and the quantised node (QMoE's,
:func:`~onnx_moe_fuse.verify.oracles.moe.qmoe`) on the same fresh random inputs and returns the
error scale-aware, as the checker measures it: ``max_rel_error = max|y_q - y| / max|y|`` over
every seed.

How, so that memory stays bounded on large layers (the oracles work in float64): the experts
are taken in groups of :data:`GROUP` (every expert is measured), each group routed on its own
(``k`` capped at the group's size) by standard-normal logits, with :data:`TOKENS` standard-normal
tokens per seed; both nodes route by softmax over the top-k logits renormalised (what QMoE
computes, and MoE with ``normalize_routing_weights=1``), so the difference is the weights'
quantisation alone. The routing a fused node is really fed (its own, or the routing
construction's ``router_weights``) mixes the same expert outputs with other non-negative weights.
:func:`verify_tolerance` turns a report's measured errors into the checker's tolerance.
The activations are not quantised here: ``accuracy_level=4`` on ORT CPU adds int8 activations
(about 1 % more, measured), which the record and the checker's ORT path state separately.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_moe_fuse.verify.oracles.moe import moe, qmoe

__all__ = [
    "GROUP",
    "SEEDS",
    "TOKENS",
    "VERIFY_FACTOR",
    "QuantizedTolerance",
    "measure_quantization_error",
    "verify_tolerance",
]

#: Experts measured together (each group's float64 copies stay small).
GROUP = 8
#: Random tokens per seed and group.
TOKENS = 128
#: The seeds of the random inputs (fixed, so a report is reproducible).
SEEDS: tuple[int, ...] = (0,)


def _activation(attributes: Mapping[str, Any]) -> dict[str, Any]:
    limit = attributes.get("swiglu_limit")
    return {
        "activation_type": attributes["activation_type"],
        "swiglu_fusion": int(attributes.get("swiglu_fusion", 0)),
        "activation_alpha": float(attributes.get("activation_alpha", 1.0)),
        "activation_beta": float(attributes.get("activation_beta", 0.0)),
        "swiglu_limit": None if limit is None or math.isinf(limit) else float(limit),
    }


def _group(arr: np.ndarray | None, lo: int, hi: int) -> np.ndarray | None:
    return None if arr is None else np.ascontiguousarray(arr[lo:hi])


def measure_quantization_error(
    floats: Mapping[str, Any],
    quantized: Mapping[str, Any],
    attributes: Mapping[str, Any],
    *,
    seeds: Sequence[int] = SEEDS,
    tokens: int = TOKENS,
) -> dict[str, Any]:
    """Run the float layer and its quantised node on random inputs; the error, scale-aware.

    ``floats``: MoE's inputs by name (``fc1_experts_weights [E, N1, H]``, ``fc2_experts_weights
    [E, H, I]``, optional biases); ``quantized``: QMoE's (codes, scales, the same biases);
    ``attributes``: the QMoE node's semantic attributes (``k``, the activation,
    ``expert_weight_bits``, ``block_size``). Returns ``{"max_rel_error", "max_abs_error",
    "measured_on"}`` (JSON-ready).
    """
    w1 = np.asarray(floats["fc1_experts_weights"])
    w2 = np.asarray(floats["fc2_experts_weights"])
    b1, b2 = floats.get("fc1_experts_bias"), floats.get("fc2_experts_bias")
    q1, s1 = quantized["fc1_experts_weights"], quantized["fc1_scales"]
    q2, s2 = quantized["fc2_experts_weights"], quantized["fc2_scales"]
    experts, hidden = w2.shape[0], w2.shape[1]
    k = int(attributes["k"])
    bits = int(attributes["expert_weight_bits"])
    block = int(attributes.get("block_size") or 0) or None
    act = _activation(attributes)
    worst_rel = worst_abs = 0.0
    for lo in range(0, experts, GROUP):
        hi = min(experts, lo + GROUP)
        kk = min(k, hi - lo)
        bias1, bias2 = _group(b1, lo, hi), _group(b2, lo, hi)
        for seed in seeds:
            rng = np.random.default_rng([seed, lo])
            x = rng.standard_normal((tokens, hidden)).astype(w1.dtype)
            logits = rng.standard_normal((tokens, hi - lo)).astype(w1.dtype)
            ref = moe(
                x,
                logits,
                w1[lo:hi],
                w2[lo:hi],
                fc1_bias=bias1,
                fc2_bias=bias2,
                k=kk,
                normalize_routing_weights=1,
                **act,
            ).astype(np.float64)
            got = qmoe(
                x,
                logits,
                q1[lo:hi],
                s1[lo:hi],
                q2[lo:hi],
                s2[lo:hi],
                k=kk,
                expert_weight_bits=bits,
                block_size=block,
                fc1_bias=bias1,
                fc2_bias=bias2,
                **act,
            ).astype(np.float64)
            err = float(np.abs(got - ref).max())
            scale = float(np.abs(ref).max())
            worst_abs = max(worst_abs, err)
            worst_rel = max(worst_rel, err / scale if scale > 0 else (math.inf if err else 0.0))
    return {
        "max_rel_error": worst_rel,
        "max_abs_error": worst_abs,
        "measured_on": (
            f"numpy oracles, float MoE vs the QMoE node on {tokens} random tokens x seeds "
            f"{list(seeds)}, every expert (groups of {GROUP}, top-{min(k, GROUP)} softmax "
            "routing); max_rel_error = max|y_q - y| / max|y|"
        ),
    }


# -- the checker's tolerance ------------------------------------------------------------------

#: ``--verify`` of a model with quantised layers: rtol = this x the sum of their measured errors.
#: Why a margin: the measurement is a maximum over its own random inputs and routing; on the
#: model's inputs and router the same statistic came out up to 1.76x the measured value (the
#: float samples, int4 and int8, 10 seeds each), and errors of successive layers add.
VERIFY_FACTOR = 2.5


@dataclass(frozen=True)
class QuantizedTolerance:
    """The checker's relative tolerance for a model with quantised layers, and why."""

    rtol: float
    note: str


def verify_tolerance(fusions: Iterable[Mapping[str, Any]]) -> QuantizedTolerance | None:
    """The tolerance for the fusions of a report (None: no layer was quantised on request).

    ``rtol = VERIFY_FACTOR * sum(max_rel_error)`` over the quantised layers, compared against
    the float original as any output is (``max|fused - original| <= rtol * max|original|``).
    """
    errors = [
        (f.get("name") or "?", float(f["quantization"]["max_rel_error"]))
        for f in fusions
        if isinstance(f.get("quantization"), Mapping)
        and f["quantization"].get("max_rel_error") is not None
    ]
    if not errors:
        return None
    rtol = VERIFY_FACTOR * sum(e for _, e in errors)
    shown = ", ".join(f"{name} {e:.3g}" for name, e in errors[:4])
    more = f" and {len(errors) - 4} more" if len(errors) > 4 else ""
    return QuantizedTolerance(
        rtol,
        f"quantised layers (--quantize): not exact; compared with the float original at rtol "
        f"{rtol:.3g} = {VERIFY_FACTOR:g} x the sum of the layers' measured errors ({shown}{more})",
    )
