"""Hand-written ONNX layers of the dense forms the PyTorch corpus exports, and their traps.

Each builder writes one layer with ``onnx.helper`` (weights from a seeded generator) in the
spelling the exporters write, so that the fuser is tested on the form apart from the corpus
files; each has a numpy reference written from the module's definition (not from the fuser's
reading of it):

* :func:`llama4_dense`: transformers' ``Llama4TextMoe``: ``TopK`` of the logits, the values
  scattered into ``-inf`` (``full_like(-inf).scatter_(1, idx, v)``), transposed, then the
  sigmoid; the tokens tiled over the experts and scaled by the flattened scores, one batched
  SwiGLU MLP over ``[E, T, H]``, summed over the experts, plus a shared expert. ``torchscript``
  writes the experts' output as TorchScript does (``view(-1, H)`` then ``reshape(E, -1, H)``).
  Traps: ``k = 2`` (a token would enter two experts at two scales), expert biases (an
  unselected expert maps its zero input to a nonzero output), and the output regrouped
  ``[-1, E, H]`` and swapped to ``[E, T, H]`` before the sum (rows of other tokens summed).
* :mod:`dense_forms_shared`: a shared expert inside the weighted combine (a loop).
* :func:`split_dense`: gpt-oss's dense experts as exported with dynamic shapes: the scatter
  into ``Expand(0, Shape(logits))``, the expert outputs and the dense weights split into
  ``[B, S]`` by Reshapes to shapes computed from ``Shape(x)``. Trap: the weights split
  ``[E, S, B]`` and transposed to ``[E, B, S]`` (valid shapes, other tokens' weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "F32",
    "int_tensor",
    "layer_model",
    "normal_weights",
    "silu",
    "tensor",
    "Llama4Spec",
    "SplitDenseSpec",
    "llama4_dense",
    "llama4_reference",
    "llama4_selected_reference",
    "split_dense",
    "split_dense_reference",
]

OPSET = 18
F32 = TensorProto.FLOAT


def tensor(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def int_tensor(name: str, values: list[int]) -> onnx.TensorProto:
    return tensor(name, np.array(values, dtype=np.int64))


def layer_model(nodes, inits, hidden: int, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", F32, ["T", hidden])],
        [helper.make_tensor_value_info("y", F32, ["T", hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def normal_weights(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


@dataclass(frozen=True)
class Llama4Spec:
    """One Llama4 dense layer: sizes, the exporter's spelling, and the trap knobs."""

    hidden: int = 16
    inter: int = 24
    experts: int = 4
    k: int = 1
    torchscript: bool = False  # view(-1, H) then reshape(E, -1, H) before the sum
    bias: bool = False  # trap: biased expert projections
    regroup_tokens_first: bool = False  # trap: reshape to [-1, E, H] before the sum
    seed: int = 7


