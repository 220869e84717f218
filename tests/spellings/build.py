"""ONNX builders of one MoE layer from a :class:`~tests.spellings.case.LayerCase`.

Each part (router, routing, experts, activation, combine, weights) has one builder per
spelling, written the way an exporter or an engineer would, and the parts compose freely
(the routing's in ``build_routing.py``, the experts' and combine's in ``build_experts.py``). The
builder draws the layer's float parameters from ``case.seed``, quantizes them when the case
asks, and returns the model together with the parameters the numpy reference needs
(:class:`Built`): the weights as the graph dequantizes them, in the logical ``[E, K, N]`` layout.
A mutation changes exactly one place of the graph (see ``strategies.MUTATIONS``).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
import onnx.numpy_helper as nh
from onnx import TensorProto, helper

from .axes import SWIGLU
from .case import LayerCase

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
IR_VERSION = 10  # int4/uint4 need IR 10; ORT 1.32 loads it

_CODE_TYPES = {
    "int4": (ml_dtypes.int4, -7, 7, 0),
    "uint4": (ml_dtypes.uint4, -7, 7, 8),
    "int8": (np.int8, -127, 127, 0),
    "uint8": (np.uint8, -127, 127, 128),
}


@dataclass
class Built:
    """A built layer: the model (token input ``x``, output ``y``) and its float parameters.

    The parameters are the weights as the graph dequantizes them, logical ``[E, K, N]`` layout.
    """

    model: onnx.ModelProto
    params: dict[str, np.ndarray]


class _Graph:
    """Collects nodes, initializers and inputs; every new value gets a fresh name."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.used: set[str] = set()

    def fresh(self, hint: str) -> str:
        name, n = hint, 1
        while name in self.used:
            n += 1
            name = f"{hint}_{n}"
        self.used.add(name)
        return name

    def node(self, op: str, inputs: list[str], hint: str, outputs: int = 1, **attrs) -> str:
        names = [self.fresh(hint if outputs == 1 else f"{hint}_{i}") for i in range(outputs)]
        self.nodes.append(
            helper.make_node(op, inputs, names, name=self.fresh(f"{hint}_node"), **attrs)
        )
        return names[0] if outputs == 1 else names  # type: ignore[return-value]

    def init(self, hint: str, array: np.ndarray) -> str:
        name = self.fresh(hint)
        self.inits.append(nh.from_array(array, name))
        return name

    def i64(self, *values: int) -> str:
        return self.init("const_i64", np.array(values, dtype=np.int64))

    def f32(self, value: float) -> str:
        return self.init("const_f32", np.array(value, dtype=np.float32))

    def graph_input(self, name: str, elem: int, shape: list) -> str:
        self.used.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name


