"""Reference path of the equivalence checker: ``onnx.reference`` plus the project's numpy oracles.

:func:`run_reference` evaluates a model with ``onnx.reference.ReferenceEvaluator`` and supplies
``OpRun`` classes for the ops the installed ``onnx`` cannot run:

* ``GroupedMatMul`` (default domain, opset 29) -> :func:`onnx_moe_fuse.oracles.grouped_matmul.
  grouped_matmul`;
* ``com.microsoft.MoE`` -> :func:`onnx_moe_fuse.oracles.moe.moe`;
* ``com.microsoft.QMoE`` -> :func:`onnx_moe_fuse.oracles.moe.qmoe` (symmetric weights; zero-point
  inputs are accepted only when they hold the symmetric point, and FC3, ``router_weights``,
  sparse mixer and the FP4/FP8 extras are refused with ``NotImplementedError``).

Opset 29 under onnx 1.23 (measured with onnx 1.23.2, whose newest opset is 28): the
ReferenceEvaluator does not refuse a model that declares ``"" : 29``. It never checks the declared
opset against its schemas; for each standard op it takes the newest implementation whose version
is at most the declared opset, and a ``new_ops`` class, keyed by (domain, op type), is used before
any built-in one. So an opset-29 model runs as it is, with ``GroupedMatMul`` from the OpRun below
(by the evaluator's code, the same class also takes precedence over onnx-weekly's own
implementation; that was read, not run). No copy with a lowered opset is needed. The caveat: an op that opset 29
changed would run with its opset-28 meaning under onnx 1.23 (every other op of the samples is at
its newest onnx 1.23 version: DequantizeLinear 28, TopK 24, Reshape/Squeeze/Unsqueeze 25, ...).
``onnx.checker``, by contrast, does refuse opset 29 under onnx 1.23 ("No Op registered for
GroupedMatMul with domain_version of 29").

:func:`random_feeds` makes fresh random inputs for every graph input, symbolic dims given small
values.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from .oracles.grouped_matmul import grouped_matmul
from .oracles.moe import moe, qmoe

__all__ = [
    "DEFAULT_DIM_VALUES",
    "GroupedMatMul",
    "MoE",
    "QMoE",
    "reference_evaluator",
    "run_reference",
    "random_feeds",
]

#: Values for the symbolic dims the samples use; other names get ``default_dim``.
DEFAULT_DIM_VALUES: dict[str, int] = {"T": 5, "B": 2, "S": 3}

_MS = "com.microsoft"
_FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))


class GroupedMatMul(OpRun):
    """ONNX ``GroupedMatMul`` (opset 29): ``out[m, i] = input[m] @ weights[idx[m, i]] (+ bias)``."""

    op_domain = ""

    def _run(  # type: ignore[override]
        self,
        input: np.ndarray,  # noqa: A002 - named after the ONNX input
        weights: np.ndarray,
        group_indices: np.ndarray,
        bias: np.ndarray | None = None,
    ) -> tuple[np.ndarray]:
        return (grouped_matmul(input, weights, group_indices, bias),)


def _limit(value: float | None) -> float | None:
    """ORT's ``swiglu_limit``: absent or infinite means no clamp."""
    if value is None or math.isinf(value):
        return None
    return float(value)


def _refuse(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"com.microsoft.{op}: {what} is not supported by the reference path")


class MoE(OpRun):
    """ORT ``com.microsoft.MoE`` through the numpy oracle (inputs at ORT's positions)."""

    op_domain = _MS

    def _run(  # type: ignore[override]
        self,
        input: np.ndarray,  # noqa: A002 - named after the ONNX input
        router_probs: np.ndarray,
        fc1_experts_weights: np.ndarray,
        fc1_experts_bias: np.ndarray | None = None,
        fc2_experts_weights: np.ndarray | None = None,
        fc2_experts_bias: np.ndarray | None = None,
        fc3_experts_weights: np.ndarray | None = None,
        fc3_experts_bias: np.ndarray | None = None,
        *,
        k: int = 1,
        activation_type: str = "relu",
        swiglu_fusion: int = 0,
        normalize_routing_weights: int = 0,
        activation_alpha: float = 1.0,
        activation_beta: float = 0.0,
        swiglu_limit: float | None = None,
        swiglu_limit_after_activation: int = 0,
        use_sparse_mixer: int = 0,
    ) -> tuple[np.ndarray]:
        if fc2_experts_weights is None:
            raise ValueError("com.microsoft.MoE: fc2_experts_weights (input 4) is required")
        if use_sparse_mixer:
            raise _refuse("MoE", "use_sparse_mixer=1")
        if swiglu_limit_after_activation:
            raise _refuse("MoE", "swiglu_limit_after_activation=1")
        out = moe(
            input,
            router_probs,
            fc1_experts_weights,
            fc2_experts_weights,
            fc1_bias=fc1_experts_bias,
            fc2_bias=fc2_experts_bias,
            fc3=fc3_experts_weights,
            fc3_bias=fc3_experts_bias,
            k=int(k),
            activation_type=_text(activation_type),
            swiglu_fusion=int(swiglu_fusion),
            normalize_routing_weights=int(normalize_routing_weights),
            activation_alpha=float(activation_alpha),
            activation_beta=float(activation_beta),
            swiglu_limit=_limit(swiglu_limit),
        )
        return (out.astype(input.dtype, copy=False),)


