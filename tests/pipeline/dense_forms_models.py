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
* :func:`shared_loop`: mistral-inference's ``MoeLayer`` loop with a shared expert inside the
  weighted sum, ``results[t_e] += w * (expert_e(x[t_e]) + S[t_e])``, as torch.onnx (dynamo)
  traces it (``split_products``: ``w * y + w * S``). Traps: ``S`` read at the slot index instead
  of the token (other tokens' rows), and ``S`` added by expert 0 alone.
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
    "Llama4Spec",
    "SharedLoopSpec",
    "SplitDenseSpec",
    "llama4_dense",
    "llama4_reference",
    "llama4_selected_reference",
    "shared_loop",
    "shared_loop_fused_reference",
    "shared_loop_reference",
    "split_dense",
    "split_dense_reference",
]

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


# -- a shared expert inside the weighted combine (mistral-inference's loop, dynamo spelling) -----


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
    w = {"router": _normal(rng, (h, spec.experts), h)}
    for name in ("shared", *(f"e{e}" for e in range(spec.experts))):
        w[f"{name}_w1"] = _normal(rng, (h, i), h)
        w[f"{name}_w3"] = _normal(rng, (h, i), h)
        w[f"{name}_w2"] = _normal(rng, (i, h), i)
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
    inits = [_init(n, a) for n, a in w.items()]
    inits += [
        _ints("k", [spec.k]),
        _ints("zero", [0]),
        _ints("one", [1]),
        _ints("two", [2]),
        _ints("axis1", [1]),
        _ints("axis2", [2]),
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
        inits.append(_ints(f"{p}_id", [e]))
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
    return _model(nodes, inits, spec.hidden, "shared_inside_combine")


def _swiglu(w: dict[str, np.ndarray], name: str, rows: np.ndarray) -> np.ndarray:
    return (_silu(rows @ w[f"{name}_w1"]) * (rows @ w[f"{name}_w3"])) @ w[f"{name}_w2"]


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
        "router": _normal(rng, (h, e), h),
        "gate_up": _normal(rng, (e, h, 2 * i), h),
        "down": _normal(rng, (e, i, h), i),
    }


def split_dense(spec: SplitDenseSpec) -> onnx.ModelProto:
    """gpt-oss's dense experts as torch.onnx (dynamo, dynamic shapes) exports them.

    The scatter target is ``zeros_like(logits)`` (``Expand(0, Shape(logits))``), the expert
    outputs ``Y [E, T, H]`` are split ``[E, B, S, H]`` and the dense weights ``[E, B, S]`` by
    Reshapes to shapes computed from ``Shape(x)``, multiplied and summed over the experts.
    """
    w = _split_weights(spec)
    h, e = spec.hidden, spec.experts
    inits = [_init(n, a) for n, a in w.items()]
    inits += [
        _ints("k", [spec.k]),
        _init("zero_f", np.array(0.0, dtype=np.float32)),
        _ints("rows", [-1, h]),
        _ints("axis0", [0]),
        _ints("axis_last", [-1]),
        _ints("experts", [e]),
        _ints("minus_one", [-1]),
        _ints("hidden", [h]),
        _ints("stack", [e, 1, 1]),
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
        per_expert.append((up * _silu(gate)) @ w["down"][e])
    y = np.stack(per_expert).reshape(spec.experts, b, s, h)
    weights = dense.T.reshape(spec.experts, b, s)
    if spec.weights_split_swapped:
        weights = dense.T.reshape(spec.experts, s, b).transpose(0, 2, 1)
    return (y * weights[..., None]).sum(axis=0)
