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

Use :data:`QKV_CATALOG` and :func:`build_qkv` (the records: :mod:`.qkv_spec`; the graphs:
:mod:`.qkv_graph`); :mod:`onnx_moe_fuse.samples` turns the entries into
``Sample`` records (``kind="qkv"``). ``docs/samples.md`` lists them.
"""

from __future__ import annotations

from onnx_moe_fuse.samples.qkv_graph import build_qkv, expected_epsilon, repacked_weights
from onnx_moe_fuse.samples.qkv_spec import NORMS, PROJECTIONS, ROLES, QkvEntry, QkvSpec

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
        for role in ROLES:
            base = spec.weight_names[roles.index(role)]
            inputs[f"{role}_B"] = f"{base}_B"
            inputs[f"{role}_scales"] = f"{base}_scales"
    outputs = tuple(spec.out_names[roles.index(r)] for r in ROLES)
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
