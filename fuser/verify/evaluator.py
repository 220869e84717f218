"""The wgpu evaluator: run a model with its fused nodes on the project's WebGPU kernels.

:func:`run_wgpu` evaluates a model with ``onnx.reference.ReferenceEvaluator``; standard ops run
there, and these ops run on the kernel packages of :mod:`onnx_moe_fuse.kernels`, called only
through :func:`onnx_moe_fuse.kernels.runtime.get_kernel`:

* ``GroupedMatMul`` (opset 29), package ``kernels/grouped_matmul``: input, weights,
  group_indices, bias -> ``inputT, weightsT, groupIndicesT, biasT``; output ``outputT``.
* ``com.microsoft.QMoE``, package ``kernels/qmoe``: 0 input, 1 router_probs, 2 fc1 weights,
  3 fc1 scales, 4 fc1 bias, 5 fc2 weights, 6 fc2 scales, 7 fc2 bias -> ``inputT, routerT, fc1T,
  fc1ScalesT, fc1BiasT, fc2T, fc2ScalesT, fc2BiasT``; output ``outputT``.
* ``com.microsoft.MoE``, package ``kernels/moe``: 0 input, 1 router_probs, 2 fc1 weights, 3 fc1
  bias, 4 fc2 weights, 5 fc2 bias, 6 fc3 weights, 7 fc3 bias -> ``inputT, routerT, fc1T,
  fc1BiasT, fc2T, fc2BiasT, fc3T, fc3BiasT``; output ``outputT``.
* ``com.microsoft.MatMulNBitsQkv``, package ``kernels/matmul_nbits_qkv``: A, skip, norm_scale,
  q_B, q_scales, (q_bias), k_B, k_scales, (k_bias), v_B, v_scales, (v_bias) -> ``aT, skipT,
  normScaleT, qBT, qScalesT, kBT, kScalesT, vBT, vScalesT``; outputs Q, K, V,
  input_skip_bias_sum -> ``qT, kT, vT, residualT`` (the last requested only when the node
  names output 3).

The tables of these mappings are :mod:`onnx_moe_fuse.verify.kernel_specs` (re-exported here),
built from the contract's input order (:mod:`onnx_moe_fuse.contract.ops`) and the kernels' bind
keys (:data:`onnx_moe_fuse.verify.oracles.kernel_calls.BIND_KEYS`).

Inputs are taken at ONNX Runtime's positions (an omitted optional input is ``""``). A present
input is bound only when the kernel's manifest declares its bind key (QMoE's positions 8-14 map
to ``fc3T, fc3ScalesT, fc3BiasT, fc1ZeroPointsT, fc2ZeroPointsT, fc3ZeroPointsT,
routerWeightsT``; MatMulNBitsQkv's ``q_bias``/``k_bias``/``v_bias`` to ``qBiasT, kBiasT,
vBiasT``); otherwise it is refused with :class:`UnsupportedNodeError` naming the node and the
input, except zero points holding the symmetric point everywhere, which mean nothing and are
dropped. Positions past the mapped ones (QMoE's FP4/FP8 extras, 15+) are always refused.
Attributes are passed under their ONNX names; an attribute the kernel's manifest does not
declare is dropped only when its value cannot change the result (``use_sparse_mixer=0``,
``quant_type="int"``, QMoE's ``accuracy_level``, which only lets ONNX Runtime quantise
activations, ...) and refused otherwise. ``swiglu_limit=inf`` and QMoE ``block_size=0`` mean
"absent" in ONNX Runtime and are passed as absent. A call the kernel itself refuses (``KernelCallError``: dtype, shape, attribute
value) is re-raised as :class:`KernelNodeError` naming the node, with each bind key in the
message followed by the ONNX input it came from.

A kernel package that is not installed yet raises :class:`KernelPackageMissingError` naming the
op and the package folder; :func:`missing_kernel_packages` finds them all before a run.

Every other com.microsoft op a model may hold outside its fused nodes runs in the reference
path's numpy code (:data:`REFERENCE_OP_CLASSES`, from :mod:`onnx_moe_fuse.verify.reference`):
``MatMulNBits`` (what ORT's ``MatMulNBitsQuantizer`` writes, and the projections a fused-for-CPU
attention prelude keeps), ``SimplifiedLayerNormalization`` and
``SkipSimplifiedLayerNormalization``. Plain ``onnx.reference`` does not know them, and the
unfused parts of a model must compute the same on every path of the checker; for the same
reason the standard ``GatherElements`` runs in the reference path's own code, which reads a
negative ``axis`` as the spec does (onnx 1.23's does not).
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from onnx_moe_fuse.contract.ops import MS_DOMAIN
from onnx_moe_fuse.kernels import KernelCallError, get_kernel
from onnx_moe_fuse.verify.kernel_specs import (
    GROUPED_MATMUL,
    KERNEL_OPS,
    MATMUL_NBITS_QKV,
    MOE,
    QMOE,
    Attrs,
    KernelNodeError,
    KernelOpSpec,
    KernelPackageMissingError,
    UnsupportedNodeError,
    WgpuEvaluatorError,
    text_value,
)
from onnx_moe_fuse.verify.nodes import describe_node, iter_nodes
from onnx_moe_fuse.verify.reference import CUSTOM_OPS as REFERENCE_OPS
from onnx_moe_fuse.verify.reference_moe import run_qmoe

__all__ = [
    "GROUPED_MATMUL",
    "KERNEL_OPS",
    "MATMUL_NBITS_QKV",
    "MOE",
    "QMOE",
    "KernelNodeError",
    "KernelOpSpec",
    "KernelPackageMissingError",
    "REFERENCE_OP_CLASSES",
    "UnsupportedNodeError",
    "WgpuEvaluatorError",
    "bind_node",
    "describe_node",
    "iter_nodes",
    "kernel_nodes",
    "missing_kernel_packages",
    "reference_only_nodes",
    "run_node",
    "run_wgpu",
    "wgpu_evaluator",
]


# -- one node -----------------------------------------------------------------------------------


def _slot_text(spec: KernelOpSpec, position: int, node: onnx.NodeProto) -> str:
    onnx_name = spec.inputs[position].onnx_name if position < len(spec.inputs) else "?"
    tensor = node.input[position] if position < len(node.input) else ""
    return f"input {position} {onnx_name} (tensor {tensor!r})"


def bind_node(
    spec: KernelOpSpec,
    node: onnx.NodeProto,
    inputs: Sequence[Any],
    attrs: Attrs,
    declared_inputs: Collection[str],
) -> tuple[dict[str, np.ndarray], dict[str, Any], list[str]]:
    """Map a node's input values and attributes to the kernel's bind keys.

    ``declared_inputs`` are the input bind keys of the kernel's manifest: an input whose bind
    key it lacks is refused with :class:`UnsupportedNodeError` (or dropped, where the value
    cannot matter, e.g. symmetric zero points). Returns ``(tensors, attributes, optional
    outputs to request)``; attributes the manifest does not declare are filtered later.
    """
    where = describe_node(node)
    tensors: dict[str, np.ndarray] = {}
    for position, value in enumerate(inputs):
        if value is None:
            continue
        if position >= len(spec.inputs):
            raise UnsupportedNodeError(
                f"{where}: input {position} (tensor {node.input[position]!r}) is beyond the "
                f"{len(spec.inputs)} inputs the wgpu evaluator maps for {spec.qualified_name}; "
                "the kernel does not implement it"
            )
        slot = spec.inputs[position]
        array = np.asarray(value)
        if slot.bind_key in declared_inputs:
            tensors[slot.bind_key] = array
            continue
        reason = slot.what or f"input {slot.onnx_name}"
        if slot.droppable is not None:
            verdict = slot.droppable(array, attrs)
            if verdict is None:
                continue
            reason = verdict
        raise UnsupportedNodeError(
            f"{where}: {_slot_text(spec, position, node)} is given, but the "
            f"{spec.qualified_name} kernel does not implement {reason}"
        )
    wanted = [
        spec.outputs[i]
        for i, name in enumerate(node.output)
        if name and i < len(spec.outputs) and spec.outputs[i] in spec.optional_outputs
    ]
    if len(node.output) > len(spec.outputs):
        raise UnsupportedNodeError(
            f"{where}: has {len(node.output)} outputs; the {spec.qualified_name} kernel "
            f"produces {len(spec.outputs)}"
        )
    kept = {
        name: text_value(value)
        for name, value in attrs.items()
        if not (name in spec.absent_attributes and spec.absent_attributes[name](value, attrs))
    }
    return tensors, kept, wanted


def _kernel_attributes(
    spec: KernelOpSpec, node: onnx.NodeProto, attrs: Attrs, declared: Sequence[str]
) -> dict[str, Any]:
    """Keep the attributes the manifest declares; drop neutral ones; refuse the rest."""
    kept: dict[str, Any] = {}
    for name, value in attrs.items():
        if name in declared:
            kept[name] = value
            continue
        check = spec.neutral_attributes.get(name)
        if check is not None and check(value, attrs):
            continue
        raise UnsupportedNodeError(
            f"{describe_node(node)}: attribute {name}={value!r} is not implemented by the "
            f"{spec.qualified_name} kernel (its manifest declares: {', '.join(declared) or 'none'})"
        )
    return kept


def _explain_bind_keys(message: str, spec: KernelOpSpec, node: onnx.NodeProto) -> str:
    """Follow each input bind key in a kernel message with the ONNX input it came from."""
    names = {slot.bind_key: _slot_text(spec, i, node) for i, slot in enumerate(spec.inputs)}
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    return pattern.sub(lambda m: f"{m.group(1)} [{names[m.group(1)]}]", message)


def load_kernel(spec: KernelOpSpec) -> Any:
    """The kernel for ``spec`` from get_kernel; :class:`KernelPackageMissingError` if absent."""
    try:
        return get_kernel(spec.qualified_name)
    except KeyError as exc:
        detail = exc.args[0] if exc.args else str(exc)
        raise KernelPackageMissingError(spec.qualified_name, spec.package, str(detail)) from None


def run_node(
    spec: KernelOpSpec, node: onnx.NodeProto, inputs: Sequence[Any], attrs: Attrs
) -> tuple[np.ndarray | None, ...]:
    """Run one node on its kernel; return its outputs in the node's output order."""
    kernel = load_kernel(spec)
    declared_inputs = [t.bind_key for t in kernel.manifest.tensors.values() if t.io == "input"]
    tensors, present_attrs, wanted = bind_node(spec, node, inputs, attrs, declared_inputs)
    declared = list(kernel.manifest.attributes)
    kernel_attrs = _kernel_attributes(spec, node, present_attrs, declared)
    tensors, narrowed = widen_half_inputs(kernel.manifest, tensors, kernel.device.has_f16)
    try:
        result = kernel(attrs=kernel_attrs, optional_outputs=wanted, **tensors)
    except KernelCallError as exc:
        raise KernelNodeError(
            f"{describe_node(node)}: the {spec.qualified_name} kernel refused the call: "
            f"{_explain_bind_keys(str(exc), spec, node)}"
        ) from exc
    except ValueError as exc:  # e.g. an index the kernel flagged
        raise KernelNodeError(
            f"{describe_node(node)}: {_explain_bind_keys(str(exc), spec, node)}"
        ) from exc
    outputs = []
    for i, name in enumerate(node.output):
        value = result[spec.outputs[i]] if name else None
        dtype = narrowed.get(_type_var(kernel.manifest, spec.outputs[i]))
        outputs.append(value.astype(dtype) if value is not None and dtype is not None else value)
    return tuple(outputs)


