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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["Llama4Spec", "llama4_dense", "llama4_reference", "llama4_selected_reference"]

OPSET = 18
F32 = TensorProto.FLOAT


def _init(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def _ints(name: str, values: list[int]) -> onnx.TensorProto:
    return _init(name, np.array(values, dtype=np.int64))


def _model(nodes, inits, hidden: int, name: str) -> onnx.ModelProto:
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


def _normal(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
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
        "router": _normal(rng, (h, e), h),
        "gate_up": _normal(rng, (e, h, 2 * i), h),
        "down": _normal(rng, (e, i, h), i),
        "shared_gate": _normal(rng, (h, i), h),
        "shared_up": _normal(rng, (h, i), h),
        "shared_down": _normal(rng, (i, h), i),
    }
    if spec.bias:
        w["gate_up_bias"] = (rng.standard_normal((e, 1, 2 * i)) * 0.5).astype(np.float32)
        w["down_bias"] = (rng.standard_normal((e, 1, h)) * 0.5).astype(np.float32)
    return w


def llama4_dense(spec: Llama4Spec) -> onnx.ModelProto:
    """The layer as transformers' ``Llama4TextMoe`` exports (dynamo spelling, or TorchScript's)."""
    w = _llama4_weights(spec)
    h, e = spec.hidden, spec.experts
    inits = [_init(n, a) for n, a in w.items()]
    inits += [
        _ints("k", [spec.k]),
        _init("neg_inf", np.array(-np.inf, dtype=np.float32)),
        _ints("tile_reps", [e, 1]),
        _ints("column", [-1, 1]),
        _ints("grouped", [e, -1, h]),
        _ints("rows", [-1, h]),
        _ints("tokens_first", [-1, e, h]),
        _ints("expert_axis", [0]),
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
    return _model(nodes, inits, h, "llama4_text_moe")


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def _sigmoid(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-v))


def _llama4_expert(w: dict[str, np.ndarray], e: int, rows: np.ndarray) -> np.ndarray:
    gu = rows @ w["gate_up"][e] + (w["gate_up_bias"][e] if "gate_up_bias" in w else 0)
    gate, up = np.split(gu, 2, axis=-1)
    out = (up * _silu(gate)) @ w["down"][e]
    return out + (w["down_bias"][e] if "down_bias" in w else 0)


def _llama4_shared(w: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    return (_silu(x @ w["shared_gate"]) * (x @ w["shared_up"])) @ w["shared_down"]


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