def _text(value: str | bytes) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _check_symmetric_zero_points(zp: np.ndarray | None, bits: int, name: str) -> None:
    """Accept an explicit zero-point input only when it holds the symmetric point everywhere."""
    if zp is None:
        return
    symmetric = 0x88 if bits == 4 else 0x80  # 4-bit: two packed codes of 8 per byte
    arr = np.asarray(zp)
    if arr.dtype != np.uint8 or np.any(arr != symmetric):
        raise _refuse("QMoE", f"{name} that are not the symmetric point {1 << (bits - 1)}")


class QMoE(OpRun):
    """ORT ``com.microsoft.QMoE`` through the numpy oracle (inputs at ORT's positions)."""

    op_domain = _MS

    def _run(  # type: ignore[override]
        self,
        input: np.ndarray,  # noqa: A002 - named after the ONNX input
        router_probs: np.ndarray,
        fc1_experts_weights: np.ndarray,
        fc1_scales: np.ndarray | None = None,
        fc1_experts_bias: np.ndarray | None = None,
        fc2_experts_weights: np.ndarray | None = None,
        fc2_scales: np.ndarray | None = None,
        fc2_experts_bias: np.ndarray | None = None,
        fc3_experts_weights: np.ndarray | None = None,
        fc3_scales: np.ndarray | None = None,
        fc3_experts_bias: np.ndarray | None = None,
        fc1_zero_points: np.ndarray | None = None,
        fc2_zero_points: np.ndarray | None = None,
        fc3_zero_points: np.ndarray | None = None,
        router_weights: np.ndarray | None = None,
        *extras: np.ndarray | None,
        k: int = 1,
        activation_type: str = "relu",
        expert_weight_bits: int = 4,
        fc1_expert_weight_bits: int | None = None,
        fc2_expert_weight_bits: int | None = None,
        fc3_expert_weight_bits: int | None = None,
        block_size: int | None = None,
        swiglu_fusion: int = 0,
        normalize_routing_weights: int = 0,
        activation_alpha: float = 1.0,
        activation_beta: float = 0.0,
        swiglu_limit: float | None = None,
        swiglu_limit_after_activation: int = 0,
        use_sparse_mixer: int = 0,
        quant_type: str = "int",
        weights_prepacked: int = -1,
        accuracy_level: int = 0,  # ORT numerics only; the oracle is exact
    ) -> tuple[np.ndarray]:
        del accuracy_level
        if fc2_experts_weights is None or fc1_scales is None or fc2_scales is None:
            raise ValueError("com.microsoft.QMoE: fc1/fc2 weights and scales are required")
        if fc3_experts_weights is not None or fc3_scales is not None or fc3_zero_points is not None:
            raise _refuse("QMoE", "FC3")
        if fc3_experts_bias is not None:
            raise _refuse("QMoE", "fc3_experts_bias")
        if router_weights is not None:
            raise _refuse("QMoE", "router_weights (input 14)")
        if any(e is not None for e in extras):
            raise _refuse("QMoE", "FP4/FP8 inputs (15+)")
        if use_sparse_mixer:
            raise _refuse("QMoE", "use_sparse_mixer=1")
        if swiglu_limit_after_activation:
            raise _refuse("QMoE", "swiglu_limit_after_activation=1")
        if _text(quant_type) != "int":
            raise _refuse("QMoE", f"quant_type={_text(quant_type)!r}")
        if weights_prepacked == 1:
            raise _refuse("QMoE", "weights_prepacked=1")
        bits = int(expert_weight_bits)
        for name, b in (("fc1", fc1_expert_weight_bits), ("fc2", fc2_expert_weight_bits)):
            if b is not None and int(b) != bits:
                raise _refuse("QMoE", f"{name}_expert_weight_bits={b} != expert_weight_bits={bits}")
        del fc3_expert_weight_bits
        _check_symmetric_zero_points(fc1_zero_points, bits, "fc1_zero_points")
        _check_symmetric_zero_points(fc2_zero_points, bits, "fc2_zero_points")
        out = qmoe(
            input,
            router_probs,
            fc1_experts_weights,
            fc1_scales,
            fc2_experts_weights,
            fc2_scales,
            k=int(k),
            activation_type=_text(activation_type),
            expert_weight_bits=bits,
            block_size=int(block_size) if block_size else None,
            swiglu_fusion=int(swiglu_fusion),
            activation_alpha=float(activation_alpha),
            activation_beta=float(activation_beta),
            swiglu_limit=_limit(swiglu_limit),
            fc1_bias=fc1_experts_bias,
            fc2_bias=fc2_experts_bias,
            normalize_routing_weights=int(normalize_routing_weights),
        )
        return (out.astype(input.dtype, copy=False),)