def _llama4_weights(spec: Llama4Spec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    h, i, e = spec.hidden, spec.inter, spec.experts
    w = {
        "router": normal_weights(rng, (h, e), h),
        "gate_up": normal_weights(rng, (e, h, 2 * i), h),
        "down": normal_weights(rng, (e, i, h), i),
        "shared_gate": normal_weights(rng, (h, i), h),
        "shared_up": normal_weights(rng, (h, i), h),
        "shared_down": normal_weights(rng, (i, h), i),
    }
    if spec.bias:
        w["gate_up_bias"] = (rng.standard_normal((e, 1, 2 * i)) * 0.5).astype(np.float32)
        w["down_bias"] = (rng.standard_normal((e, 1, h)) * 0.5).astype(np.float32)
    return w


def llama4_dense(spec: Llama4Spec) -> onnx.ModelProto:
    """The layer as transformers' ``Llama4TextMoe`` exports (dynamo spelling, or TorchScript's)."""
    w = _llama4_weights(spec)
    h, e = spec.hidden, spec.experts
    inits = [tensor(n, a) for n, a in w.items()]
    inits += [
        int_tensor("k", [spec.k]),
        tensor("neg_inf", np.array(-np.inf, dtype=np.float32)),
        int_tensor("tile_reps", [e, 1]),
        int_tensor("column", [-1, 1]),
        int_tensor("grouped", [e, -1, h]),
        int_tensor("rows", [-1, h]),
        int_tensor("tokens_first", [-1, e, h]),
        int_tensor("expert_axis", [0]),
    ]
    node = helper.make_node
    nodes = [
        node("MatMul", ["x", "router"], ["logits"]),
        node("TopK", ["logits", "k"], ["top_v", "top_i"], axis=1),
        node("Shape", ["logits"], ["logits_shape"]),
        node("Expand", ["neg_inf", "logits_shape"], ["full_like"]),
        node("ScatterElements", ["full_like", "top_i", "top_v"], ["scattered"], axis=1),
        node("Transpose", ["scattered"], ["scores_t"], perm=[1, 0]),
        node("Sigmoid", ["scores_t"], ["scores"]),
        node("Tile", ["x", "tile_reps"], ["repeated"]),
        node("Reshape", ["scores", "column"], ["score_column"]),
        node("Mul", ["repeated", "score_column"], ["routed_in"]),
        node("Reshape", ["routed_in", "grouped"], ["routed_grouped"]),
        node("MatMul", ["routed_grouped", "gate_up"], ["gate_up_mm"]),
    ]
    gu = "gate_up_mm"
    if spec.bias:
        nodes.append(node("Add", [gu, "gate_up_bias"], ["gate_up_b"]))
        gu = "gate_up_b"
    nodes += [
        node("Split", [gu], ["gate", "up"], axis=2, num_outputs=2),
        node("Sigmoid", ["gate"], ["gate_sig"]),
        node("Mul", ["gate", "gate_sig"], ["gate_silu"]),
        node("Mul", ["up", "gate_silu"], ["act"]),
        node("MatMul", ["act", "down"], ["down_mm"]),
    ]
    out = "down_mm"
    if spec.bias:
        nodes.append(node("Add", [out, "down_bias"], ["down_b"]))
        out = "down_b"
    if spec.torchscript or spec.regroup_tokens_first:
        target = "tokens_first" if spec.regroup_tokens_first else "grouped"
        nodes += [
            node("Reshape", [out, "rows"], ["expert_rows"]),
            node("Reshape", ["expert_rows", target], ["expert_regrouped"]),
        ]
        out = "expert_regrouped"
    if spec.regroup_tokens_first:  # [T, E, H] of the rows e*T + t, swapped to [E, T, H]
        nodes.append(
            node(
                "Transpose",
                [
                    out,
                ],
                ["expert_swapped"],
                perm=[1, 0, 2],
            )
        )
        out = "expert_swapped"
    nodes += [
        node("ReduceSum", [out, "expert_axis"], ["routed_sum"], keepdims=0),
        node("MatMul", ["x", "shared_gate"], ["sh_gate"]),
        node("Sigmoid", ["sh_gate"], ["sh_gate_sig"]),
        node("Mul", ["sh_gate", "sh_gate_sig"], ["sh_silu"]),
        node("MatMul", ["x", "shared_up"], ["sh_up"]),
        node("Mul", ["sh_silu", "sh_up"], ["sh_act"]),
        node("MatMul", ["sh_act", "shared_down"], ["shared_out"]),
        node("Add", ["shared_out", "routed_sum"], ["y"]),
    ]
    return layer_model(nodes, inits, h, "llama4_text_moe")


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def _sigmoid(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-v))


def _llama4_expert(w: dict[str, np.ndarray], e: int, rows: np.ndarray) -> np.ndarray:
    gu = rows @ w["gate_up"][e] + (w["gate_up_bias"][e] if "gate_up_bias" in w else 0)
    gate, up = np.split(gu, 2, axis=-1)
    out = (up * silu(gate)) @ w["down"][e]
    return out + (w["down_bias"][e] if "down_bias" in w else 0)


