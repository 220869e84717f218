"""The com.microsoft op contract of each ONNX Runtime package the fuser can target.

No single node serves every ONNX Runtime: onnxruntime-webgpu 1.27 rejects a QMoE node that
carries ``weights_prepacked`` or ``accuracy_level`` ("Unrecognized attribute"), while ORT's CUDA
QMoE reads an absent ``weights_prepacked`` as -1 (CUTLASS-prepacked weights) and so needs
``weights_prepacked=0`` for the raw ``[E, N, K/pack]`` layout the fuser writes. And the packages
have kernels for different ops: ORT CPU has no MatMulNBitsQkv, onnxruntime-webgpu 1.27 no float
MoE. This module is the one home of those facts, as data (:data:`CONTRACTS`, :data:`MAX_OPSET`)
and one value object per target, :class:`Target`, which the fronts (``onnx_moe_fuse.fuse``, the
command line, the streaming path) parse a user's name into once (:func:`target_named`) and the
pipeline passes hand down:

* :attr:`Target.ops`: the fused ops the target has kernels for;
* :meth:`Target.refusal`: why a fused node cannot go to the target (op, activation or
  activation dtype it lacks), in plain words with the alternative, or None;
* :meth:`Target.node_attributes`: the attribute set a fused node carries for the target, from
  the semantic attributes a rule computed (:data:`SEMANTIC_ATTRIBUTES`);
  :meth:`Target.attribute_names` the names alone;
* :attr:`Target.max_opset`: the newest default-domain opset it loads.

An unknown name is a ``ValueError`` here (this module imports nothing of the project);
``onnx_moe_fuse.api.check_target`` turns it into the API's ``OptionError``.

Sources, read or measured 2026-12-01 (``docs/targets.md`` has the tables):

* ``ort-cpu``, ORT 1.32.0 CPU (measured here: its schema lists ``accuracy_level`` (default 0),
  ``weights_prepacked`` (default -1), ``quant_type`` (default "int") and ``swiglu_limit`` for
  QMoE; MoE and QMoE run relu, gelu, silu, identity and swiglu in float32 and float16;
  bfloat16 has no MoE kernel ("NOT_IMPLEMENTED: Could not find an implementation for MoE(1)")
  and a QMoE kernel that refuses the raw layout ("CPU bfloat16 QMoE requires a shared layout"),
  both measured by ``scripts/measure_half_kernels.py``, so neither is used;
  MatMulNBitsQkv is in the schema list but has no CPU kernel: NOT_IMPLEMENTED).
* ``ort-cuda``, ONNX Runtime's CUDA provider, from microsoft/onnxruntime (no CUDA here):
  ``docs/contrib_ops/cuda/moe_qmoe.md`` section 2.1 (QMoE attributes: ``weights_prepacked``
  tri-state, -1 default = already prepacked for CUTLASS, 0 = raw ``[E, N, K/pack]`` tensors that
  PrePack transforms; activation_type one of relu, gelu, silu, swiglu, identity) and
  ``onnxruntime/contrib_ops/cuda/cuda_contrib_kernels.cc`` (registers MoE for float, MLFloat16
  and BFloat16, QMoE for MLFloat16 and BFloat16 only, and no MatMulNBitsQkv). The attribute
  names are pinned by ``tests/contract/ort_schema_facts.json``. ``weights_prepacked`` is in ORT
  1.32's schema but not in 1.27's: a CUDA package older than the one that added it rejects it.
* ``ort-webgpu``, onnxruntime-webgpu 1.27.0 (measured here with its CPU provider, which checks
  the same schema, and on an H200 with its WebGPU provider): QMoE schema without
  ``weights_prepacked`` and ``accuracy_level``; its WebGPU QMoE kernel runs swiglu only; no
  WebGPU MoE kernel ("webgpu kernel not found in registries for Op type: MoE"); MatMulNBitsQkv
  runs (its schema has ``accuracy_level``, default 0). Its CPU provider runs MoE and QMoE (4-
  and 8-bit) in float32 and float16 and has no bfloat16 kernel for either
  (``scripts/measure_half_kernels.py``). Its WebGPU QMoE is taken for float32 and float16 (ORT's
  WebGPU kernels register WebGpuSupportedFloatTypes, float and MLFloat16; the WebGPU provider
  itself was run on float32 QMoE only, on the H200).

``swiglu_limit`` is in every target's schema (1.27 and 1.32; absent means +inf), so every
target gets it, +inf when the layer does not clamp. ``swiglu_limit_after_activation`` (new in ORT
1.32, default 0 = clamp before the activation, the meaning the rules prove) is not written: a
pre-1.32 build would reject it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from onnx_moe_fuse.contract.ops import ACTIVATION_TYPES, MATMUL_NBITS_QKV, MOE, QMOE

__all__ = [
    "CONTRACTS",
    "DEFAULT",
    "DEFAULT_TARGET",
    "INEXACT_QMOE_BLOCK_BITS",
    "MAX_OPSET",
    "SEMANTIC_ATTRIBUTES",
    "TARGETS",
    "OpContract",
    "Target",
    "as_target",
    "target_named",
]

#: The runtimes a fused model can be written for.
TARGETS: tuple[str, ...] = ("ort-cpu", "ort-cuda", "ort-webgpu")
#: The target when none is given.
DEFAULT_TARGET = "ort-cpu"

_MOE_SEMANTIC = frozenset(
    {
        "k",
        "activation_type",
        "normalize_routing_weights",
        "use_sparse_mixer",
        "swiglu_fusion",
        "activation_alpha",
        "activation_beta",
        "swiglu_limit",
    }
)
#: The attributes a rule computes for each fused op (what the node means, on any target).
SEMANTIC_ATTRIBUTES: dict[str, frozenset[str]] = {
    MOE.name: _MOE_SEMANTIC,
    QMOE.name: _MOE_SEMANTIC | {"expert_weight_bits", "block_size"},
    MATMUL_NBITS_QKV.name: frozenset({"K", "Nq", "Nkv", "bits", "block_size", "epsilon"}),
}

_ALL_ACTIVATIONS = frozenset(ACTIVATION_TYPES)


@dataclass(frozen=True)
class OpContract:
    """What one target's kernel for one fused op takes, and the attributes its node carries.

    ``activations``: the ``activation_type`` values the kernel runs (None: the op has none);
    ``dtypes``: the activation (input 0) dtypes it has a kernel for; ``fixed``: attributes the
    target needs written with these values; ``omitted``: attributes its schema rejects;
    ``source``: where the facts come from, in words; ``zero_points``: the QMoE weight
    granularities (``"per-channel"``, ``"block-wise"``) whose explicit, asymmetric zero points
    (inputs 11-13) the kernel honours, and ``zero_points_source`` where that comes from.
    """

    activations: frozenset[str] | None
    dtypes: frozenset[str]
    source: str
    fixed: Mapping[str, Any] = field(default_factory=dict)
    omitted: frozenset[str] = frozenset()
    zero_points: frozenset[str] = frozenset()
    zero_points_source: str = ""


_CPU = "ORT 1.32 CPU (measured: scripts/measure_half_kernels.py)"
_CUDA = "ORT CUDA (docs/contrib_ops/cuda/moe_qmoe.md, cuda_contrib_kernels.cc)"
_WEBGPU = "onnxruntime-webgpu 1.27 (measured: scripts/measure_half_kernels.py)"

#: ``{target: {op: OpContract}}``; an op missing from a target has no kernel there.
CONTRACTS: dict[str, dict[str, OpContract]] = {
    "ort-cpu": {
        "MoE": OpContract(_ALL_ACTIVATIONS, frozenset({"float32", "float16"}), _CPU),
        "QMoE": OpContract(
            _ALL_ACTIVATIONS,
            frozenset({"float32", "float16"}),
            _CPU,
            # accuracy_level 0: no int8 activations (4 quantises them, about 1 % off)
            fixed={"quant_type": "int", "weights_prepacked": 0, "accuracy_level": 0},
            zero_points=frozenset({"per-channel", "block-wise"}),
            zero_points_source="ORT 1.32 CPU, measured: 4- and 8-bit, per channel and blocked",
        ),
    },
    "ort-cuda": {
        "MoE": OpContract(_ALL_ACTIVATIONS, frozenset({"float32", "float16", "bfloat16"}), _CUDA),
        "QMoE": OpContract(
            _ALL_ACTIVATIONS,
            frozenset({"float16", "bfloat16"}),
            _CUDA,
            # -1 (absent) means CUTLASS-prepacked on CUDA; the fuser writes raw [E, N, K/pack].
            # accuracy_level is a CPU knob, not among the CUDA attributes (moe_qmoe.md 2.1).
            fixed={"quant_type": "int", "weights_prepacked": 0},
            omitted=frozenset({"accuracy_level"}),
            # moe_quantization.cc (read at 4b2d9237 and 00d47b6): zero points go to CUTLASS's
            # QuantParams::GroupWise only; the per-column QuantParams::Int takes none (ignored)
            zero_points=frozenset({"block-wise"}),
            zero_points_source=(
                "ORT CUDA, read in contrib_ops/cuda/moe/moe_quantization.cc: block-wise only; "
                "per-column QMoE passes no zero points to its GEMM"
            ),
        ),
    },
    "ort-webgpu": {
        "QMoE": OpContract(
            frozenset({"swiglu"}),
            frozenset({"float32", "float16"}),
            _WEBGPU,
            fixed={"quant_type": "int"},
            omitted=frozenset({"weights_prepacked", "accuracy_level"}),
            zero_points_source=(
                "onnxruntime-webgpu, read in contrib_ops/webgpu/moe/qmoe.cc: NOT_IMPLEMENTED "
                '"zero_points for QMoE are not yet supported on WebGPU"'
            ),
        ),
        "MatMulNBitsQkv": OpContract(
            None, frozenset({"float32", "float16"}), _WEBGPU, fixed={"accuracy_level": 0}
        ),
    },
}

#: Why a target lacks an op, and what to do instead.
_MISSING: dict[tuple[str, str], str] = {
    ("ort-webgpu", "MoE"): (
        "ort-webgpu has no float MoE kernel (onnxruntime-webgpu 1.27): quantize the experts to "
        "fuse into QMoE (--quantize int4, not exact), or target ort-cpu or ort-cuda"
    ),
    ("ort-cpu", "MatMulNBitsQkv"): (
        "ort-cpu has no MatMulNBitsQkv kernel (ORT 1.32 CPU: NOT_IMPLEMENTED), so the norm and "
        "its three MatMulNBits stay as they are (ORT CPU runs them): target ort-webgpu to fuse "
        "them"
    ),
    ("ort-cuda", "MatMulNBitsQkv"): (
        "ort-cuda has no MatMulNBitsQkv kernel (cuda_contrib_kernels.cc registers none), so the "
        "norm and its three MatMulNBits stay as they are (ORT CUDA runs them): target "
        "ort-webgpu to fuse them"
    ),
}


#: The QMoE bit widths whose block-wise form a target computes inexactly: ORT 1.32 CPU's
#: block-wise 8-bit QMoE quantises the activations to int8 per block whatever accuracy_level
#: says (measured: 7e-3 relative on random weights, 0.7-2 % on layers; per-channel 8-bit and
#: every 4-bit form are exact at accuracy_level 0). Not established for the other targets
#: (ort-cuda has no float32 QMoE kernel; ort-webgpu's block-wise 8-bit was not run here).
INEXACT_QMOE_BLOCK_BITS: dict[str, frozenset[int]] = {"ort-cpu": frozenset({8})}


#: The newest default-domain (ai.onnx) opset each target loads: ORT 1.32 loads 28 (measured);
#: onnxruntime-webgpu 1.27 refuses more than 26 (measured: "Current official support for domain
#: ai.onnx is till opset 26"); for CUDA the ORT release the CPU target is measured on.
MAX_OPSET: dict[str, int] = {"ort-cpu": 28, "ort-cuda": 28, "ort-webgpu": 26}


@dataclass(frozen=True)
class Target:
    """One runtime a fused model is written for: its name, ops and opset, parsed once.

    Get one with :func:`target_named` (or the constants :data:`DEFAULT`); the pipeline passes
    take it as it is. ``contracts`` maps each fused op the target has a kernel for to its
    :class:`OpContract`; ``max_opset`` is the newest default-domain opset it loads.
    """

    name: str
    contracts: Mapping[str, OpContract]
    max_opset: int

    def __str__(self) -> str:
        """The target's name (``ort-cpu``)."""
        return self.name

    def __hash__(self) -> int:
        """By name: there is one object per target."""
        return hash(self.name)

    @property
    def ops(self) -> frozenset[str]:
        """The fused ops this target has kernels for."""
        return frozenset(self.contracts)

    def refusal(
        self,
        op: str,
        activation: str | None,
        dtype: str | None = None,
        zero_points: str | None = None,
    ) -> str | None:
        """Why a fused ``op`` node (its ``activation_type``, input-0 ``dtype``) cannot go here.

        ``zero_points``: the granularity (``"per-channel"``/``"block-wise"``) of a QMoE node
        with explicit asymmetric zero points, None for symmetric weights. None when the target
        has a kernel for it. The reason names the target and the alternative.
        """
        target = self.name
        contract = self.contracts.get(op)
        if contract is None:
            return _MISSING.get(
                (target, op), f"{target} has no {op} kernel: target one of {', '.join(TARGETS)}"
            )
        if contract.activations is not None and activation not in contract.activations:
            others = [t for t in TARGETS if t != target and _takes(t, op, activation)]
            return (
                f"{target}'s {op} kernel runs activation_type "
                f"{' or '.join(sorted(contract.activations))} only ({contract.source}); this "
                f"layer's is {activation}" + (f": target {' or '.join(others)}" if others else "")
            )
        if dtype is not None and dtype not in contract.dtypes:
            others = [t for t in TARGETS if t != target and _takes(t, op, activation, dtype)]
            return (
                f"{target} has no {dtype} {op} kernel ({contract.source}: "
                f"{', '.join(sorted(contract.dtypes))} only); this layer computes in {dtype}"
                + (f": target {' or '.join(others)}" if others else "")
            )
        if zero_points is not None and zero_points not in contract.zero_points:
            others = [
                t
                for t in TARGETS
                if t != target
                and _takes(t, op, activation, dtype)
                and zero_points in CONTRACTS[t][op].zero_points
            ]
            return (
                f"{target}'s {op} kernel does not take {zero_points} asymmetric zero points "
                f"({contract.zero_points_source}); this layer's weights have them"
                + (f": target {' or '.join(others)}" if others else "")
            )
        return None

    def attribute_names(self, op: str) -> frozenset[str]:
        """Every attribute a fused ``op`` node carries here (``KeyError``: no kernel)."""
        contract = self.contracts[op]
        return (SEMANTIC_ATTRIBUTES[op] | set(contract.fixed)) - contract.omitted

    def node_attributes(self, op: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
        """The attributes a fused ``op`` node carries here, from a rule's ``attrs``.

        ``attrs`` must hold every semantic attribute (:data:`SEMANTIC_ATTRIBUTES`;
        ``swiglu_limit`` may be left out when there is no clamp: it becomes +inf). Attributes
        the target's schema rejects are dropped, the ones it needs with fixed values are set.
        ``KeyError`` when the target has no kernel for ``op`` (ask :meth:`refusal` first);
        ``ValueError`` when a semantic attribute is missing.
        """
        contract = self.contracts[op]
        out = dict(attrs)
        if "swiglu_limit" in SEMANTIC_ATTRIBUTES[op]:
            out.setdefault("swiglu_limit", math.inf)
        missing = SEMANTIC_ATTRIBUTES[op] - set(out)
        if missing:
            raise ValueError(f"a fused {op} node needs the attributes {sorted(missing)}")
        out.update(contract.fixed)
        for name in contract.omitted:
            out.pop(name, None)
        return out


def _takes(target: str, op: str, activation: str | None, dtype: str | None = None) -> bool:
    contract = CONTRACTS[target].get(op)
    if contract is None:
        return False
    if contract.activations is not None and activation not in contract.activations:
        return False
    return dtype is None or dtype in contract.dtypes


#: One :class:`Target` per name of :data:`TARGETS`.
_BY_NAME: dict[str, Target] = {
    name: Target(name, CONTRACTS[name], MAX_OPSET[name]) for name in TARGETS
}
#: The target when none is given (:data:`DEFAULT_TARGET`).
DEFAULT: Target = _BY_NAME[DEFAULT_TARGET]


def target_named(name: str) -> Target:
    """The :class:`Target` called ``name``; ``ValueError`` naming the choices for another."""
    target = _BY_NAME.get(name) if isinstance(name, str) else None
    if target is None:
        raise ValueError(f"unknown target {name!r}: choose one of {', '.join(TARGETS)}")
    return target


def as_target(target: Target | str) -> Target:
    """``target`` itself, or the :class:`Target` it names (:func:`target_named`).

    For the faces that take a target from users (a name) or from another face (parsed).
    """
    return target if isinstance(target, Target) else target_named(target)
