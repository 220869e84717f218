"""A shared expert inside the weighted combine: mistral-inference's loop and its traps.

:func:`shared_loop` writes mistral-inference's ``MoeLayer`` loop with a shared expert inside
the weighted sum, ``results[t_e] += w * (expert_e(x[t_e]) + S[t_e])``, as torch.onnx (dynamo)
traces it (``split_products``: ``w * y + w * S``). Traps: ``S`` read at the slot index instead
of the token (other tokens' rows), and ``S`` added by expert 0 alone.

Its numpy references: the loop as written (:func:`shared_loop_reference`) and what the fused
node plus the separate term computes (:func:`shared_loop_fused_reference`), written apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from dense_forms_models import int_tensor, layer_model, normal_weights, silu, tensor
from onnx import helper, numpy_helper

__all__ = ["SharedLoopSpec", "shared_loop", "shared_loop_fused_reference", "shared_loop_reference"]


@dataclass(frozen=True)
class SharedLoopSpec:
    """``results[t_e] += w * (expert_e(x[t_e]) + S[t_e])`` over every expert, and trap knobs."""

    hidden: int = 16
    inter: int = 12
    experts: int = 4
    k: int = 2
    split_products: bool = False  # w * y + w * s instead of w * (y + s)
    shared_at_slots: bool = False  # trap: S gathered at the slot index j, not the token t
    shared_in_first_only: bool = False  # trap: only expert 0 adds S
    seed: int = 11


def _shared_weights(spec: SharedLoopSpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    h, i = spec.hidden, spec.inter
    w = {"router": normal_weights(rng, (h, spec.experts), h)}
    for name in ("shared", *(f"e{e}" for e in range(spec.experts))):
        w[f"{name}_w1"] = normal_weights(rng, (h, i), h)
        w[f"{name}_w3"] = normal_weights(rng, (h, i), h)
        w[f"{name}_w2"] = normal_weights(rng, (i, h), i)
    return w


def _swiglu_nodes(prefix: str, rows: str, weights: str) -> tuple[list[onnx.NodeProto], str]:
    node = helper.make_node
    return [
        node("MatMul", [rows, f"{weights}_w1"], [f"{prefix}_g"]),
        node("Sigmoid", [f"{prefix}_g"], [f"{prefix}_gs"]),
        node("Mul", [f"{prefix}_g", f"{prefix}_gs"], [f"{prefix}_silu"]),
        node("MatMul", [rows, f"{weights}_w3"], [f"{prefix}_u"]),
        node("Mul", [f"{prefix}_silu", f"{prefix}_u"], [f"{prefix}_a"]),
        node("MatMul", [f"{prefix}_a", f"{weights}_w2"], [f"{prefix}_y"]),
    ], f"{prefix}_y"


def shared_loop(spec: SharedLoopSpec) -> onnx.ModelProto:
    """The loop as torch.onnx (dynamo) traces it: NonZero rows, GatherND, ScatterND back."""
    w = _shared_weights(spec)
    inits = [tensor(n, a) for n, a in w.items()]
    inits += [
        int_tensor("k", [spec.k]),
        int_tensor("zero", [0]),
        int_tensor("one", [1]),
        int_tensor("two", [2]),
        int_tensor("axis1", [1]),
        int_tensor("axis2", [2]),
    ]
    node = helper.make_node
    zeros = numpy_helper.from_array(np.zeros(1, np.float32), "fill")
    nodes = [
        node("MatMul", ["x", "router"], ["logits"]),
        node("Softmax", ["logits"], ["probs"], axis=-1),
        node("TopK", ["probs", "k"], ["top_w", "top_i"], axis=-1),
        node("Unsqueeze", ["top_w", "axis2"], ["top_w3"]),
        node("Shape", ["x"], ["x_shape"]),
        node("ConstantOfShape", ["x_shape"], ["acc_0"], value=zeros),
    ]
    body, shared = _swiglu_nodes("shared", "x", "shared")
    nodes += body
    acc = "acc_0"
    for e in range(spec.experts):
        p = f"e{e}"
        inits.append(int_tensor(f"{p}_id", [e]))
        nodes += [
            node("Equal", ["top_i", f"{p}_id"], [f"{p}_mask"]),
            node("NonZero", [f"{p}_mask"], [f"{p}_nz"]),
            node("Transpose", [f"{p}_nz"], [f"{p}_pairs"], perm=[1, 0]),
            node("Slice", [f"{p}_pairs", "zero", "one", "one"], [f"{p}_t2"]),
            node("Squeeze", [f"{p}_t2", "axis1"], [f"{p}_t"]),
            node("Slice", [f"{p}_pairs", "one", "two", "one"], [f"{p}_j2"]),
            node("Squeeze", [f"{p}_j2", "axis1"], [f"{p}_j"]),
            node("Unsqueeze", [f"{p}_t", "axis1"], [f"{p}_tu"]),
            node("Unsqueeze", [f"{p}_j", "axis1"], [f"{p}_ju"]),
            node("Concat", [f"{p}_tu", f"{p}_ju"], [f"{p}_tj"], axis=-1),
            node("GatherND", [acc, f"{p}_tu"], [f"{p}_prev"]),
            node("GatherND", ["top_w3", f"{p}_tj"], [f"{p}_w"]),
            node("GatherND", ["x", f"{p}_tu"], [f"{p}_x"]),
        ]
        body, y = _swiglu_nodes(p, f"{p}_x", p)
        nodes += body
        shared_rows = f"{p}_ju" if spec.shared_at_slots else f"{p}_tu"
        if spec.shared_in_first_only and e > 0:
            nodes.append(node("Mul", [f"{p}_w", y], [f"{p}_upd"]))
        elif spec.split_products:
            nodes += [
                node("GatherND", [shared, shared_rows], [f"{p}_s"]),
                node("Mul", [f"{p}_w", y], [f"{p}_wy"]),
                node("Mul", [f"{p}_w", f"{p}_s"], [f"{p}_ws"]),
                node("Add", [f"{p}_wy", f"{p}_ws"], [f"{p}_upd"]),
            ]
        else:
            nodes += [
                node("GatherND", [shared, shared_rows], [f"{p}_s"]),
                node("Add", [y, f"{p}_s"], [f"{p}_ys"]),
                node("Mul", [f"{p}_w", f"{p}_ys"], [f"{p}_upd"]),
            ]
        out = "y" if e == spec.experts - 1 else f"acc_{e + 1}"
        nodes += [
            node("Add", [f"{p}_prev", f"{p}_upd"], [f"{p}_new"]),
            node("ScatterND", [acc, f"{p}_tu", f"{p}_new"], [out]),
        ]
        acc = out
    return layer_model(nodes, inits, spec.hidden, "shared_inside_combine")


def _swiglu(w: dict[str, np.ndarray], name: str, rows: np.ndarray) -> np.ndarray:
    return (silu(rows @ w[f"{name}_w1"]) * (rows @ w[f"{name}_w3"])) @ w[f"{name}_w2"]


def shared_loop_reference(spec: SharedLoopSpec, x: np.ndarray) -> np.ndarray:
    """Per token: the sum over its k slots of the weight times (its expert + the shared row)."""
    w = _shared_weights(spec)
    x = x.astype(np.float64)
    logits = x @ w["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=1, kind="stable")[:, : spec.k]
    shared = _swiglu(w, "shared", x)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(top[t]):
            added = shared[j] if spec.shared_at_slots else shared[t]
            if spec.shared_in_first_only and e > 0:
                added = 0.0
            out[t] += probs[t, e] * (_swiglu(w, f"e{e}", x[t : t + 1])[0] + added)
    return out


def shared_loop_fused_reference(spec: SharedLoopSpec, x: np.ndarray) -> np.ndarray:
    """What the fused node plus the separate term computes: routed sum + (sum_j w) * S[t]."""
    w = _shared_weights(spec)
    x = x.astype(np.float64)
    logits = x @ w["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=1, kind="stable")[:, : spec.k]
    gate = np.take_along_axis(probs, top, axis=1).sum(-1, keepdims=True)
    routed = np.stack(
        [
            sum(probs[t, e] * _swiglu(w, f"e{e}", x[t : t + 1])[0] for e in top[t])
            for t in range(x.shape[0])
        ]
    )
    return routed + gate * _swiglu(w, "shared", x)
