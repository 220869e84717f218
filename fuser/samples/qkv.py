"""Attention preludes as ONNX models: an RMS norm feeding the Q, K and V projections.

Every sample is one prelude written in ONNX text form (``onnx.parser``; weights attached as
initializers drawn from a numpy Generator seeded by the sample's name) and records what a fuser
must make of it: one ``com.microsoft.MatMulNBitsQkv`` node (with its attributes and which original
value goes to which input slot), or nothing (a near miss, with its reason keyword).

The parts:

* input ``x [T, K]`` or ``[B, S, K]`` (float32 or float16), plus ``skip`` of the same shape for
  the skip forms;
* the RMS norm, one of :data:`NORMS`: decomposed (``Pow``/``Mul``, ``ReduceMean``, ``Add``
  epsilon, ``Sqrt``, ``Div`` or ``Reciprocal`` + ``Mul``, ``Mul`` by the scale, optionally inside
  the ``Cast`` pair exporters write for float16), opset-23 ``RMSNormalization``, ONNX Runtime's
  ``SimplifiedLayerNormalization``, ``Add`` + ``SimplifiedLayerNormalization``, or
  ``com.microsoft.SkipSimplifiedLayerNormalization`` (its ``input_skip_bias_sum`` output used);
* three projections of the normalised value, one of :data:`PROJECTIONS`: ``com.microsoft.
  MatMulNBits`` (4-bit, block 32, without or with zero points) or ``DequantizeLinear`` (int4, or
  uint4 with zero point 8, blocked 32 along K) + ``MatMul``; and the near-miss variants.

Use :data:`QKV_CATALOG` and :func:`build_qkv`; :mod:`onnx_moe_fuse.samples` turns the entries into
``Sample`` records (``kind="qkv"``). ``docs/samples.md`` lists them.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Literal

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
from onnx_moe_fuse.samples.text_form import GraphText

__all__ = [
    "NORMS",
    "PROJECTIONS",
    "QKV_CATALOG",
    "QkvEntry",
    "QkvSpec",
    "build_qkv",
    "expected_epsilon",
    "repacked_weights",
]

Norm = Literal[
    "decomposed",  # Pow(x, 2), ReduceMean, Add(ms, eps), Sqrt, Div(x, rms), Mul(normalized, scale)
    "decomposed_recip",  # Mul(x, x), Add(eps, ms), Sqrt, Reciprocal, Mul(x, inv), Mul(scale, .)
    "decomposed_cast",  # Cast(x, f32), Pow, ..., Reciprocal, Mul, Cast(f16), Mul(scale, .)
    "add_decomposed",  # Add(x, skip) then "decomposed"
    "rms23",  # RMSNormalization (opset 23)
    "sln",  # SimplifiedLayerNormalization (ORT, default domain)
    "add_sln",  # Add(x, skip) then SimplifiedLayerNormalization
    "skip_sln",  # com.microsoft.SkipSimplifiedLayerNormalization, residual output
]
Projection = Literal[
    "nbits",  # MatMulNBits, no zero points
    "nbits_zp8",  # MatMulNBits, packed uint8 zero points all 8 (0x88)
    "nbits_asym",  # MatMulNBits, asymmetric packed zero points (near miss)
    "nbits_bits8",  # MatMulNBits with bits=8 (near miss)
    "dq_int4",  # DequantizeLinear(int4, no zero point) + MatMul
    "dq_uint4_zp8",  # DequantizeLinear(uint4, zero point 8) + MatMul
]
NORMS: tuple[str, ...] = Norm.__args__  # type: ignore[attr-defined]
PROJECTIONS: tuple[str, ...] = Projection.__args__  # type: ignore[attr-defined]

IR_VERSION = 10  # int4 needs IR 10
IR_VERSION_OPSET23 = 11
_FLOAT16 = onnx.TensorProto.FLOAT16
_FLOAT = onnx.TensorProto.FLOAT
_ROLES = ("q", "k", "v")


@dataclass(frozen=True)
class QkvSpec:
    """Everything that defines one prelude sample (weights come from the name's seed)."""

    name: str
    norm: Norm
    projection: Projection
    dtype: Literal["float32", "float16"] = "float32"
    rank: int = 2
    hidden: int = 96
    nq: int = 64
    nkv: int = 32
    block_size: int = 32
    epsilon: float | None = 1e-6  # None: the op's default (RMSNormalization, SLN, SSLN only)
    roles: tuple[str, ...] = _ROLES  # projections in graph order; "q", "k", "v"
    out_names: tuple[str, ...] = ("q", "k", "v")  # graph output name per projection (same order)
    weight_names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    residual_output: bool = False  # skip forms: A + skip is a graph output
    extra_normed_consumer: bool = False  # the normalised value also feeds ReduceSum -> output
    opset: int = 21

    @property
    def k_blocks(self) -> int:
        """Blocks along K."""
        return -(-self.hidden // self.block_size)

    @property
    def has_skip(self) -> bool:
        """True for the forms with a skip input."""
        return self.norm in ("add_sln", "add_decomposed", "skip_sln")

    @property
    def np_dtype(self) -> np.dtype:
        """The activation dtype."""
        return np.dtype(self.dtype)

    @property
    def width(self) -> dict[str, int]:
        """Output width per role."""
        return {"q": self.nq, "k": self.nkv, "v": self.nkv}


@dataclass(frozen=True)
class QkvEntry:
    """One catalogue entry: the prelude to build and what a fuser must make of it.

    ``expected_inputs`` maps MatMulNBitsQkv's input slots to the original value that must fill
    them (``""`` for an empty slot); a B or scales slot not listed holds a new initializer (DQ
    weights repacked into MatMulNBits layout), which the tests compare with the sample's
    weights. ``expected_outputs`` are the names the fused node's outputs must carry.
    """

    spec: QkvSpec
    family: str
    description: str
    expected: list[tuple[str, int]]
    near_miss_reason: str | None = None
    expected_attributes: dict[str, int | float | str] = field(default_factory=dict)
    expected_inputs: dict[str, str] = field(default_factory=dict)
    expected_outputs: tuple[str, ...] = ()
    kept_ops: list[tuple[str, int]] = field(default_factory=list)


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
            xf = g.node("Cast", [x], "rms_x_f32", to=_FLOAT)
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
                to=_FLOAT16 if spec.dtype == "float16" else _FLOAT,
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


# -- the catalogue ------------------------------------------------------------------------------

_NORM_TEXT: dict[str, str] = {
    "decomposed": "decomposed RMS norm: Pow(x, 2), ReduceMean(axes=[-1]), Add(mean, eps), Sqrt, "
    "Div(x, rms), Mul(normalized, scale)",
    "decomposed_recip": "decomposed RMS norm: Mul(x, x), ReduceMean(axes=[-1]), Add(eps, mean), "
    "Sqrt, Reciprocal, Mul(x, 1/rms), Mul(scale, normalized)",
    "decomposed_cast": "decomposed RMS norm as exporters write it for float16: Cast(x, float), "
    "Pow(2), ReduceMean, Add(eps), Sqrt, Reciprocal, Mul, Cast back to float16, "
    "Mul(scale, normalized)",
    "add_decomposed": "Add(x, skip) (the residual, a graph output), then the decomposed RMS norm "
    "(Pow, ReduceMean, Add eps, Sqrt, Div, Mul scale)",
    "rms23": "RMSNormalization (opset 23, axis=-1)",
    "sln": "SimplifiedLayerNormalization (ONNX Runtime's, default domain, axis=-1, stash_type=1)",
    "add_sln": "Add(x, skip), then SimplifiedLayerNormalization",
    "skip_sln": "com.microsoft.SkipSimplifiedLayerNormalization(x, skip, scale) with outputs "
    "(normed, '', '', input_skip_bias_sum)",
}
_PROJ_TEXT: dict[str, str] = {
    "nbits": "com.microsoft.MatMulNBits (bits 4, block_size 32, no zero points)",
    "nbits_zp8": "com.microsoft.MatMulNBits (bits 4, block_size 32, packed uint8 zero points "
    "all 8, i.e. 0x88 bytes)",
    "nbits_asym": "com.microsoft.MatMulNBits (bits 4, block_size 32, min/max zero points that "
    "are not 8)",
    "nbits_bits8": "com.microsoft.MatMulNBits with bits 8 (block_size 32)",
    "dq_int4": "DequantizeLinear(int4 [K, N], scale [K/32, N], axis=0, block_size=32, no zero "
    "point) + MatMul",
    "dq_uint4_zp8": "DequantizeLinear(uint4 [K, N], scale, zero point 8 everywhere, axis=0, "
    "block_size=32) + MatMul",
}


def _describe(spec: QkvSpec, extra: str) -> str:
    tokens = "[T, K]" if spec.rank == 2 else "[B, S, K]"
    order = ", ".join(
        f"{r.upper()} -> {o}" for r, o in zip(spec.roles, spec.out_names, strict=True)
    )
    parts = [
        f"Attention prelude, {spec.dtype}, x {tokens}, K={spec.hidden}, Nq={spec.nq}, "
        f"Nkv={spec.nkv}, opset {spec.opset}.",
        f"Norm: {_NORM_TEXT[spec.norm]}, epsilon "
        + ("the op's default" if spec.epsilon is None else f"{spec.epsilon:g}")
        + ".",
        f"Projections ({len(spec.roles)}, graph order {order}): {_PROJ_TEXT[spec.projection]}"
        + (f", block_size {spec.block_size}" if spec.block_size != 32 else "")
        + ".",
    ]
    if spec.residual_output:
        parts.append("The residual x + skip is a graph output.")
    if spec.extra_normed_consumer:
        parts.append(
            "The normalised value also feeds ReduceSum -> graph output normed_sum, which must "
            "keep its value (the norm stays for it)."
        )
    parts.append(extra)
    return " ".join(parts)


def _positive(spec: QkvSpec, *, kept: list[tuple[str, int]] | None = None) -> QkvEntry:
    roles = list(spec.roles)
    attrs: dict[str, int | float | str] = {
        "K": spec.hidden,
        "Nq": spec.nq,
        "Nkv": spec.nkv,
        "bits": 4,
        "block_size": 32,
        "epsilon": expected_epsilon(spec),
        "accuracy_level": 0,
    }
    skip_fused = spec.has_skip and not spec.extra_normed_consumer
    inputs = {
        "A": "x" if not spec.has_skip or skip_fused else "residual",
        "skip": "skip" if skip_fused else "",
        "norm_scale": "norm_scale",
        "q_bias": "",
        "k_bias": "",
        "v_bias": "",
    }
    if spec.projection.startswith("nbits") and spec.projection != "nbits_zp8":
        for role in _ROLES:
            base = spec.weight_names[roles.index(role)]
            inputs[f"{role}_B"] = f"{base}_B"
            inputs[f"{role}_scales"] = f"{base}_scales"
    outputs = tuple(spec.out_names[roles.index(r)] for r in _ROLES)
    if skip_fused and spec.residual_output:
        outputs += ("residual",)
    return QkvEntry(
        spec=spec,
        family="qkv",
        description=_describe(spec, "Must fuse into one com.microsoft.MatMulNBitsQkv."),
        expected=[("MatMulNBitsQkv", 1)],
        expected_attributes=attrs,
        expected_inputs=inputs,
        expected_outputs=outputs,
        kept_ops=list(kept or []),
    )


def _near_miss(spec: QkvSpec, reason: str, why: str) -> QkvEntry:
    return QkvEntry(
        spec=spec,
        family="nearmiss_" + spec.name.removeprefix("nearmiss_"),
        description=_describe(spec, f"Must NOT fuse: {why}"),
        expected=[],
        near_miss_reason=reason,
    )


def _catalog() -> dict[str, QkvEntry]:
    s = QkvSpec
    entries = [
        _positive(s("qkv_decomposed_nbits", "decomposed", "nbits", opset=17)),
        _positive(s("qkv_decomposed_recip_dq_int4_rank3", "decomposed_recip", "dq_int4", rank=3)),
        _positive(
            s(
                "qkv_decomposed_cast_nbits_f16_rank3",
                "decomposed_cast",
                "nbits",
                dtype="float16",
                rank=3,
                epsilon=1e-5,
            )
        ),
        _positive(s("qkv_rms23_nbits_zp8_rank3", "rms23", "nbits_zp8", rank=3, opset=23)),
        _positive(
            s(
                "qkv_rms23_dq_uint4_f16",
                "rms23",
                "dq_uint4_zp8",
                dtype="float16",
                hidden=80,  # K not a multiple of 32: a partial last block
                epsilon=None,
                opset=23,
            )
        ),
        _positive(
            s(
                "qkv_sln_nbits_kvq_order",
                "sln",
                "nbits",
                roles=("k", "v", "q"),
                out_names=("k", "v", "q"),
                weight_names=("k_proj", "v_proj", "q_proj"),
            )
        ),
        _positive(
            s(
                "qkv_skip_sln_nbits_residual_rank3",
                "skip_sln",
                "nbits",
                rank=3,
                epsilon=1e-5,
                residual_output=True,
            )
        ),
        _positive(
            s(
                "qkv_skip_sln_dq_int4_f16_residual",
                "skip_sln",
                "dq_int4",
                dtype="float16",
                epsilon=None,
                residual_output=True,
            )
        ),
        _positive(s("qkv_add_sln_dq_int4_residual", "add_sln", "dq_int4", residual_output=True)),
        _positive(
            s(
                "qkv_add_decomposed_nbits_extra_consumer",
                "add_decomposed",
                "nbits",
                residual_output=True,
                extra_normed_consumer=True,
            ),
            kept=[("ReduceSum", 1), ("Add", 2), ("Pow", 1)],
        ),
        _positive(
            s(
                "qkv_sln_nbits_equal_widths_named",
                "sln",
                "nbits",
                nq=64,
                nkv=64,
                roles=("v", "q", "k"),
                out_names=("value_states", "query_states", "key_states"),
                weight_names=("w_a", "w_b", "w_c"),
            )
        ),
        _near_miss(
            s("nearmiss_qkv_asym_zp", "sln", "nbits_asym"),
            "asymmetric zero point",
            "the MatMulNBits zero points are not all 8 (min/max quantisation), and "
            "MatMulNBitsQkv has no zero-point inputs: its weights are symmetric.",
        ),
        _near_miss(
            s("nearmiss_qkv_block64", "decomposed", "dq_int4", hidden=128, block_size=64),
            "block_size 64",
            "the int4 weights are quantised in blocks of 64 along K; MatMulNBitsQkv's kernels "
            "take block_size 32 only (splitting each block in two with its scale repeated would "
            "be exact, but the rule does not re-block).",
        ),
        _near_miss(
            s(
                "nearmiss_qkv_two_projections",
                "sln",
                "nbits",
                roles=("q", "k"),
                out_names=("q", "k"),
            ),
            "only two projections",
            "the normalised value feeds only two projections (Q and K); MatMulNBitsQkv computes "
            "exactly three.",
        ),
        _near_miss(
            s("nearmiss_qkv_bits8", "rms23", "nbits_bits8", opset=23),
            "8-bit",
            "the MatMulNBits projections hold 8-bit weights (bits=8); MatMulNBitsQkv's kernels "
            "take 4-bit weights only.",
        ),
        _near_miss(
            s(
                "nearmiss_qkv_ambiguous_roles",
                "sln",
                "nbits",
                nq=64,
                nkv=64,
                out_names=("out_a", "out_b", "out_c"),
                weight_names=("w_a", "w_b", "w_c"),
            ),
            "cannot tell",
            "all three projections have width 64 and nothing downstream (attention inputs, "
            "RoPE, names) says which is Q, so the Q slot cannot be chosen.",
        ),
    ]
    catalog = {e.spec.name: e for e in entries}
    if len(catalog) != len(entries):  # pragma: no cover - guards edits to this file
        raise AssertionError("duplicate QKV sample names")
    return catalog


QKV_CATALOG: dict[str, QkvEntry] = _catalog()
