"""How each op the wgpu evaluator runs maps onto its kernel package, and the evaluator's errors.

A :class:`KernelOpSpec` per op: the ONNX input positions in order (from
:mod:`onnx_moe_fuse.contract.ops` for the ``com.microsoft`` ops) with the kernel's bind key for
each (:data:`onnx_moe_fuse.verify.oracles.kernel_calls.BIND_KEYS`), what a kernel lacks when its
manifest does not declare one, which present inputs may be dropped (symmetric zero points), the
output bind keys, and the attributes that may be dropped because they cannot change the result.
:data:`KERNEL_OPS` holds them by ``(domain, op_type)``. :mod:`onnx_moe_fuse.verify.evaluator`
binds and runs nodes with them (and re-exports these names).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnx_moe_fuse.contract import ops
from onnx_moe_fuse.contract.packing import QMOE_SYMMETRIC_ZERO_POINT_BYTE
from onnx_moe_fuse.verify.oracles.kernel_calls import BIND_KEYS

__all__ = [
    "GROUPED_MATMUL",
    "KERNEL_OPS",
    "MATMUL_NBITS_QKV",
    "MOE",
    "QMOE",
    "KernelNodeError",
    "KernelOpSpec",
    "KernelPackageMissingError",
    "Slot",
    "UnsupportedNodeError",
    "WgpuEvaluatorError",
    "text_value",
]


class WgpuEvaluatorError(Exception):
    """Base class of the wgpu evaluator's errors."""


class KernelPackageMissingError(WgpuEvaluatorError, LookupError):
    """The kernel package for an op in the model is not installed."""

    def __init__(self, op: str, package: str, detail: str) -> None:
        """Record the op (``com.microsoft.QMoE``), its package folder and get_kernel's message."""
        self.op = op
        self.package = package
        super().__init__(
            f"the WebGPU kernel package for {op} is not installed (expected at {package}/ in "
            f"onnx_moe_fuse.kernels): {detail}"
        )


class UnsupportedNodeError(WgpuEvaluatorError, ValueError):
    """A node uses an input or attribute that its kernel package does not implement."""


class KernelNodeError(WgpuEvaluatorError, ValueError):
    """The kernel refused or failed a node's call (wrong dtype, shape, attribute value, ...)."""


Attrs = Mapping[str, Any]
#: ``(value, all node attributes) -> True`` when dropping the attribute changes nothing.
NeutralCheck = Callable[[Any, Attrs], bool]
#: ``(value, all node attributes) -> None`` to drop the input, or a refusal reason.
InputCheck = Callable[[np.ndarray, Attrs], str | None]


@dataclass(frozen=True)
class Slot:
    """One ONNX input position of a fused op."""

    onnx_name: str
    bind_key: str  # the kernel's name for it, used when the kernel's manifest declares it
    what: str = ""  # what the kernel lacks when its manifest does not declare bind_key
    droppable: InputCheck | None = None  # else: may a present value be dropped, not refused?


@dataclass(frozen=True)
class KernelOpSpec:
    """How one ONNX op maps onto its kernel package."""

    domain: str
    op_type: str
    package: str  # folder under kernels/
    inputs: tuple[Slot, ...]
    outputs: tuple[str, ...]  # bind key per ONNX output position
    optional_outputs: frozenset[str] = frozenset()  # bind keys produced only when asked for
    neutral_attributes: Mapping[str, NeutralCheck] = field(default_factory=dict)
    absent_attributes: Mapping[str, NeutralCheck] = field(default_factory=dict)

    @property
    def qualified_name(self) -> str:
        """``domain.op_type`` (just ``op_type`` in the default domain): get_kernel's name."""
        return f"{self.domain}.{self.op_type}" if self.domain else self.op_type


