"""Routing of the MoE and QMoE oracles: top-k with ORT's ties, the two softmax orders.

As measured on ORT 1.32 CPU (``onnx_moe_fuse.verify.oracles.moe`` has the details): QMoE takes
the top-k logits and a softmax over those ``k``, or, given ``router_weights``, those weights at
the selected experts (renormalised only when ``normalize_routing_weights=1``); MoE a softmax
over all experts, top-k, and a renormalisation only when ``normalize_routing_weights=1``. Exact
ties go to the highest expert index, as ORT's MoE and QMoE do.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from onnx_moe_fuse.verify.oracles.moe_checks import check_flag, check_k

__all__ = ["route_moe", "route_qmoe", "select_top_k"]


def select_top_k(logits: npt.ArrayLike, k: int) -> np.ndarray:
    """Return the indices ``[T, k]`` of the ``k`` largest logits per row, largest first.

    Exact ties go to the highest expert index (ORT MoE/QMoE behaviour): a stable descending
    sort of the reversed row.
    """
    a = np.asarray(logits, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"logits must have rank 2 [T, E], got shape {a.shape}")
    e = a.shape[1]
    k = check_k(k, e)
    order = np.argsort(-a[:, ::-1], axis=1, kind="stable")[:, :k]
    return (e - 1 - order).astype(np.int64)


def route_qmoe(
    router_probs: npt.ArrayLike,
    k: int,
    *,
    router_weights: npt.ArrayLike | None = None,
    normalize_routing_weights: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """QMoE routing: top-k logits; softmax over the ``k`` selected ones, or ``router_weights``.

    Without ``router_weights`` the weights are the softmax of the ``k`` selected logits
    (``normalize_routing_weights`` changes nothing). With ``router_weights [T, E]`` they are
    ``router_weights`` at the selected experts, divided by their sum when
    ``normalize_routing_weights=1`` (a row whose sum is 0 gets weights 0, as ORT CPU).

    Returns ``(expert_indices [T, k] int64, weights [T, k] float64)``.
    """
    normalize = check_flag(normalize_routing_weights, "normalize_routing_weights")
    logits = np.asarray(router_probs, dtype=np.float64)
    idx = select_top_k(logits, k)
    if router_weights is not None:
        w = np.take_along_axis(np.asarray(router_weights, dtype=np.float64), idx, axis=1)
        if normalize:
            total = w.sum(axis=1, keepdims=True)
            w = np.divide(w, total, out=np.zeros_like(w), where=total != 0)
        return idx, w
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
    normalize = check_flag(normalize_routing_weights, "normalize_routing_weights")
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
