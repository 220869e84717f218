"""The sample catalogues as :class:`Sample` objects: build, list and find them by name.

Re-exported by :mod:`onnx_moe_fuse.samples` (whose docstring describes the samples).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import onnx

from onnx_moe_fuse.samples.catalog import CATALOG, DEFAULT_SAMPLE, Entry
from onnx_moe_fuse.samples.layers import build_layer
from onnx_moe_fuse.samples.qkv import QKV_CATALOG, QkvEntry, build_qkv

__all__ = [
    "Sample",
    "all_samples",
    "get_sample",
    "default_sample",
    "sample_names",
    "DEFAULT_KIND",
    "DEFAULT_SAMPLE",
    "SampleKind",
]

SampleKind = Literal["moe", "qkv", "all"]
#: What :func:`all_samples` / :func:`sample_names` list when no ``kind`` is given.
DEFAULT_KIND: SampleKind = "moe"

AttrValue = int | float | str

_WEIGHTS_LABEL = {
    "f32": "float",
    "int4b32": "int4-block32",
    "int4b128": "int4-block128",
    "u8pc": "uint8-per-channel",
    "u8asym": "uint8-asymmetric",
}


@dataclass(frozen=True, eq=False)
class Sample:
    """One sample MoE layer and what a fuser must turn it into.

    Attributes:
        name: unique name, ``<family>_<gmm|dec>_<weights>[_rank3]``.
        model: the ONNX model (a fresh ModelProto per :func:`get_sample` call).
        description: the layer in words.
        expected: fused ops and their counts, e.g. ``[("QMoE", 1)]``; ``[]`` for a near miss,
            whose model must come out of the fuser unchanged.
        near_miss_reason: for a near miss, the keyword a fuser's explanation should contain
            (case-insensitive substring), e.g. ``"sigmoid routing"``; None otherwise.
        family: ``mixtral``, ``qwen3``, ``qwen2``, ``gptoss``, ``gelu`` or ``nearmiss_<what>``.
        spelling: ``"GroupedMatMul"`` or ``"decomposed"``.
        weights: ``float``, ``int4-block32``, ``int4-block128``, ``uint8-per-channel`` or
            ``uint8-asymmetric``.
        opset: the default-domain opset the model declares (29 or 21).
        twin: for a GroupedMatMul sample, the name of its decomposed twin (same weights).
        expected_attributes: attributes the fused node must carry with these values (the ones
            that carry meaning; a fuser writes every attribute, these are a subset).
        kept_ops: ``(op_type, count)`` pairs the fused model must still hold exactly, e.g. the
            router MatMul and a shared expert's MatMuls.
        dim_values: a small value for each symbolic dim of the input (``T`` or ``B``, ``S``).
        kind: ``"moe"`` (this module's catalogue) or ``"qkv"`` (:mod:`.qkv`: family ``qkv`` or
            ``nearmiss_qkv_*``; spelling is the norm's, e.g. ``"SimplifiedLayerNormalization"``;
            weights the projections', e.g. ``"MatMulNBits-int4-block32"``; ``opset`` 17, 21 or 23).
    """

    name: str
    model: onnx.ModelProto
    description: str
    expected: list[tuple[str, int]]
    near_miss_reason: str | None
    family: str
    spelling: str
    weights: str
    opset: int
    twin: str | None = None
    expected_attributes: dict[str, AttrValue] = field(default_factory=dict)
    kept_ops: list[tuple[str, int]] = field(default_factory=list)
    dim_values: dict[str, int] = field(default_factory=dict)
    kind: str = "moe"

    @property
    def is_near_miss(self) -> bool:
        """True when the sample must not fuse."""
        return not self.expected

    def index_entry(self) -> dict[str, Any]:
        """The sample's record for ``index.json`` (everything but the model)."""
        return {
            "name": self.name,
            "file": f"{self.name}.onnx",
            "expected": [[op, count] for op, count in self.expected],
            "near_miss_reason": self.near_miss_reason,
            "description": self.description,
            "family": self.family,
            "spelling": self.spelling,
            "weights": self.weights,
            "opset": self.opset,
            "twin": self.twin,
            "expected_attributes": self.expected_attributes,
            "kept_ops": [[op, count] for op, count in self.kept_ops],
            "dim_values": self.dim_values,
            "kind": self.kind,
        }


def _annotate(model: onnx.ModelProto, entry: Entry | QkvEntry) -> None:
    """Write the entry's description, name, expected fusions and near-miss reason into the model."""
    model.doc_string = entry.description
    meta = {
        "onnx_moe_fuse.sample": entry.spec.name,
        "onnx_moe_fuse.expected": json.dumps([[op, n] for op, n in entry.expected]),
    }
    if entry.near_miss_reason:
        meta["onnx_moe_fuse.near_miss_reason"] = entry.near_miss_reason
    onnx.helper.set_model_props(model, meta)


def _make(entry: Entry) -> Sample:
    spec = entry.spec
    model = build_layer(spec)
    _annotate(model, entry)
    dims = {"T": 5} if spec.rank == 2 else {"B": 2, "S": 3}
    return Sample(
        name=spec.name,
        model=model,
        description=entry.description,
        expected=list(entry.expected),
        near_miss_reason=entry.near_miss_reason,
        family=entry.family,
        spelling="GroupedMatMul" if spec.spelling == "gmm" else "decomposed",
        weights=_WEIGHTS_LABEL[spec.weights],
        opset=spec.opset,
        twin=entry.twin,
        expected_attributes=dict(entry.expected_attributes),
        kept_ops=list(entry.kept_ops),
        dim_values=dims,
    )


_QKV_SPELLING = {
    "decomposed": "decomposed RMS norm",
    "decomposed_recip": "decomposed RMS norm",
    "decomposed_cast": "decomposed RMS norm",
    "add_decomposed": "Add + decomposed RMS norm",
    "rms23": "RMSNormalization",
    "sln": "SimplifiedLayerNormalization",
    "add_sln": "Add + SimplifiedLayerNormalization",
    "skip_sln": "SkipSimplifiedLayerNormalization",
}
_QKV_WEIGHTS = {
    "nbits": "MatMulNBits-int4-block{b}",
    "nbits_zp8": "MatMulNBits-int4-block{b}-zp8",
    "nbits_asym": "MatMulNBits-uint4-asymmetric",
    "nbits_bits8": "MatMulNBits-8bit-block{b}",
    "dq_int4": "int4-block{b}",
    "dq_uint4_zp8": "uint4-block{b}-zp8",
}


def _make_qkv(entry: QkvEntry) -> Sample:
    spec = entry.spec
    model = build_qkv(spec)
    _annotate(model, entry)
    return Sample(
        name=spec.name,
        model=model,
        description=entry.description,
        expected=list(entry.expected),
        near_miss_reason=entry.near_miss_reason,
        family=entry.family,
        spelling=_QKV_SPELLING[spec.norm],
        weights=_QKV_WEIGHTS[spec.projection].format(b=spec.block_size),
        opset=spec.opset,
        expected_attributes=dict(entry.expected_attributes),
        kept_ops=list(entry.kept_ops),
        dim_values={"T": 5} if spec.rank == 2 else {"B": 2, "S": 3},
        kind="qkv",
    )


def _names(kind: str) -> list[str]:
    if kind not in ("moe", "qkv", "all"):
        raise ValueError(f"kind must be 'moe', 'qkv' or 'all', got {kind!r}")
    return [
        *(CATALOG if kind in ("moe", "all") else ()),
        *(QKV_CATALOG if kind in ("qkv", "all") else ()),
    ]


def sample_names(kind: SampleKind = DEFAULT_KIND) -> list[str]:
    """Names of every sample of ``kind``, in catalogue order (MoE first for ``"all"``)."""
    return _names(kind)


def get_sample(name: str) -> Sample:
    """Build the sample called ``name``, of either kind (a fresh model each call)."""
    if name in CATALOG:
        return _make(CATALOG[name])
    if name in QKV_CATALOG:
        return _make_qkv(QKV_CATALOG[name])
    known = ", ".join(_names("all"))
    raise KeyError(f"no sample {name!r}; known: {known}")


def all_samples(kind: SampleKind = DEFAULT_KIND) -> list[Sample]:
    """Build every sample of ``kind``, in catalogue order (MoE first for ``"all"``)."""
    return [get_sample(name) for name in _names(kind)]


def default_sample() -> Sample:
    """The README demo's sample: Mixtral-like, int4 blocked 32, decomposed experts -> QMoE."""
    return get_sample(DEFAULT_SAMPLE)