_HALF_DTYPES = ("float16", "bfloat16")


def _type_var(manifest: Any, bind_key: str) -> str | None:
    spec = manifest.tensors.get(bind_key)
    return spec.dtype if spec is not None else None


def widen_half_inputs(
    manifest: Any, tensors: Mapping[str, np.ndarray], has_f16: bool = True
) -> tuple[dict[str, np.ndarray], dict[str, np.dtype]]:
    """Half-precision tensors of a type the kernel cannot take here, widened to float32.

    The MoE and QMoE kernel packages take float16 (their manifests' ``T``: float16 I/O,
    float32 accumulation) where the adapter has shader-f16 (``has_f16``), and bfloat16
    nowhere. A float16 tensor on an adapter without shader-f16, or a bfloat16 one, still runs:
    its inputs widen exactly, the kernel computes in float32, and its outputs of the same type
    variable are rounded back to the node's type (``narrowed``: ``{type variable: numpy
    dtype}``), once, where ONNX Runtime's half-precision kernels round intermediates too; the
    checker's per-dtype tolerance covers the difference. A type the kernel takes as it is stays
    untouched (a float16 layer on a shader-f16 adapter runs on the float16 kernels).
    """
    out = dict(tensors)
    narrowed: dict[str, np.dtype] = {}
    for key, array in tensors.items():
        var = _type_var(manifest, key)
        allowed = manifest.type_constraints.get(var) if var is not None else None
        name = array.dtype.name
        if allowed is None or name not in _HALF_DTYPES:
            continue
        if name in allowed and (name != "float16" or has_f16):
            continue
        if "float32" not in allowed:
            continue
        out[key] = array.astype(np.float32)
        narrowed[var] = array.dtype
    return out, narrowed


