"""Hand-written MoE layers in the dense all-experts form (their reference: ``dense_spec``).

The dense form computes EVERY expert on every token and masks afterwards, as optimum-onnx's
Qwen3-MoE / gpt-oss exports and onnxruntime's Mobius fallback do. :func:`build_dense` writes one
such layer (ONNX text through the samples' :class:`GraphText`, weights from a seeded generator):

* routing: ``Softmax(MatMul(x, router))``, ``TopK(k)``, renormalised (``Div(v, ReduceSum(v))``)
  or the top-k probabilities as they are; or (``topk_softmax_axis``) ``TopK`` of the logits
  and a ``Softmax`` of the k values;
* ``form="unrolled"``: E separate expert MLPs ``[H, N]``; per expert a mask
  ``ReduceSum(Mul(Cast(Equal(idx, e)), w), -1)``; combine ``Add`` chain of ``Mul(y_e, mask_e)``;
* ``form="onehot"``: one batched MLP over stacked weights ``[E, H, N]`` (tokens broadcast to
  ``[E, T, H]`` by MatMul, or by ``Expand`` in the ``variant`` spelling); dense weights
  ``ReduceSum(Mul(OneHot(idx, E), Unsqueeze(w)), 1)``;
  combine ``ReduceSum(Mul(Y, Unsqueeze(Transpose(dense))), 0)``;
* ``form="scatter"``: stacked MLP; dense weights ``ScatterElements(zeros [T, E], idx, w, 1)``;
  combine ``Squeeze(MatMul(Unsqueeze(dense, 1), Transpose(Y, [1, 0, 2])), 1)``;
* ``form="equal"``: stacked MLP; the one-hot as ``Cast(Equal(Unsqueeze(idx, -1), arange(E)))``
  (the ``variant`` spelling: the range ``[1, 1, E]`` first), then as ``onehot``.

``einsum_combine`` (onehot, equal) combines by ``Einsum("te,eth->th", dense, Y)`` instead.

Experts are SwiGLU (separate gate and up), Relu or tanh Gelu, weights float or int4 blocked
along K behind ``DequantizeLinear``, or (unrolled) ``com.microsoft.MatMulNBits`` experts as
Mobius writes them, with or without biases. The near-miss knobs build what the
canonicalisation must refuse: the mask from another TopK's indices, one expert with another
activation, one expert missing; and the generator's mutations that only the router or the
weights break: a TopK over the token axis, a router over a second input or over the tokens
reversed, stacked FC1 weights that are a graph input.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
from dense_spec import (
    BLOCK,
    OSS_ALPHA,
    OSS_LIMIT,
    DenseSpec,
    draw_weights,
    odd_activation,
    reference,
)

from onnx_moe_fuse.samples.text_form import GraphText
from onnx_moe_fuse.verify.oracles.quant import pack_matmul_nbits

__all__ = ["DenseSpec", "build_dense", "draw_weights", "reference", "with_int8_experts"]

OPSET = 21  # blocked DequantizeLinear
INT64_MAX = 9223372036854775807
MS = "com.microsoft"


class _Builder:
    def __init__(self, spec: DenseSpec) -> None:
        self.spec = spec
        self.g = GraphText("dense_moe")
        self.p = draw_weights(spec)

    def weight(self, name: str, expert: int | None) -> str:
        """Expert weights: ``[K, N]`` of one expert, or stacked ``[E, K, N]`` (maybe via DQ)."""
        g, p = self.g, self.p
        sel = (lambda a: a) if expert is None else (lambda a: a[expert])
        tag = name if expert is None else f"{name}_{expert}"
        if self.spec.weights_input and expert is None and name in ("gate", "fc1"):
            e, k, n = p[name].shape
            return g.add_input(f"float[{e},{k},{n}]", f"{tag}_weight")
        if not self.spec.int4:
            return g.add_initializer(f"{tag}_weight", sel(p[name]))
        q = g.add_initializer(f"{tag}_q", sel(p[f"{name}_q"]))
        s = g.add_initializer(f"{tag}_scale", sel(p[f"{name}_s"]))
        axis = 0 if expert is not None else 1
        return g.node("DequantizeLinear", [q, s], f"{tag}_weight", axis=axis, block_size=BLOCK)

    def bias(self, name: str, expert: int | None) -> str | None:
        if not self.spec.bias:
            return None
        b = self.p[f"{name}_bias"]
        if expert is None:
            return self.g.add_initializer(f"{name}_bias", b[:, None, :])  # [E, 1, N]
        return self.g.add_initializer(f"{name}_{expert}_bias", b[expert])

    def nbits(self, x: str, name: str, expert: int) -> str:
        """``MatMulNBits(x, B, scales)``: 4-bit, block 16, the default zero point 8."""
        g, p = self.g, self.p
        codes = p[f"{name}_q"][expert].astype(np.int64).T + 8  # [N, K] unsigned
        k, n = codes.shape[1], codes.shape[0]
        packed = pack_matmul_nbits(codes, 4, BLOCK)
        b = g.add_initializer(f"{name}_{expert}_B", packed)
        s = g.add_initializer(f"{name}_{expert}_scales", p[f"{name}_s"][expert].T.copy())
        return g.node(
            "MatMulNBits",
            [x, b, s],
            f"{name}_{expert}_mm",
            domain=MS,
            K=k,
            N=n,
            bits=4,
            block_size=BLOCK,
        )

    def proj(self, x: str, name: str, expert: int | None) -> str:
        g = self.g
        tag = name if expert is None else f"{name}_{expert}"
        if self.spec.nbits and expert is not None:
            out = self.nbits(x, name, expert)
        else:
            out = g.node("MatMul", [x, self.weight(name, expert)], f"{tag}_mm")
        b = self.bias(name, expert)
        return g.node("Add", [out, b], f"{tag}_out") if b else out

    def act(self, kind: str, gate: str, up: str | None, tag: str) -> str:
        g = self.g
        if kind in ("swiglu", "swiglu_tanh"):
            squash = "Sigmoid" if kind == "swiglu" else "Tanh"
            sig = g.node(squash, [gate], f"{tag}_sig")
            silu = g.node("Mul", [gate, sig], f"{tag}_silu")
            return g.node("Mul", [silu, up], f"{tag}_act")
        if kind.startswith("swiglu_oss"):
            return self.oss_act(kind, gate, tag)
        if kind == "relu":
            return g.node("Relu", [gate], f"{tag}_act")
        return g.node("Gelu", [gate], f"{tag}_act", approximate="tanh")

    def oss_act(self, kind: str, h: str, tag: str) -> str:
        """gpt-oss SwiGLU: even columns gate, odd columns linear (Slice step 2 on the last axis)."""
        g = self.g
        last = g.i64(-1 if self.spec.form == "unrolled" else 2)  # [T, 2I] or [E, T, 2I]
        end, step = g.i64(INT64_MAX), g.i64(2)
        gate = g.node("Slice", [h, g.i64(0), end, last, step], f"{tag}_gate")
        lin = g.node("Slice", [h, g.i64(1), end, last, step], f"{tag}_linear")
        limit = g.f32(OSS_LIMIT)
        gate_c = g.node("Clip", [gate, "", limit], f"{tag}_gate_clamped")
        lin_c = g.node("Clip", [lin, g.f32(-OSS_LIMIT), limit], f"{tag}_linear_clamped")
        alpha = OSS_ALPHA if kind == "swiglu_oss" else 1.0
        scaled = g.node("Mul", [gate_c, g.f32(alpha)], f"{tag}_gate_scaled")
        sig = g.node("Sigmoid", [scaled], f"{tag}_sig")
        glu = g.node("Mul", [gate_c, sig], f"{tag}_glu")
        lin1 = g.node("Add", [lin_c, g.f32(1.0)], f"{tag}_linear_plus_one")
        return g.node("Mul", [lin1, glu], f"{tag}_act")

    def mlp(self, x: str, expert: int | None) -> str:
        spec = self.spec
        tag = "experts" if expert is None else f"expert_{expert}"
        kind = spec.activation
        if expert is not None and expert == spec.odd_expert_activation:
            kind = odd_activation(kind)
        if spec.activation == "swiglu":
            gate, up = self.proj(x, "gate", expert), self.proj(x, "up", expert)
        else:
            gate, up = self.proj(x, "fc1", expert), None
        return self.proj(self.act(kind, gate, up, tag), "down", expert)

    def routing(self, x: str) -> tuple[str, str, str]:
        """(router logits, the mask's indices, the top-k weights)."""
        g, spec = self.g, self.spec
        k = g.i64(spec.top_k)

        rows = x
        if spec.router_input == "second_input":
            rows = g.add_input(f"float[T,{spec.hidden}]", "router_input")
        elif spec.router_input == "reversed_tokens":
            ends = (g.i64(-1), g.i64(-INT64_MAX - 1), g.i64(0), g.i64(-1))
            rows = g.node("Slice", [x, *ends], "router_rows")

        def topk(router: str, tag: str) -> tuple[str, str, str]:
            logits = g.node(
                "MatMul", [rows, g.add_initializer(router, self.p[router])], f"{tag}_logits"
            )
            probs = g.node("Softmax", [logits], f"{tag}_probs", axis=-1)
            v, i = g.node_multi(
                "TopK",
                [probs, k],
                [f"{tag}_topk_values", f"{tag}_topk_idx"],
                axis=spec.topk_axis,
                largest=1,
                sorted=1,
            )
            return logits, v, i

        if spec.topk_softmax_axis is not None:  # TopK of the logits, Softmax of the k values
            logits = g.node("MatMul", [rows, g.add_initializer("router", self.p["router"])])
            vals, idx = g.node_multi(
                "TopK", [logits, k], ["router_topk_logits", "router_topk_idx"], axis=-1
            )
            w = g.node("Softmax", [vals], "routing_weights", axis=spec.topk_softmax_axis)
            return logits, idx, w
        logits, vals, idx = topk("router", "router")
        w = vals
        if spec.renorm:
            total = g.node("ReduceSum", [vals, g.i64(-1)], "topk_sum", keepdims=1)
            w = g.node("Div", [vals, total], "routing_weights")
        if spec.mask_from_other_topk:
            _, _, idx = topk("router2", "router2")
        return logits, idx, w

    def expert_term(self, x: str, idx: str, w: str, e: int) -> str | None:
        """Expert e's weighted output: ``Mul(y_e, ReduceSum(Mul(Cast(Equal(idx, e)), w), -1))``.

        The variant spelling swaps every operand pair and sums with ``keepdims=0`` + Unsqueeze.
        """
        g, variant = self.g, self.spec.variant
        if e == self.spec.missing_expert:
            return None
        pair = (lambda a, b: [b, a]) if variant else (lambda a, b: [a, b])
        hit = g.node("Equal", pair(idx, g.i64(e)), f"mask_{e}_hit")
        hit_f = g.node("Cast", [hit], f"mask_{e}_float", to=onnx.TensorProto.FLOAT)
        weighted = g.node("Mul", pair(hit_f, w), f"mask_{e}_weighted")
        col = g.node("ReduceSum", [weighted, g.i64(-1)], f"mask_{e}", keepdims=int(not variant))
        if variant:
            col = g.node("Unsqueeze", [col, g.i64(-1)], f"mask_{e}_column")
        return g.node("Mul", pair(self.mlp(x, e), col), f"expert_{e}_weighted")

    def add_terms(self, terms: list[str]) -> None:
        """``y`` = a left-to-right Add chain, or a balanced Add tree in the variant spelling."""
        g, count = self.g, 0
        while len(terms) > 1:
            if self.spec.variant:
                groups = [terms[i : i + 2] for i in range(0, len(terms), 2)]
            else:
                groups = [terms[:2], *([t] for t in terms[2:])]
            last = len(groups) == 1
            merged = []
            for group in groups:
                if len(group) == 1:
                    merged.append(group[0])
                    continue
                count += 1
                merged.append(g.node("Add", group, "y" if last else f"combine_{count}"))
            terms = merged
        if terms[0] != "y":
            g.node("Identity", [terms[0]], "y")

    def onehot(self, idx: str) -> str:
        """``OneHot(idx, E, [0, 1])``: ``[T, k, E]``."""
        g = self.g
        values = g.add_initializer("onehot_values", np.array([0.0, 1.0], np.float32))
        return g.node("OneHot", [idx, g.i64(self.spec.experts), values], "route_onehot", axis=-1)

    def equal_onehot(self, idx: str) -> str:
        """``Cast(Equal(Unsqueeze(idx, -1), arange(E)))``: ``[T, k, E]``, every expert at once."""
        g, e = self.g, self.spec.experts
        ids = g.node("Unsqueeze", [idx, g.i64(-1)], "route_ids_3d")
        shape = (1, 1, e) if self.spec.variant else (e,)
        experts = g.add_initializer("expert_range", np.arange(e, dtype=np.int64).reshape(shape))
        hit = g.node("Equal", [experts, ids] if self.spec.variant else [ids, experts], "route_hit")
        return g.node("Cast", [hit], "route_onehot", to=onnx.TensorProto.FLOAT)

    def combine_stacked(self, dense: str, y: str) -> None:
        """``y = sum_e dense[:, e] * Y[e]``: ReduceSum over E, or one Einsum."""
        g = self.g
        if self.spec.einsum_combine:
            g.node("Einsum", [dense, y], "y", equation="te,eth->th")
            return
        dense_t = _transpose(g, dense, (1, 0), "dense_weights_t")
        dense3 = g.node("Unsqueeze", [dense_t, g.i64(-1)], "dense_weights_3d")
        weighted = g.node("Mul", [y, dense3], "experts_weighted")
        g.node("ReduceSum", [weighted, g.i64(0)], "y", keepdims=0)

    def build(self) -> onnx.ModelProto:
        g, spec = self.g, self.spec
        e_count, h = spec.experts, spec.hidden
        x = g.add_input(f"float[T,{h}]", "x")
        logits, idx, w = self.routing(x)
        if spec.form == "unrolled":
            terms = [self.expert_term(x, idx, w, e) for e in range(e_count)]
            terms = [t for t in terms if t]
            self.add_terms(terms)
        else:
            tokens = x
            if spec.variant:  # tokens broadcast to [E, T, H] explicitly
                tokens = g.node("Unsqueeze", [x, g.i64(0)], "tokens_3d")
                tokens = g.node("Expand", [tokens, g.i64(e_count, 1, 1)], "tokens_by_expert")
            y = self.mlp(tokens, None)  # [E, T, H]
            if spec.form in ("onehot", "equal"):
                onehot = self.onehot(idx) if spec.form == "onehot" else self.equal_onehot(idx)
                w3 = g.node("Unsqueeze", [w, g.i64(-1)], "routing_weights_3d")
                mix = g.node("Mul", [onehot, w3], "route_onehot_weighted")
                dense = g.node("ReduceSum", [mix, g.i64(1)], "dense_weights", keepdims=0)
                self.combine_stacked(dense, y)
            else:
                zeros = g.node(
                    "ConstantOfShape", [g.node("Shape", [logits], "logits_shape")], "dense_zeros"
                )
                dense = g.node("ScatterElements", [zeros, idx, w], "dense_weights", axis=1)
                row = g.node("Unsqueeze", [dense, g.i64(1)], "dense_weights_row")
                y_t = _transpose(g, y, (1, 0, 2), "experts_by_token")
                mixed = g.node("MatMul", [row, y_t], "experts_mixed")
                g.node("Squeeze", [mixed, g.i64(1)], "y")
        g.add_output(f"float[T,{h}]", "y")
        return g.to_model(OPSET, 10, {MS: 1} if spec.nbits else None)


def _transpose(g: GraphText, x: str, perm: tuple[int, ...], out: str) -> str:
    """``Transpose<perm>`` (GraphText writes scalar attributes only)."""
    name = g.fresh(out)
    g.lines.append(f"{name} = Transpose<perm=[{', '.join(map(str, perm))}]>({x})")
    return name


def build_dense(spec: DenseSpec) -> onnx.ModelProto:
    """The ONNX model of the dense layer ``spec``: input ``x [T, H]``, output ``y [T, H]``."""
    return _Builder(spec).build()


def with_int8_experts(model: onnx.ModelProto, granularity: str) -> onnx.ModelProto:
    """The unrolled experts' float ``[K, N]`` weights put behind an int8 ``DequantizeLinear``.

    ``granularity``: ``"tensor"`` (one scale), ``"out"`` (per output channel, ``axis=1``,
    scales ``[N]``) or ``"in"`` (per input channel, ``axis=0``, scales ``[K]``); zero point 0.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    experts = [
        t for t in graph.initializer if re.fullmatch(r"(gate|up|fc1|down)_\d+_weight", t.name)
    ]
    for tensor in experts:
        w = onnx.numpy_helper.to_array(tensor)
        reduce_axis = {"tensor": None, "out": 0, "in": 1}[granularity]
        amax = np.abs(w).max(axis=reduce_axis)
        scale = (amax / 127.0).astype(np.float32)
        bcast = scale if reduce_axis != 1 else scale[:, None]
        q = np.clip(np.rint(w / bcast), -127, 127).astype(np.int8)
        name = tensor.name
        graph.initializer.remove(tensor)
        graph.initializer.extend(
            [
                onnx.numpy_helper.from_array(q, f"{name}_q"),
                onnx.numpy_helper.from_array(scale, f"{name}_scale"),
                onnx.numpy_helper.from_array(np.zeros_like(scale, dtype=np.int8), f"{name}_zp"),
            ]
        )
        attrs = {} if granularity == "tensor" else {"axis": 1 if granularity == "out" else 0}
        dq = onnx.helper.make_node(
            "DequantizeLinear", [f"{name}_q", f"{name}_scale", f"{name}_zp"], [name], **attrs
        )
        graph.node.insert(0, dq)
    return out
