"""A bfloat16 (or float16) ONNX model rewritten to compute in float32, for runtimes without it.

ORT 1.32 CPU runs few bfloat16 ops (no ``Mul``, no ``MatMul``, no ``MoE``: measured,
"NOT_IMPLEMENTED: Could not find an implementation"), so a bfloat16 export, and a fused model
made from it, are checked here on their float32 twin: every tensor of the source type
(initializers, ``Constant`` / ``ConstantOfShape`` values, graph inputs, outputs and value infos)
becomes float32 with the same values (widening is exact), and every ``Cast``/``to``-style
attribute naming the source type names float32 instead. The twin computes the same formulas
without the half-precision roundings, so it is the model's value up to its dtype's rounding:
what a comparison against it measures is the rounding the original would add.

Nothing here needs torch (the export script and the tests, which do not have it, both use it):
onnx, numpy and ml_dtypes only.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

__all__ = ["upcast_to_float32"]

#: Integer attributes that name an element type.
_TYPE_ATTRIBUTES = frozenset({"to", "dtype", "output_dtype"})


def _tensor(t: TensorProto, source: int) -> TensorProto:
    if t.data_type != source:
        return t
    wide = numpy_helper.to_array(t).astype(np.float32)
    out = numpy_helper.from_array(wide, t.name)
    return out


def _value_info(v: onnx.ValueInfoProto, source: int) -> None:
    t = v.type
    if t.HasField("tensor_type") and t.tensor_type.elem_type == source:
        t.tensor_type.elem_type = TensorProto.FLOAT


def _graph(g: onnx.GraphProto, source: int) -> None:
    inits = [_tensor(t, source) for t in g.initializer]
    del g.initializer[:]
    g.initializer.extend(inits)
    for v in (*g.input, *g.output, *g.value_info):
        _value_info(v, source)
    _nodes(g.node, source)


def _nodes(nodes, source: int) -> None:
    for node in nodes:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                attr.t.CopyFrom(_tensor(attr.t, source))
            elif attr.type == onnx.AttributeProto.INT and attr.name in _TYPE_ATTRIBUTES:
                if attr.i == source:
                    attr.i = TensorProto.FLOAT
            elif attr.type == onnx.AttributeProto.GRAPH:
                _graph(attr.g, source)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    _graph(sub, source)


def upcast_to_float32(
    model: onnx.ModelProto, source: int = TensorProto.BFLOAT16
) -> onnx.ModelProto:
    """A copy of ``model`` whose ``source``-typed tensors and casts are float32 (see above)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _graph(out.graph, source)
    for f in out.functions:
        _nodes(f.node, source)
        for v in f.value_info:
            _value_info(v, source)
    return out