class _Layer:
    """Writes one case into a :class:`_Graph`."""

    def __init__(self, case: LayerCase) -> None:
        self.case = case
        self.g = _Graph()
        self.rng = np.random.default_rng(case.seed)
        self.params: dict[str, np.ndarray] = {}
        self.weight_inputs = 0  # FC1 weights made graph inputs (mutation weight_graph_input)

    @property
    def mutation(self) -> str | None:
        return self.case.mutation

    def normal(self, shape: tuple[int, ...], scale: float) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    # -- weights ---------------------------------------------------------------------------
    def expert_weight(self, key: str, logical: np.ndarray, output_major: bool, fc1: bool) -> str:
        """The value holding expert weights ``[E, K, N]`` (``[E, N, K]`` when output-major)."""
        c, g = self.case, self.g
        stored_axis = 2 if output_major else 1  # the reduction axis K as stored
        as_input = self.mutation == "weight_graph_input" and fc1 and self.weight_inputs == 0
        if not c.quantized:
            self.params[key] = logical
            stored = logical.transpose(0, 2, 1).copy() if output_major else logical
            if as_input:
                self.weight_inputs += 1
                return g.graph_input(key, TensorProto.FLOAT, list(stored.shape))
            return g.init(key, stored)
        code_type, lo, hi, zp = _CODE_TYPES[c.weight_dtype]
        e, k, n = logical.shape
        block = 32 if c.granularity == "block32" else k
        blocks = logical.reshape(e, k // block, block, n)
        scale = (np.abs(blocks).max(axis=2) / hi).astype(np.float32)  # [E, K/block, N]
        scale = np.maximum(scale, np.float32(1e-3))
        q = np.clip(np.rint(blocks / scale[:, :, None, :]), lo, hi).astype(np.int32)
        deq = (q.astype(np.float32) * scale[:, :, None, :]).reshape(e, k, n)
        self.params[key] = deq
        zp_arr = np.full(scale.shape, zp, np.int32)  # [E, K/block, N]
        if c.zero_point == "asymmetric":  # one below the symmetric point in some blocks
            zp_arr -= (self.rng.random(scale.shape) < 0.5).astype(np.int32)
            zp_arr.reshape(-1)[0] = zp - 1  # asymmetric for sure
        # the same weights: codes shifted with their zero point ((q + z) - z = q)
        codes = (q + zp_arr[:, :, None, :]).reshape(e, k, n)
        if output_major:
            codes, scale = codes.transpose(0, 2, 1), scale.transpose(0, 2, 1)
        codes = codes.astype(code_type)
        if as_input:
            self.weight_inputs += 1
            elem = helper.np_dtype_to_tensor_dtype(np.dtype(code_type))
            q_name = g.graph_input(f"{key}_codes", elem, list(codes.shape))
        else:
            q_name = g.init(f"{key}_codes", codes)
        inputs = [q_name, g.init(f"{key}_scale", np.ascontiguousarray(scale))]
        if c.zero_point != "absent":
            if output_major:
                zp_arr = zp_arr.transpose(0, 2, 1)
            inputs.append(
                g.init(f"{key}_zero_point", np.ascontiguousarray(zp_arr).astype(code_type))
            )
        deq_name = g.node("DequantizeLinear", inputs, key, axis=stored_axis, block_size=block)
        return deq_name

    def weights_kn(self, key: str, logical: np.ndarray, fc1: bool) -> str:
        """Expert weights as a ``[E, K, N]`` value, spelled as the experts axis says."""
        if self.case.experts != "transpose_weights":
            return self.expert_weight(key, logical, False, fc1)
        stored = self.expert_weight(key, logical, True, fc1)
        return self.g.node("Transpose", [stored], f"{key}_kn", perm=[0, 2, 1])

    # -- router and routing ----------------------------------------------------------------
    def router(self, tokens: str, rank: int) -> str:
        c, g = self.case, self.g
        h, e = c.hidden, c.experts_count
        w = self.normal((h, e), 1.0 / np.sqrt(h))
        self.params["router_weight"] = w
        src = tokens
        if self.mutation == "router_second_input":
            dims = ["T"] if rank == 2 else ["B", "S"]
            if c.shapes == "static":
                dims = list(self._dims(rank))
            src = g.graph_input("router_input", TensorProto.FLOAT, [*dims, h])
        elif self.mutation == "router_token_slice":
            axis = rank - 2
            src = g.node(
                "Slice",
                [tokens, g.i64(-1), g.i64(INT64_MIN), g.i64(axis), g.i64(-1)],
                "router_rows",
            )
        if c.router == "gemm_transb":
            logits = g.node(
                "Gemm", [src, g.init("router_weight_t", w.T.copy())], "router_logits", transB=1
            )
        elif c.router == "einsum":
            eq = "th,he->te" if rank == 2 else "bsh,he->bse"
            logits = g.node(
                "Einsum", [src, g.init("router_weight", w)], "router_logits", equation=eq
            )
        else:
            logits = g.node("MatMul", [src, g.init("router_weight", w)], "router_logits")
        if c.router == "matmul_bias":
            b = self.normal((e,), 0.5)
            self.params["router_bias"] = b
            logits = g.node("Add", [logits, g.init("router_bias", b)], "router_logits_biased")
        return logits

    # -- activation ------------------------------------------------------------------------
    def activation(self, fc1: str | tuple[str, str]) -> str:
        """Apply the activation to FC1's output (a (gate, up) pair for separate experts)."""
        c, g = self.case, self.g
        act, i = c.activation, c.inter
        if act == "swiglu_separate":
            gate, up = fc1
            return self.swiglu(gate, up)
        assert isinstance(fc1, str)
        h = fc1
        if act in ("silu_exp", "swiglu_exp", "gelu_tanh_hand"):  # written out by hand
            from . import build_meaning

            return build_meaning.activation(self, h)
        if act == "swiglu_split":
            gate, up = g.node("Split", [h, g.i64(i, i)], "fc1_half", outputs=2, axis=-1)
            return self.swiglu(gate, up)
        if act == "swiglu_slice":
            gate = g.node("Slice", [h, g.i64(0), g.i64(i), g.i64(-1)], "gate")
            up = g.node("Slice", [h, g.i64(i), g.i64(2 * i), g.i64(-1)], "up")
            return self.swiglu(gate, up)
        if act in ("swiglu_strided", "swiglu_oss"):
            gate = g.node("Slice", [h, g.i64(0), g.i64(INT64_MAX), g.i64(-1), g.i64(2)], "gate")
            up = g.node("Slice", [h, g.i64(1), g.i64(INT64_MAX), g.i64(-1), g.i64(2)], "up")
            return self.swiglu_oss(gate, up) if act == "swiglu_oss" else self.swiglu(gate, up)
        if act == "swish":
            return g.node("Swish", [h], "act", alpha=1.0)
        if act == "silu_x_sigmoid":
            return g.node("Mul", [h, g.node("Sigmoid", [h], "act_sigmoid")], "act")
        if act == "silu_sigmoid_x":
            return g.node("Mul", [g.node("Sigmoid", [h], "act_sigmoid"), h], "act")
        if act == "relu":
            return g.node("Relu", [h], "act")
        assert act == "gelu_tanh", act
        if self.mutation == "erf_gelu":
            scaled = g.node("Div", [h, g.f32(1.4142135623730951)], "gelu_scaled")
            one_plus = g.node("Add", [g.node("Erf", [scaled], "gelu_erf"), g.f32(1.0)], "gelu_1p")
            return g.node("Mul", [g.node("Mul", [h, g.f32(0.5)], "gelu_half"), one_plus], "act")
        return g.node("Gelu", [h], "act", approximate="tanh")

    def swiglu(self, gate: str, up: str) -> str:
        g = self.g
        # swap_gate_up: the SiLU's factor is the up projection, up * sigmoid(gate) * up (the
        # sigmoid reading up instead, gate * sigmoid(up) * up, is SwiGLU with the roles swapped)
        x = up if self.mutation == "swap_gate_up" else gate
        silu = g.node("Mul", [x, g.node("Sigmoid", [gate], "gate_sigmoid")], "gate_silu")
        return g.node("Mul", [silu, up], "act")

    def swiglu_oss(self, gate: str, up: str) -> str:
        g = self.g
        limit = g.f32(7.0)
        if self.mutation != "dropped_clamp":
            gate = g.node("Clip", [gate, "", limit], "gate_clamped")
        up = g.node("Clip", [up, g.f32(-7.0), limit], "up_clamped")
        sig_in = up if self.mutation == "swap_gate_up" else gate
        scaled = g.node("Mul", [sig_in, g.f32(1.702)], "gate_scaled")
        glu = g.node("Mul", [gate, g.node("Sigmoid", [scaled], "gate_sigmoid")], "glu")
        return g.node("Mul", [g.node("Add", [up, g.f32(1.0)], "up_plus_one"), glu], "act")

    # -- parameters ------------------------------------------------------------------------
    def fc1_weights(self) -> list[tuple[str, np.ndarray]]:
        """FC1's logical weights ``[E, H, N]``: (gate, up) when separate, else one tensor.

        A fused SwiGLU FC1 holds the gate and linear columns where its cut reads them.
        """
        c = self.case
        e, h, i = c.experts_count, c.hidden, c.inter
        # gpt-oss's clamp must bite on some values: a larger FC1 there
        std = (6.0 if c.activation == "swiglu_oss" else 1.0) / np.sqrt(h)
        if c.activation == "swiglu_separate":
            return [
                ("fc1_gate", self.normal((e, h, i), std)),
                ("fc1_up", self.normal((e, h, i), std)),
            ]
        if c.activation not in SWIGLU:
            return [("fc1", self.normal((e, h, i), std))]
        gate, up = self.normal((e, h, i), std), self.normal((e, h, i), std)
        if c.activation in ("swiglu_split", "swiglu_slice", "swiglu_exp"):
            w = np.concatenate([gate, up], axis=2)
        else:
            w = np.stack([gate, up], axis=3).reshape(e, h, 2 * i)
        return [("fc1", w)]

    def _dims(self, rank: int) -> tuple[int, ...]:
        c = self.case
        if rank == len(c.token_dims) + 1:
            return c.token_dims
        return (int(np.prod(c.token_dims)),)

    # -- the whole layer -------------------------------------------------------------------
    def build(self) -> Built:
        # the routing, experts and combine builders, split out for length
        from . import build_experts, build_routing

        c, g = self.case, self.g
        h = c.hidden
        dims = (
            list(c.token_dims) if c.shapes == "static" else (["T"] if c.rank == 2 else ["B", "S"])
        )
        x = g.graph_input("x", TensorProto.FLOAT, [*dims, h])
        # Layers that work on [T, H] rows: flatten rank-3 tokens first, restore at the end.
        flat = c.flat_tokens
        tokens = g.node("Reshape", [x, g.i64(-1, h)], "tokens") if flat else x
        rank = 2 if flat else c.rank
        logits = self.router(tokens, rank)
        weights, idx = build_routing.routing(self, logits, rank)
        out = build_experts.experts_and_combine(self, tokens, rank, weights, idx)
        if flat:
            out = g.node("Reshape", [out, g.node("Shape", [x], "x_shape")], "y")
        # the output is called y: rename the last node's output
        last = g.nodes[-1]
        assert last.output[0] == out
        last.output[0] = "y"
        graph = helper.make_graph(
            g.nodes,
            "moe_layer",
            g.inputs,
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*dims, h])],
            initializer=g.inits,
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", c.opset)],
            ir_version=IR_VERSION,
            producer_name="tests.spellings",
        )
        return Built(model, self.params)


def build_case(case: LayerCase) -> Built:
    """Build the ONNX model of ``case`` and the parameters of its numpy reference."""
    return _Layer(case).build()