class _KernelOp(OpRun):
    """An OpRun that sends its node to the kernel package of ``spec``."""

    spec: ClassVar[KernelOpSpec]

    def _run(self, *inputs: Any, **attrs: Any) -> tuple[Any, ...]:  # type: ignore[override]
        return run_node(self.spec, self.onnx_node, inputs, attrs)


class GroupedMatMul(_KernelOp):
    """ONNX ``GroupedMatMul`` (opset 29) on the ``kernels/grouped_matmul`` package."""

    op_domain = ""
    spec = GROUPED_MATMUL


class QMoE(_KernelOp):
    """``com.microsoft.QMoE`` on the ``kernels/qmoe`` package.

    A node with asymmetric zero points (which the kernel does not implement) runs on the
    reference path's oracle instead (:func:`~onnx_moe_fuse.verify.reference_moe.run_qmoe`);
    :func:`reference_only_nodes` names such nodes for the checker's report.
    """

    op_domain = MS_DOMAIN
    spec = QMOE

    def _run(self, *inputs: Any, **attrs: Any) -> tuple[Any, ...]:  # type: ignore[override]
        if _asymmetric_zero_points(inputs, attrs):
            return run_qmoe(inputs, attrs)
        return run_node(self.spec, self.onnx_node, inputs, attrs)


