"""A tiny ``onnx.helper`` graph writer and the outcome records of the hand-written MoE layers.

The hand-written layers (:mod:`onnx_moe_fuse.samples.handwritten`) are deliberately written
without the project's own sample builder (``_layers.py`` / ``_text.py``), the way an engineer who
never saw this project would: plain ``onnx.helper`` nodes with names of their own choosing.
:class:`Graph` only saves typing; every node is still spelled out by the layer function.

Each layer function returns a :class:`HandwrittenLayer` ``(model, description, expected)``;
``expected`` is :class:`Fused` (the op and the key attributes a correct fuser must emit) or
:class:`Refused` (the part a near miss must name and a keyword of its reason).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = [
    "Fused",
    "Refused",
    "HandwrittenLayer",
    "Graph",
    "normal",
    "quantize_blocked",
]

#: IR 10 is the first with int4/uint4 tensors; ORT 1.32 loads 10 and newer.
IR_VERSION = 10


@dataclass(frozen=True)
class Fused:
    """A correct fuser emits one ``op`` node (com.microsoft) with these attribute values."""

    op: str
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Refused:
    """A correct fuser leaves the layer alone; a near miss names ``part`` and says ``reason``."""

    part: str
    reason: str


class HandwrittenLayer(NamedTuple):
    """One hand-written layer: the model, what it is in words, what a correct fuser does."""

    model: onnx.ModelProto
    description: str
    expected: Fused | Refused


def normal(rng: np.random.Generator, shape: Sequence[int], fan_in: int) -> np.ndarray:
    """Float32 ``N(0, 1/fan_in)`` values: weights of a layer whose outputs stay near unit size."""
    return (rng.standard_normal(tuple(shape)) / np.sqrt(fan_in)).astype(np.float32)


def quantize_blocked(
    w: np.ndarray, axis: int, block: int, kind: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize ``w`` symmetrically in blocks of ``block`` along ``axis``; ``(q, scale, zp)``.

    ``kind`` is ``int4`` (codes in [-7, 7], zero point 0), ``uint4`` (codes in [1, 15], zero
    point 8) or ``uint8`` (codes in [1, 255], zero point 128). ``scale`` and ``zp`` have ``w``'s
    shape with ``axis`` divided by ``block`` (DequantizeLinear's blocked form).
    """
    axis = axis % w.ndim
    n = w.shape[axis]
    if n % block:
        raise ValueError(f"axis {axis} of size {n} is not a multiple of the block {block}")
    moved = np.moveaxis(w, axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], n // block, block)
    qmax, zero, dtype = {
        "int4": (7, 0, ml_dtypes.int4),
        "uint4": (7, 8, ml_dtypes.uint4),
        "uint8": (127, 128, np.uint8),
    }[kind]
    scale = (np.abs(blocks).max(axis=-1) / qmax).astype(np.float32)
    codes = np.clip(np.rint(blocks / scale[..., None]), -qmax, qmax) + zero
    codes = codes.reshape(moved.shape)
    q = np.moveaxis(codes, -1, axis).astype(np.int16).astype(dtype)
    scale = np.moveaxis(scale, -1, axis)
    zp = np.full(scale.shape, zero, dtype=np.int16).astype(dtype)
    return q, scale, zp


class Graph:
    """Accumulates nodes, initializers and the signature of one graph."""

    def __init__(self, name: str) -> None:
        """Start an empty graph called ``name``."""
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []

    def input(self, name: str, shape: Sequence[int | str], elem: int = onnx.TensorProto.FLOAT):
        """Declare a graph input; ``shape`` mixes ints (static) and strings (dim_param)."""
        self.inputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
        return name

    def output(self, name: str, shape: Sequence[int | str], elem: int = onnx.TensorProto.FLOAT):
        """Declare a graph output (a value some node makes)."""
        self.outputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
        return name

    def init(self, name: str, array: np.ndarray | Sequence[int] | int) -> str:
        """An initializer ``name`` (int lists become int64 tensors)."""
        self.initializers.append(numpy_helper.from_array(_array(array), name))
        return name

    def const(self, name: str, array: np.ndarray | Sequence[int] | int) -> str:
        """A ``Constant`` node making ``name`` (int lists become int64 tensors)."""
        tensor = numpy_helper.from_array(_array(array), name)
        self.nodes.append(
            helper.make_node("Constant", [], [name], name=f"{name}_const", value=tensor)
        )
        return name

    def op(self, op_type: str, inputs: Sequence[str], output: str, **attrs: Any) -> str:
        """One node of ``op_type`` with one output ``output``; returns it."""
        return self.op_multi(op_type, inputs, [output], **attrs)[0]

    def op_multi(
        self, op_type: str, inputs: Sequence[str], outputs: Sequence[str], **attrs: Any
    ) -> list[str]:
        """One node with several outputs (TopK, Split); ``domain=`` picks a domain."""
        domain = attrs.pop("domain", "")
        self.nodes.append(
            helper.make_node(
                op_type,
                list(inputs),
                list(outputs),
                name=f"{outputs[0]}_{op_type}",
                domain=domain,
                **attrs,
            )
        )
        return list(outputs)

    def model(self, opset: int) -> onnx.ModelProto:
        """The checked model, default-domain ``opset``, IR version 10.

        An opset newer than the installed onnx knows (29, GroupedMatMul: onnx-weekly only) is
        not checked here, since this onnx's checker rejects it; its tests run it in onnx-weekly.
        """
        graph = helper.make_graph(
            self.nodes, self.name, self.inputs, self.outputs, initializer=self.initializers
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", opset)],
            ir_version=IR_VERSION,
            producer_name="handwritten",
        )
        if opset <= onnx.defs.onnx_opset_version():
            onnx.checker.check_model(model, full_check=True)
        return model


def _array(value: np.ndarray | Sequence[int] | int) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    return np.asarray(value, dtype=np.int64)
