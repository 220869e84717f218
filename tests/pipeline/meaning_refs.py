"""Numpy references of the meaning-set layers (``onnx_moe_fuse.samples.handwritten_meaning``).

Each reference recomputes its layer from the model's constants (read by name) and the input,
token by token and slot by slot in float64, without looking at how the graph spells it: the
experts as ``y[t] = sum_j w[t, j] * expert(idx[t, j], x[t])``, the traps as what they really
compute (another token's row, another expert's bias, ...). Used by ``test_meaning_layers.py``.
"""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

WEEKLY_SCRIPT = Path(__file__).with_name("weekly_run_model.py")


# -- running ---------------------------------------------------------------------------------------


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def weekly_python() -> str | None:
    """onnx-weekly's venv python (opset 29's ReferenceEvaluator), None when absent."""
    python = os.environ.get("ONNX_WEEKLY_PYTHON") or str(
        Path(__file__).resolve().parents[2] / ".venv-weekly" / "bin" / "python"
    )
    return python if Path(python).is_file() else None


def weekly_run(python: str, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Run ``model`` in onnx-weekly's ReferenceEvaluator (a subprocess of its own venv)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        (path / "model.onnx").write_bytes(model.SerializeToString())
        np.savez(path / "in.npz", **feeds)
        done = subprocess.run(
            [python, str(WEEKLY_SCRIPT), str(path / "model.onnx"), str(path / "in.npz"),
             str(path / "out.npz")],
            capture_output=True,
            text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return np.load(path / "out.npz")["output"]


def random_input(model: onnx.ModelProto, rng: np.random.Generator, tokens: int = 7):
    """The one graph input, random N(0, 1); every dim_param takes ``tokens``."""
    (inp,) = model.graph.input
    dims = [
        d.dim_value if d.HasField("dim_value") else tokens for d in inp.type.tensor_type.shape.dim
    ]
    return inp.name, rng.standard_normal(dims).astype(np.float32)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """Largest absolute difference relative to the largest magnitude of ``want`` (scale-aware)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())


def consts(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Every initializer and Constant-node value of ``model`` by name."""
    out = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            out[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return out


# -- building blocks ----------------------------------------------------------------------------


def softmax(z: np.ndarray, axis: int = -1) -> np.ndarray:
    ez = np.exp(z - z.max(axis=axis, keepdims=True))
    return ez / ez.sum(axis=axis, keepdims=True)


def topk(p: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(p, idx, axis=-1), idx


def renorm_topk(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    vals, idx = topk(probs, k)
    return vals / vals.sum(-1, keepdims=True), idx


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def silu(z: np.ndarray) -> np.ndarray:
    return z * sigmoid(z)


def gelu_erf(z: np.ndarray) -> np.ndarray:
    return 0.5 * z * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))


def gelu_tanh(z: np.ndarray) -> np.ndarray:
    return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))


def f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def dequant_axis1(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``q * scale`` (zero point 0), ``scale`` blocked along axis 1."""
    block = q.shape[1] // scale.shape[1]
    return q.astype(np.float64) * np.repeat(f64(scale), block, axis=1)


def swiglu_expert(wg, wu, wd, bias=None):
    """``expert(e, v)`` of SwiGLU weights; ``bias(name, e)`` adds per-expert biases."""
    b = bias or (lambda _n, _e: 0.0)

    def expert(e: int, v: np.ndarray) -> np.ndarray:
        act = silu(v @ wg[e] + b("gate", e)) * (v @ wu[e] + b("up", e))
        return act @ wd[e] + b("down", e)

    return expert


def routed(x, w, idx, expert, row_input=None, out_token=None) -> np.ndarray:
    """``y[out_token(t)] += w[t, j] * expert(idx[t, j], row_input(t, j))``, token by token.

    The defaults (``x[t]`` in, token ``t`` out) are the MoE layer; the traps pass others.
    """
    t_count, k = idx.shape
    y = np.zeros((t_count, x.shape[-1]), np.float64)
    for t in range(t_count):
        for j in range(k):
            v = x[t] if row_input is None else row_input(t, j)
            dest = t if out_token is None else out_token(t)
            y[dest] += w[t, j] * expert(int(idx[t, j]), v)
    return y


# -- references, one per family -----------------------------------------------------------------

ACTIVATIONS = {
    "act_silu_by_hand": silu,
    "act_gelu_erf_by_hand": gelu_erf,
    "act_gelu_tanh_by_hand": gelu_tanh,
    "trap_act_silu_off": lambda z: z * sigmoid(1.01 * z),
}


def ref_activation(name: str):
    def ref(c, x):
        k = int(c["top_k"][0])
        w, idx = renorm_topk(softmax(x @ c["router.weight"], axis=-1), k)
        w1, w2 = f64(c["experts.fc1"]), f64(c["experts.fc2"])
        if name == "act_swiglu_by_hand" or name.startswith(("softmax", "trap_softmax")):
            expert = swiglu_expert(w1, f64(c["experts.fc3"]), w2)
        else:
            act = ACTIVATIONS[name]
            expert = lambda e, v: act(v @ w1[e]) @ w2[e]  # noqa: E731
        if name == "trap_softmax_token_axis":
            w, idx = renorm_topk(softmax(x @ c["router.weight"], axis=0), k)
        return routed(x, w, idx, expert)

    return ref


def _rows_setup(c, x):
    k = int(c["topk_k"][0])
    w, idx = renorm_topk(softmax(x @ c["moe.gate.weight"]), k)
    gate, up, down = (f64(c[f"moe.experts.{n}"]) for n in ("gate", "up", "down"))
    return w, idx, swiglu_expert(gate, up, down), k


def ref_rows(c, x):
    w, idx, expert, _ = _rows_setup(c, x)
    return routed(x, w, idx, expert)


def ref_rows_wrong_token(c, x):
    w, idx, expert, k = _rows_setup(c, x)
    t = x.shape[0]
    return routed(x, w, idx, expert, row_input=lambda tok, j: x[(tok * k + j) % t])


def ref_scatter_wrong_token(c, x):
    w, idx, expert, _ = _rows_setup(c, x)
    return routed(x, w, idx, expert, out_token=lambda tok: (tok + 1) % x.shape[0])


def ref_top1(trap: bool):
    def ref(c, x):
        vals, idx = topk(softmax(x @ c["wg"]), 1)
        weight = 1.0 - vals if trap else vals
        return routed(x, weight, idx, swiglu_expert(f64(c["w1"]), f64(c["w3"]), f64(c["w2"])))

    return ref


def ref_top1_split(trap: str | None):
    """:func:`ref_top1` on ``[B, S, H]`` tokens, token ``t = b * S + s``.

    The traps: the weight ``1 - p`` (``"one_minus"``), or the experts run on the sequence
    reversed (``"reversed"``).
    """

    def ref(c, x):
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        vals, idx = topk(softmax(flat @ c["wg"]), 1)
        weight = 1.0 - vals if trap == "one_minus" else vals
        rev = x[:, ::-1].reshape(-1, h)
        rows = (lambda t, j: rev[t]) if trap == "reversed" else None
        expert = swiglu_expert(f64(c["w1"]), f64(c["w3"]), f64(c["w2"]))
        return routed(flat, weight, idx, expert, rows).reshape(b, s, -1)

    return ref


def ref_split_router(swapped: bool):
    """The router on ``[B, S, H]``, ReLU experts on the ``[T, H]`` view.

    ``swapped``: the ids of token ``(s, b)`` (the trap's Transpose) at token ``(b, s)``.
    """

    def ref(c, x):
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        w, idx = topk(softmax(flat @ c["wg"]), int(c["k"][0]))
        if swapped:
            idx = idx.reshape(b, s, -1).transpose(1, 0, 2).reshape(b * s, -1)
        w1, w2 = f64(c["w1"]), f64(c["w2"])
        expert = lambda e, v: np.maximum(v @ w1[e], 0.0) @ w2[e]  # noqa: E731
        return routed(flat, w, idx, expert).reshape(b, s, -1)

    return ref


def ref_pair_rows(experts_run: int | None):
    """Softmax top-k weights as they are, ReLU experts (per-expert ``w1_e``, ``w2_e``).

    The trap's loop runs only the first ``experts_run`` experts (the others' pairs stay zero).
    """

    def ref(c, x):
        w, idx = topk(softmax(x @ c["wg"]), int(c["k"][0]))
        ran = range(experts_run) if experts_run is not None else None

        def expert(e, v):
            if ran is not None and e not in ran:
                return np.zeros(x.shape[-1])
            return np.maximum(v @ f64(c[f"w1_{e}"]), 0.0) @ f64(c[f"w2_{e}"])

        return routed(x, w, idx, expert)

    return ref


def ref_bias(rank: str):
    def ref(c, x):
        w, idx = renorm_topk(softmax(x @ c["router"]), int(c["k"][0]))
        ws = {n: f64(c[f"experts.{n}.weight"]) for n in ("gate", "up", "down")}
        bs = {n: f64(c[f"{n}.bias"]).reshape(ws[n].shape[0], -1) for n in ws}
        e_count = ws["gate"].shape[0]
        shift = 1 if rank == "other_ids" else 0
        expert = swiglu_expert(
            ws["gate"], ws["up"], ws["down"], lambda n, e: bs[n][(e + shift) % e_count]
        )
        return routed(x, w, idx, expert)

    return ref


def ref_int8(trap: bool):
    def ref(c, x):
        w, idx = renorm_topk(softmax(x @ c["gate_router"]), int(c["gate_k"][0]))
        wg, wu, wd = (
            f64(c[f"w_{n}_int8"]) * f64(c[f"w_{n}_scale"]) for n in ("gate", "up", "down")
        )
        y = np.zeros(x.shape, np.float64)
        for t in range(x.shape[0]):
            for j in range(idx.shape[1]):
                e, e_up = int(idx[t, j]), int(idx[t, 1 - j] if trap else idx[t, j])
                act = silu(x[t] @ wg[e]) * (x[t] @ wu[e_up])
                y[t] += w[t, j] * (act @ wd[e])
        return y

    return ref


def ref_qwen3_flat(trap: bool):
    def ref(c, x):
        tokens = x.reshape(-1, x.shape[-1])
        k = int(c["mlp.gate.k"][0])
        w, idx = renorm_topk(softmax(tokens @ c["mlp.gate.router"]), k)
        gate, up, down = (
            dequant_axis1(c[f"mlp.experts.{n}.qweight"], c[f"mlp.experts.{n}.scales"])
            for n in ("gate_proj", "up_proj", "down_proj")
        )
        if trap:  # row r = t*k + j weighted by the slot-major flat weights' entry r
            t_count = tokens.shape[0]
            flat = w.T.reshape(-1)
            w = np.array([[flat[t * k + j] for j in range(k)] for t in range(t_count)])
        y = routed(tokens, w, idx, swiglu_expert(gate, up, down))
        return y.reshape(x.shape)

    return ref


def ref_gmm(trap: bool):
    def ref(c, x):
        w, idx = renorm_topk(softmax(x @ c["router"]), int(c["k"][0]))
        wg, wu, wd = (f64(c[f"w_{n}"]) for n in ("gate", "up", "down"))
        y = np.zeros(x.shape, np.float64)
        for t in range(x.shape[0]):
            for j in range(idx.shape[1]):
                e, e_down = int(idx[t, j]), int(idx[t, 1 - j] if trap else idx[t, j])
                y[t] += w[t, j] * ((silu(x[t] @ wg[e]) * (x[t] @ wu[e])) @ wd[e_down])
        return y

    return ref


REFERENCES = {
    **{n: ref_activation(n) for n in ACTIVATIONS},
    "act_swiglu_by_hand": ref_activation("act_swiglu_by_hand"),
    "softmax_by_hand_max": ref_activation("softmax_by_hand_max"),
    "softmax_by_hand_nomax": ref_activation("softmax_by_hand_nomax"),
    "trap_softmax_token_axis": ref_activation("trap_softmax_token_axis"),
    **{f"rows_{n}": ref_rows for n in ("tile", "gather_range", "concat", "expand")},
    "trap_rows_wrong_token": ref_rows_wrong_token,
    "combine_scatter_elements": ref_rows,
    "combine_scatter_nd": ref_rows,
    "trap_scatter_wrong_token": ref_scatter_wrong_token,
    **{f"bias_{n}": ref_bias(n) for n in ("en_unsqueeze", "e1n", "after_reshape")},
    "trap_bias_other_ids": ref_bias("other_ids"),
    "top1_squeezed": ref_top1(False),
    "trap_top1_one_minus": ref_top1(True),
    "top1_split": ref_top1_split(None),
    "trap_top1_split_one_minus": ref_top1_split("one_minus"),
    "trap_top1_split_reversed": ref_top1_split("reversed"),
    "split_router_flat_experts": ref_split_router(False),
    "trap_split_router_swapped": ref_split_router(True),
    "pair_rows_index_put": ref_pair_rows(None),
    "trap_pair_rows_expert_missing": ref_pair_rows(3),
    "int8_channel_fc3": ref_int8(False),
    "trap_int8_up_other_slot": ref_int8(True),
    "qwen3_flat_int4": ref_qwen3_flat(False),
    "trap_qwen3_weights_slot_major": ref_qwen3_flat(True),
    "gmm_swish_fc3": ref_gmm(False),
    "trap_gmm_down_other_slot": ref_gmm(True),
}