_ZERO_POINT_SLOTS = tuple(
    i for i, slot in enumerate(QMOE.inputs) if slot.onnx_name.endswith("_zero_points")
)


def _asymmetric_zero_points(inputs: Sequence[Any], attrs: Attrs) -> list[str]:
    """The QMoE zero-point inputs among ``inputs`` that the kernel cannot drop (asymmetric)."""
    bad = []
    for i in _ZERO_POINT_SLOTS:
        value = inputs[i] if i < len(inputs) else None
        check = QMOE.inputs[i].droppable
        if value is not None and check is not None and check(np.asarray(value), attrs):
            bad.append(QMOE.inputs[i].onnx_name)
    return bad


class MoE(_KernelOp):
    """``com.microsoft.MoE`` on the ``kernels/moe`` package."""

    op_domain = MS_DOMAIN
    spec = MOE


class MatMulNBitsQkv(_KernelOp):
    """``com.microsoft.MatMulNBitsQkv`` on the ``kernels/matmul_nbits_qkv`` package."""

    op_domain = MS_DOMAIN
    spec = MATMUL_NBITS_QKV


KERNEL_OP_CLASSES: tuple[type[OpRun], ...] = (GroupedMatMul, QMoE, MoE, MatMulNBitsQkv)
#: The reference path's OpRun classes for the ops no kernel package runs (see the module
#: docstring); the wgpu evaluator installs them next to :data:`KERNEL_OP_CLASSES`.
REFERENCE_OP_CLASSES: tuple[type[OpRun], ...] = tuple(
    cls for cls in REFERENCE_OPS if (cls.op_domain, cls.__name__) not in KERNEL_OPS
)


