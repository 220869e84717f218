"""An attention prelude written as an ONNX model from its :class:`~.qkv_spec.QkvSpec`.

The weights (seeded by the sample's name, quantised symmetric or asymmetric) and the graph in
ONNX text form; :func:`repacked_weights` gives what the fused node's inputs must hold.
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import onnx
import onnx.numpy_helper

from onnx_moe_fuse.contract.ops import MS_DOMAIN
from onnx_moe_fuse.contract.packing import (
    pack_bits,
    pack_matmul_nbits,
    symmetric_zero_point_byte,
)
from onnx_moe_fuse.samples.qkv_spec import (
    FLOAT,
    FLOAT16,
    IR_VERSION,
    IR_VERSION_OPSET23,
    QkvSpec,
)
from onnx_moe_fuse.samples.text_form import GraphText

# -- weights ------------------------------------------------------------------------------------


def _seed(key: str) -> int:
    return zlib.crc32(f"qkv/{key}".encode())


def _draw_weight(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    return rng.standard_normal((n, k)) / np.sqrt(k)


def _symmetric_codes(
    w: np.ndarray, bits: int, block: int, scale_dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Unsigned codes ``[N, K]`` (zero point ``2**(bits-1)``) and scales ``[N, k_blocks]``."""
    n, k = w.shape
    kb = -(-k // block)
    padded = np.zeros((n, kb * block))
    padded[:, :k] = w
    blocks = padded.reshape(n, kb, block)
    qmax = (1 << (bits - 1)) - 1
    scales = (np.abs(blocks).max(axis=2) / qmax).astype(scale_dtype)
    scales = np.where(scales == 0, np.ones_like(scales), scales)
    ratio = blocks / scales.astype(np.float64)[..., None]
    codes = np.clip(np.rint(ratio), -qmax - 1, qmax) + (1 << (bits - 1))
    return codes.reshape(n, kb * block)[:, :k].astype(np.uint8), scales


def _asymmetric_codes(
    w: np.ndarray, block: int, scale_dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """4-bit min/max codes ``[N, K]``, scales and zero points ``[N, k_blocks]`` (not all 8)."""
    n, k = w.shape
    kb = -(-k // block)
    padded = np.zeros((n, kb * block))
    padded[:, :k] = w
    blocks = padded.reshape(n, kb, block)
    lo = np.minimum(blocks.min(axis=2), 0.0)
    hi = np.maximum(blocks.max(axis=2), 0.0)
    scales = ((hi - lo) / 15.0).astype(scale_dtype)
    scales = np.where(scales == 0, np.ones_like(scales), scales)
    zp = np.clip(np.rint(-lo / scales.astype(np.float64)), 0, 15).astype(np.uint8)
    if np.all(zp == 8):  # pragma: no cover - random weights never do this
        zp[0, 0] = 5
    ratio = blocks / scales.astype(np.float64)[..., None] + zp[..., None]
    codes = np.clip(np.rint(ratio), 0, 15).astype(np.uint8)
    return codes.reshape(n, kb * block)[:, :k], scales, zp


# -- the graph ----------------------------------------------------------------------------------


class _Prelude:
    """Writes one prelude into a :class:`GraphText`."""

    def __init__(self, spec: QkvSpec) -> None:
        self.spec = spec
        self.g = GraphText(spec.name)
        self.rng = np.random.default_rng(_seed(spec.name))
        self.dt = "float16" if spec.dtype == "float16" else "float"

    def type_text(self, last: int) -> str:
        dims = "T" if self.spec.rank == 2 else "B,S"
        return f"{self.dt}[{dims},{last}]"

    def const(self, name: str, value: float, dtype: np.dtype) -> str:
        return self.g.add_initializer(name, np.array(value, dtype=dtype))

    # -- norms --------------------------------------------------------------------------------
    def norm(self, x: str, skip: str | None, scale: str) -> tuple[str, str | None]:
        """Return ``(normed, residual)``."""
        spec, g = self.spec, self.g
        eps = spec.epsilon
        residual = None
        if spec.norm in ("add_sln", "add_decomposed"):
            assert skip is not None
            residual = g.node("Add", [x, skip], "residual")
            x = residual
        if spec.norm in ("decomposed", "add_decomposed"):
            dt = spec.np_dtype
            sq = g.node("Pow", [x, self.const("rms_two", 2.0, dt)], "rms_sq")
            if spec.opset >= 18:
                ms = g.node("ReduceMean", [sq, g.i64(-1)], "rms_mean_sq", keepdims=1)
            else:  # opset 17: axes is an attribute (the text writer takes scalars only)
                ms = g.fresh("rms_mean_sq")
                g.lines.append(f"{ms} = ReduceMean<axes = [-1], keepdims = 1>({sq})")
            mse = g.node("Add", [ms, self.const("rms_eps", float(eps), dt)], "rms_mean_sq_eps")
            rms = g.node("Sqrt", [mse], "rms")
            normalized = g.node("Div", [x, rms], "rms_normalized")
            return g.node("Mul", [normalized, scale], "normed"), residual
        if spec.norm == "decomposed_recip":
            dt = spec.np_dtype
            sq = g.node("Mul", [x, x], "rms_sq")
            ms = g.node("ReduceMean", [sq, g.i64(-1)], "rms_mean_sq", keepdims=1)
            mse = g.node("Add", [self.const("rms_eps", float(eps), dt), ms], "rms_mean_sq_eps")
            inv = g.node("Reciprocal", [g.node("Sqrt", [mse], "rms")], "rms_inv")
            normalized = g.node("Mul", [x, inv], "rms_normalized")
            return g.node("Mul", [scale, normalized], "normed"), residual
        if spec.norm == "decomposed_cast":
            xf = g.node("Cast", [x], "rms_x_f32", to=FLOAT)
            sq = g.node("Pow", [xf, self.const("rms_two", 2.0, np.float32)], "rms_sq")
            ms = g.node("ReduceMean", [sq, g.i64(-1)], "rms_mean_sq", keepdims=1)
            mse = g.node(
                "Add", [ms, self.const("rms_eps", float(eps), np.float32)], "rms_mean_sq_eps"
            )
            inv = g.node("Reciprocal", [g.node("Sqrt", [mse], "rms")], "rms_inv")
            normalized = g.node("Mul", [xf, inv], "rms_normalized")
            back = g.node(
                "Cast",
                [normalized],
                "rms_normalized_cast",
                to=FLOAT16 if spec.dtype == "float16" else FLOAT,
            )
            return g.node("Mul", [scale, back], "normed"), residual
        attrs: dict[str, float | int] = {} if eps is None else {"epsilon": float(eps)}
        if spec.norm == "rms23":
            return g.node("RMSNormalization", [x, scale], "normed", axis=-1, **attrs), residual
        if spec.norm in ("sln", "add_sln"):
            y = g.node(
                "SimplifiedLayerNormalization", [x, scale], "normed", axis=-1, stash_type=1, **attrs
            )
            return y, residual
        if spec.norm == "skip_sln":
            assert skip is not None
            y, _mean, _inv, res = g.node_multi(
                "SkipSimplifiedLayerNormalization",
                [x, skip, scale],
                ["normed", "ssln_mean", "ssln_inv_std_var", "residual"],
                domain=MS_DOMAIN,
                **attrs,
            )
            return y, res
        raise ValueError(f"unknown norm {spec.norm!r}")

    # -- projections --------------------------------------------------------------------------
    def projection(self, normed: str, role: str, index: int) -> str:
        spec, g = self.spec, self.g
        n, k, bs = spec.width[role], spec.hidden, spec.block_size
        base = spec.weight_names[index]
        w = _draw_weight(self.rng, n, k)
        out = spec.out_names[index]
        dt = spec.np_dtype
        if spec.projection.startswith("nbits"):
            bits = 8 if spec.projection == "nbits_bits8" else 4
            inputs = [normed]
            if spec.projection == "nbits_asym":
                codes, scales, zp = _asymmetric_codes(w, bs, dt)
                zp_packed = pack_bits(
                    np.pad(zp, ((0, 0), (0, zp.shape[1] % 2)), constant_values=8), 4
                )
            else:
                codes, scales = _symmetric_codes(w, bits, bs, dt)
                zp_packed = None
                if spec.projection == "nbits_zp8":
                    zp_packed = np.full(
                        (n, -(-spec.k_blocks // 2)), symmetric_zero_point_byte(4), dtype=np.uint8
                    )
            b = g.add_initializer(f"{base}_B", pack_matmul_nbits(codes, bits, bs))
            s = g.add_initializer(f"{base}_scales", scales)
            inputs += [b, s]
            if zp_packed is not None:
                inputs.append(g.add_initializer(f"{base}_zero_points", zp_packed))
            return g.node(
                "MatMulNBits",
                inputs,
                out,
                domain=MS_DOMAIN,
                K=k,
                N=n,
                bits=bits,
                block_size=bs,
                accuracy_level=0,
            )
        codes, scales = _symmetric_codes(w, 4, bs, dt)  # unsigned, zero point 8
        codes_kn = codes.T  # [K, N]
        if spec.projection == "dq_int4":
            q = (codes_kn.astype(np.int16) - 8).astype(np.int8).astype(ml_dtypes.int4)
            inputs = [g.add_initializer(f"{base}_weight_quant", q)]
            inputs.append(g.add_initializer(f"{base}_weight_scale", np.ascontiguousarray(scales.T)))
        elif spec.projection == "dq_uint4_zp8":
            inputs = [g.add_initializer(f"{base}_weight_quant", codes_kn.astype(ml_dtypes.uint4))]
            inputs.append(g.add_initializer(f"{base}_weight_scale", np.ascontiguousarray(scales.T)))
            zp = np.full(scales.T.shape, 8, dtype=ml_dtypes.uint4)
            inputs.append(g.add_initializer(f"{base}_weight_zero_point", zp))
        else:
            raise ValueError(f"unknown projection {spec.projection!r}")
        weight = g.node("DequantizeLinear", inputs, f"{base}_weight", axis=0, block_size=bs)
        return g.node("MatMul", [normed, weight], out)

    def build(self) -> onnx.ModelProto:
        spec, g = self.spec, self.g
        x = g.add_input(self.type_text(spec.hidden), "x")
        skip = g.add_input(self.type_text(spec.hidden), "skip") if spec.has_skip else None
        gamma = (1.0 + 0.1 * self.rng.standard_normal(spec.hidden)).astype(spec.np_dtype)
        scale = g.add_initializer("norm_scale", gamma)
        normed, residual = self.norm(x, skip, scale)
        for i, role in enumerate(spec.roles):
            out = self.projection(normed, role, i)
            g.add_output(self.type_text(spec.width[role]), out)
        if residual is not None and spec.residual_output:
            g.add_output(self.type_text(spec.hidden), residual)
        if spec.extra_normed_consumer:
            total = g.node("ReduceSum", [normed, g.i64(-1)], "normed_sum", keepdims=1)
            g.add_output(self.type_text(1), total)
        ir_version = IR_VERSION_OPSET23 if spec.opset >= 23 else IR_VERSION
        model = g.to_model(spec.opset, ir_version, {MS_DOMAIN: 1})
        if spec.norm == "skip_sln":
            # ONNX Runtime's own fusion leaves the unused mean / inv_std_var outputs empty.
            for node in model.graph.node:
                if node.op_type == "SkipSimplifiedLayerNormalization":
                    node.output[1] = ""
                    node.output[2] = ""
        return model


def build_qkv(spec: QkvSpec) -> onnx.ModelProto:
    """Build the prelude ``spec`` describes (a fresh ModelProto)."""
    return _Prelude(spec).build()


def expected_epsilon(spec: QkvSpec) -> float:
    """The epsilon the fused node must carry: the written one, or the op's default."""
    if spec.epsilon is not None:
        return float(np.float32(spec.epsilon))
    defaults = {"rms23": 1e-5, "sln": 1e-5, "add_sln": 1e-5, "skip_sln": 1e-12}
    return float(np.float32(defaults[spec.norm]))


def repacked_weights(
    model: onnx.ModelProto, spec: QkvSpec, index: int
) -> tuple[np.ndarray, np.ndarray]:
    """The MatMulNBits ``(B, scales)`` that projection ``index`` of ``model`` must become."""
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    base = spec.weight_names[index]
    if spec.projection.startswith("nbits"):
        return inits[f"{base}_B"], inits[f"{base}_scales"]
    q = inits[f"{base}_weight_quant"]
    if q.dtype == ml_dtypes.int4:
        codes = (q.astype(np.int16) + 8).astype(np.uint8)
    else:
        codes = q.astype(np.uint8)
    b = pack_matmul_nbits(codes.T, 4, spec.block_size)
    return b, np.ascontiguousarray(inits[f"{base}_weight_scale"].T)