def _llama4_shared(w: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    return (silu(x @ w["shared_gate"]) * (x @ w["shared_up"])) @ w["shared_down"]


def llama4_reference(spec: Llama4Spec, x: np.ndarray) -> np.ndarray:
    """Every expert on every token, its input scaled by sigmoid of the scattered score."""
    w = _llama4_weights(spec)
    x = x.astype(np.float64)
    logits = x @ w["router"]
    top = np.argsort(-logits, axis=1, kind="stable")[:, : spec.k]
    scores = np.full_like(logits, -np.inf)
    np.put_along_axis(scores, top, np.take_along_axis(logits, top, axis=1), axis=1)
    scale = _sigmoid(scores)  # [T, E]
    per_expert = np.stack(
        [_llama4_expert(w, e, x * scale[:, e : e + 1]) for e in range(spec.experts)]
    )
    if spec.regroup_tokens_first:
        blocks = per_expert.reshape(-1, spec.experts, spec.hidden)  # row e*T + t, E per block
        summed = blocks.transpose(1, 0, 2).sum(axis=0)
    else:
        summed = per_expert.sum(axis=0)
    return summed + _llama4_shared(w, x)


def llama4_selected_reference(spec: Llama4Spec, x: np.ndarray) -> np.ndarray:
    """What one fused top-1 node computes: only the selected expert, on the scaled token."""
    w = _llama4_weights(spec)
    x = x.astype(np.float64)
    logits = x @ w["router"]
    top = np.argmax(logits, axis=1)
    out = np.stack(
        [
            _llama4_expert(w, int(e), x[t : t + 1] * _sigmoid(logits[t, e]))[0]
            for t, e in enumerate(top)
        ]
    )
    return out + _llama4_shared(w, x)


# -- dense experts over [B, S] tokens, shapes computed at run time (gpt-oss, dynamo dynamic) ----


@dataclass(frozen=True)
class SplitDenseSpec:
    """A dense all-experts layer whose combine keeps the tokens' ``[B, S]`` split."""

    hidden: int = 16
    inter: int = 12
    experts: int = 4
    k: int = 2
    weights_split_swapped: bool = False  # trap: the weights split [E, S, B], then transposed
    seed: int = 13


def _split_weights(spec: SplitDenseSpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    h, i, e = spec.hidden, spec.inter, spec.experts
    return {
        "router": normal_weights(rng, (h, e), h),
        "gate_up": normal_weights(rng, (e, h, 2 * i), h),
        "down": normal_weights(rng, (e, i, h), i),
    }


def split_dense(spec: SplitDenseSpec) -> onnx.ModelProto:
    """gpt-oss's dense experts as torch.onnx (dynamo, dynamic shapes) exports them.

    The scatter target is ``zeros_like(logits)`` (``Expand(0, Shape(logits))``), the expert
    outputs ``Y [E, T, H]`` are split ``[E, B, S, H]`` and the dense weights ``[E, B, S]`` by
    Reshapes to shapes computed from ``Shape(x)``, multiplied and summed over the experts.
    """
    w = _split_weights(spec)
    h, e = spec.hidden, spec.experts
    inits = [tensor(n, a) for n, a in w.items()]
    inits += [
        int_tensor("k", [spec.k]),
        tensor("zero_f", np.array(0.0, dtype=np.float32)),
        int_tensor("rows", [-1, h]),
        int_tensor("axis0", [0]),
        int_tensor("axis_last", [-1]),
        int_tensor("experts", [e]),
        int_tensor("minus_one", [-1]),
        int_tensor("hidden", [h]),
        int_tensor("stack", [e, 1, 1]),
    ]
    node = helper.make_node
    nodes = [
        node("Shape", ["x"], ["batch"], start=0, end=1),
        node("Shape", ["x"], ["seq"], start=1, end=2),
        node("Reshape", ["x", "rows"], ["flat"]),
        node("MatMul", ["flat", "router"], ["logits"]),
        node("TopK", ["logits", "k"], ["top_v", "top_i"], axis=-1),
        node("Softmax", ["top_v"], ["top_w"], axis=1),
        node("Shape", ["logits"], ["logits_shape"]),
        node("Expand", ["zero_f", "logits_shape"], ["zeros_like"]),
        node("ScatterElements", ["zeros_like", "top_i", "top_w"], ["dense"], axis=1),
        node("Unsqueeze", ["flat", "axis0"], ["flat3"]),
        node("Expand", ["flat3", "stack"], ["repeated"]),
        node("MatMul", ["repeated", "gate_up"], ["gu"]),
        node("Split", ["gu"], ["gate", "up"], axis=2, num_outputs=2),
        node("Sigmoid", ["gate"], ["gate_sig"]),
        node("Mul", ["gate", "gate_sig"], ["gate_silu"]),
        node("Mul", ["up", "gate_silu"], ["act"]),
        node("MatMul", ["act", "down"], ["y"]),
        node("Concat", ["experts", "batch", "minus_one", "hidden"], ["y_split_shape"], axis=0),
        node("Reshape", ["y", "y_split_shape"], ["y_split"]),
        node("Transpose", ["dense"], ["dense_t"], perm=[1, 0]),
    ]
    if spec.weights_split_swapped:
        nodes += [
            node("Concat", ["experts", "seq", "minus_one"], ["w_split_shape"], axis=0),
            node("Reshape", ["dense_t", "w_split_shape"], ["w_swapped"]),
            node("Transpose", ["w_swapped"], ["w_split"], perm=[0, 2, 1]),
        ]
    else:
        nodes += [
            node("Concat", ["experts", "batch", "minus_one"], ["w_split_shape"], axis=0),
            node("Reshape", ["dense_t", "w_split_shape"], ["w_split"]),
        ]
    nodes += [
        node("Unsqueeze", ["w_split", "axis_last"], ["w4"]),
        node("Mul", ["y_split", "w4"], ["weighted"]),
        node("ReduceSum", ["weighted", "axis0"], ["out"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "dense_split_rows",
        [helper.make_tensor_value_info("x", F32, ["B", "S", h])],
        [helper.make_tensor_value_info("out", F32, ["B", "S", h])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def split_dense_reference(spec: SplitDenseSpec, x: np.ndarray) -> np.ndarray:
    """``out[b, s] = sum_j softmax(top-k logits)_j * expert_{idx_j}(x[b, s])`` (or the trap's)."""
    w = _split_weights(spec)
    b, s, h = x.shape
    flat = x.reshape(-1, h).astype(np.float64)
    logits = flat @ w["router"]
    top = np.argsort(-logits, axis=1, kind="stable")[:, : spec.k]
    vals = np.take_along_axis(logits, top, axis=1)
    soft = np.exp(vals - vals.max(-1, keepdims=True))
    soft /= soft.sum(-1, keepdims=True)
    dense = np.zeros_like(logits)
    np.put_along_axis(dense, top, soft, axis=1)  # [T, E]
    per_expert = []
    for e in range(spec.experts):
        gate, up = np.split(flat @ w["gate_up"][e], 2, axis=-1)
        per_expert.append((up * silu(gate)) @ w["down"][e])
    y = np.stack(per_expert).reshape(spec.experts, b, s, h)
    weights = dense.T.reshape(spec.experts, b, s)
    if spec.weights_split_swapped:
        weights = dense.T.reshape(spec.experts, s, b).transpose(0, 2, 1)
    return (y * weights[..., None]).sum(axis=0)