CUSTOM_OPS: tuple[type[OpRun], ...] = (GroupedMatMul, MoE, QMoE)


def reference_evaluator(
    model: onnx.ModelProto | str | os.PathLike[str], *, check_shapes: bool = False
) -> ReferenceEvaluator:
    """Return a ReferenceEvaluator for ``model`` with the project's OpRun classes installed.

    ``check_shapes`` turns on the evaluator's check of every computed value against its declared
    type and shape (symbolic dims bound consistently).
    """
    if not isinstance(model, onnx.ModelProto):
        model = os.fspath(model)
    return ReferenceEvaluator(model, new_ops=list(CUSTOM_OPS), check_shape_annotations=check_shapes)


def run_reference(
    model: onnx.ModelProto | str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray],
    *,
    outputs: Sequence[str] | None = None,
    check_shapes: bool = False,
) -> dict[str, np.ndarray]:
    """Run ``model`` on ``feeds`` on the reference path; returns ``{output name: array}``.

    Standard ops run in ``onnx.reference``; ``GroupedMatMul``, ``com.microsoft.MoE`` and
    ``com.microsoft.QMoE`` run in the project's numpy oracles. A model declaring opset 29 is run
    as it is (see the module docstring). ``outputs`` selects graph outputs (default: all).
    """
    ev = reference_evaluator(model, check_shapes=check_shapes)
    names = list(outputs) if outputs is not None else list(ev.output_names)
    results = ev.run(names, dict(feeds))
    return dict(zip(names, results, strict=True))


def _dim_value(dim: Any, dim_values: Mapping[str, int], default_dim: int) -> int:
    if dim.HasField("dim_value"):
        return int(dim.dim_value)
    if dim.HasField("dim_param") and dim.dim_param in dim_values:
        return int(dim_values[dim.dim_param])
    return default_dim


def random_feeds(
    model: onnx.ModelProto,
    seed: int,
    dim_values: Mapping[str, int] | None = None,
    *,
    default_dim: int = 3,
    scale: float = 1.0,
) -> dict[str, np.ndarray]:
    """Fresh random values for every graph input that no initializer provides.

    Float inputs (float16/bfloat16/float32/float64) get ``scale * N(0, 1)`` values; integer inputs
    get integers in ``[0, 4)``; bool inputs random booleans. A symbolic dim takes its value from
    ``dim_values`` (over :data:`DEFAULT_DIM_VALUES`), an unnamed or unknown one ``default_dim``.
    The same ``seed`` gives the same feeds.
    """
    dims = {**DEFAULT_DIM_VALUES, **(dim_values or {})}
    rng = np.random.default_rng(seed)
    initialized = {init.name for init in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.input:
        if value.name in initialized:
            continue
        if not value.type.HasField("tensor_type"):
            raise TypeError(f"input {value.name!r} is not a tensor; random_feeds makes tensors")
        tensor_type = value.type.tensor_type
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
        if not tensor_type.HasField("shape"):
            raise ValueError(f"input {value.name!r} has no shape; pass it yourself")
        shape = tuple(_dim_value(d, dims, default_dim) for d in tensor_type.shape.dim)
        if dtype in _FLOAT_DTYPES:
            feeds[value.name] = (rng.standard_normal(shape) * scale).astype(dtype)
        elif dtype.kind in "iu":
            feeds[value.name] = rng.integers(0, 4, shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[value.name] = rng.random(shape) < 0.5
        else:
            raise TypeError(f"input {value.name!r} has dtype {dtype}; pass it yourself")
    return feeds