def text_value(value: Any) -> Any:
    """A string attribute as ``str`` (ONNX hands them over as bytes); other values as they are."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _always(_value: Any, _attrs: Attrs) -> bool:
    return True


def _equals(*allowed: Any) -> NeutralCheck:
    return lambda value, _attrs: text_value(value) in allowed


def _same_bits(value: Any, attrs: Attrs) -> bool:
    return int(value) == int(
        attrs.get("expert_weight_bits", ops.QMOE.default("expert_weight_bits"))
    )


def _infinite(value: Any, _attrs: Attrs) -> bool:
    # ReferenceEvaluator hands float attributes over as numpy scalars, not Python floats.
    return isinstance(value, (float, np.floating)) and math.isinf(float(value))


def _not_positive(value: Any, _attrs: Attrs) -> bool:
    return int(value) <= 0


def _symmetric_zero_points(value: np.ndarray, attrs: Attrs) -> str | None:
    bits = int(attrs.get("expert_weight_bits", ops.QMOE.default("expert_weight_bits")))
    symmetric = QMOE_SYMMETRIC_ZERO_POINT_BYTE.get(bits)
    if symmetric is not None and value.dtype == np.uint8 and np.all(value == symmetric):
        return None
    return (
        f"explicit zero points other than the symmetric point {1 << (bits - 1)} (the kernel "
        "implements symmetric weights only)"
    )


_QMOE_NEUTRAL: dict[str, NeutralCheck] = {
    "accuracy_level": _always,  # lets ORT quantise activations; the kernel computes in float
    "fc1_expert_weight_bits": _same_bits,
    "fc2_expert_weight_bits": _same_bits,
    "fc3_expert_weight_bits": _always,  # meaningless without FC3, bound or refused by itself
    "quant_type": _equals("int"),
    "swiglu_limit_after_activation": _equals(0),
    "use_sparse_mixer": _equals(0),
    "weights_prepacked": _equals(-1, 0),
}

_MOE_NEUTRAL: dict[str, NeutralCheck] = {
    "swiglu_limit_after_activation": _equals(0),
    "use_sparse_mixer": _equals(0),
}

#: ONNX ``GroupedMatMul`` (opset 29, default domain: not one of the contract's ops).
GROUPED_MATMUL = KernelOpSpec(
    domain="",
    op_type="GroupedMatMul",
    package="kernels/grouped_matmul",
    inputs=(
        Slot("input", BIND_KEYS["GroupedMatMul"]["input"]),
        Slot("weights", BIND_KEYS["GroupedMatMul"]["weights"]),
        Slot("group_indices", BIND_KEYS["GroupedMatMul"]["group_indices"]),
        Slot("bias", BIND_KEYS["GroupedMatMul"]["bias"], "a bias"),
    ),
    outputs=(BIND_KEYS["GroupedMatMul"]["output"],),
)


def _contrib_spec(
    op: ops.ContribOp,
    package: str,
    *,
    lacking: Mapping[str, str] | None = None,
    droppable: Mapping[str, InputCheck] | None = None,
    **more: Any,
) -> KernelOpSpec:
    """The spec of a ``com.microsoft`` op from the contract's input order and the bind keys.

    The inputs go up to the last one with a bind key (no kernel implements one past it: those
    are refused by position). ``lacking``: what the kernel lacks, in words, for an input its
    manifest may not declare; ``droppable``: the check that may drop a present input instead.
    """
    lacking, droppable = lacking or {}, droppable or {}
    keys = BIND_KEYS[op.name]
    mapped = [name for name in op.input_names if name in keys]
    assert op.input_names[: len(mapped)] == tuple(mapped), op.name  # a prefix of the positions
    return KernelOpSpec(
        domain=op.domain,
        op_type=op.name,
        package=package,
        inputs=tuple(
            Slot(name, keys[name], lacking.get(name, ""), droppable.get(name)) for name in mapped
        ),
        outputs=tuple(keys[p.name] for p in op.outputs),
        optional_outputs=frozenset(keys[p.name] for p in op.outputs if p.optional),
        **more,
    )


QMOE = _contrib_spec(
    ops.QMOE,
    "kernels/qmoe",
    lacking={
        "fc1_experts_bias": "an FC1 bias",
        "fc2_experts_bias": "an FC2 bias",
        "fc3_experts_weights": "FC3",
        "fc3_scales": "FC3",
        "fc3_experts_bias": "FC3",
    },
    droppable={
        "fc1_zero_points": _symmetric_zero_points,
        "fc2_zero_points": _symmetric_zero_points,
        "fc3_zero_points": _symmetric_zero_points,
    },
    neutral_attributes=_QMOE_NEUTRAL,
    absent_attributes={"swiglu_limit": _infinite, "block_size": _not_positive},
)

MOE = _contrib_spec(
    ops.MOE,
    "kernels/moe",
    lacking={
        "fc1_experts_bias": "an FC1 bias",
        "fc2_experts_bias": "an FC2 bias",
        "fc3_experts_weights": "FC3",
        "fc3_experts_bias": "an FC3 bias",
    },
    neutral_attributes=_MOE_NEUTRAL,
    absent_attributes={"swiglu_limit": _infinite},
)

MATMUL_NBITS_QKV = _contrib_spec(
    ops.MATMUL_NBITS_QKV,
    "kernels/matmul_nbits_qkv",
    lacking={
        "skip": "a skip input",
        "q_bias": "a Q bias",
        "k_bias": "a K bias",
        "v_bias": "a V bias",
    },
)

#: The ops the wgpu evaluator runs on kernels, keyed by ``(domain, op_type)``.
KERNEL_OPS: dict[tuple[str, str], KernelOpSpec] = {
    (s.domain, s.op_type): s for s in (GROUPED_MATMUL, QMOE, MOE, MATMUL_NBITS_QKV)
}