# -- models -------------------------------------------------------------------------------------


def kernel_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes that the wgpu evaluator runs on kernels."""
    return [n for n in iter_nodes(model) if (n.domain, n.op_type) in KERNEL_OPS]


def reference_only_nodes(model: onnx.ModelProto) -> dict[str, str]:
    """``{node: why}`` for the QMoE nodes the evaluator runs on the oracle, not the kernel.

    Those with asymmetric zero-point initializers (the kernel implements symmetric weights
    only): on the wgpu path such a node is checked on the reference path's numpy oracle alone.
    """
    consts = {t.name: t for t in model.graph.initializer}
    out: dict[str, str] = {}
    for node in kernel_nodes(model):
        if (node.domain, node.op_type) != (QMOE.domain, QMOE.op_type):
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        values = [
            onnx.numpy_helper.to_array(consts[name]) if name in consts else None
            for name in node.input
        ]
        bad = _asymmetric_zero_points(values, attrs)
        if bad:
            out[describe_node(node)] = (
                f"{', '.join(bad)} asymmetric: the WebGPU QMoE kernel implements symmetric "
                "weights only, so this node ran on the reference path's numpy oracle "
                "(fuser/verify/oracles/moe.qmoe), not on the kernel"
            )
    return out


def missing_kernel_packages(model: onnx.ModelProto) -> dict[str, str]:
    """``{op: message}`` for every kernel op in ``model`` whose package is not installed."""
    missing: dict[str, str] = {}
    for node in kernel_nodes(model):
        spec = KERNEL_OPS[(node.domain, node.op_type)]
        if spec.qualified_name in missing:
            continue
        try:
            load_kernel(spec)
        except KernelPackageMissingError as exc:
            missing[spec.qualified_name] = str(exc)
    return missing


def wgpu_evaluator(
    model: onnx.ModelProto | str | os.PathLike[str], *, check_shapes: bool = False
) -> ReferenceEvaluator:
    """A ReferenceEvaluator whose GroupedMatMul, QMoE, MoE and MatMulNBitsQkv run on wgpu.

    The other com.microsoft ops run in the reference path's numpy code
    (:data:`REFERENCE_OP_CLASSES`). ``check_shapes`` checks every computed value against its
    declared type and shape.
    """
    if not isinstance(model, onnx.ModelProto):
        model = os.fspath(model)
    return ReferenceEvaluator(
        model,
        new_ops=[*KERNEL_OP_CLASSES, *REFERENCE_OP_CLASSES],
        check_shape_annotations=check_shapes,
    )


def run_wgpu(
    model: onnx.ModelProto | str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray],
    *,
    outputs: Sequence[str] | None = None,
    check_shapes: bool = False,
) -> dict[str, np.ndarray]:
    """Run ``model`` on ``feeds`` with its fused nodes on the WebGPU kernels.

    Returns ``{output name: array}`` for ``outputs`` (default: every graph output). Raises
    :class:`KernelPackageMissingError`, :class:`UnsupportedNodeError` or
    :class:`KernelNodeError` (all :class:`WgpuEvaluatorError`) naming the node at fault.
    """
    ev = wgpu_evaluator(model, check_shapes=check_shapes)
    names = list(outputs) if outputs is not None else list(ev.output_names)
    results = ev.run(names, dict(feeds))
    return dict(zip(names, results, strict=True))
