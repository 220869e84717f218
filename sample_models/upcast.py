"""A bfloat16 (or float16) ONNX model rewritten to compute in float32, for runtimes without it.

ORT 1.32 CPU runs few bfloat16 ops (no ``Mul``, no ``MatMul``, no ``MoE``: measured,
"NOT_IMPLEMENTED: Could not find an implementation"), so a bfloat16 export, and a fused model
made from it, are checked here on their float32 twin: every tensor of the source type
(initializers, ``Constant`` / ``ConstantOfShape`` values, graph inputs, outputs and value infos)
becomes float32 with the same values (widening is exact), and every ``Cast``/``to``-style
attribute naming the source type names float32 instead. The twin computes the same formulas
without the half-precision roundings, so it is the model's value up to its dtype's rounding:
what a comparison against it measures is the rounding the original would add.

:func:`retype_floats` does the same between any two float types (the tests make float16 and
bfloat16 twins of float32 layers with it; narrowing rounds each constant once).

Nothing here needs torch (the export script and the tests, which do not have it, both use it):
onnx, numpy and ml_dtypes only.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, numpy_helper

__all__ = ["retype_floats", "upcast_to_float32"]

#: Integer attributes that name an element type.
_TYPE_ATTRIBUTES = frozenset({"to", "dtype", "output_dtype"})


def _tensor(t: TensorProto, source: int, target: int) -> TensorProto:
    if t.data_type != source:
        return t
    dtype = onnx.helper.tensor_dtype_to_np_dtype(target)
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(dtype), t.name)


def _value_info(v: onnx.ValueInfoProto, source: int, target: int) -> None:
    t = v.type
    if t.HasField("tensor_type") and t.tensor_type.elem_type == source:
        t.tensor_type.elem_type = target


def _graph(g: onnx.GraphProto, source: int, target: int) -> None:
    inits = [_tensor(t, source, target) for t in g.initializer]
    del g.initializer[:]
    g.initializer.extend(inits)
    for v in (*g.input, *g.output, *g.value_info):
        _value_info(v, source, target)
    _nodes(g.node, source, target)


def _nodes(nodes, source: int, target: int) -> None:
    for node in nodes:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                attr.t.CopyFrom(_tensor(attr.t, source, target))
            elif attr.type == onnx.AttributeProto.INT and attr.name in _TYPE_ATTRIBUTES:
                if attr.i == source:
                    attr.i = target
            elif attr.type == onnx.AttributeProto.GRAPH:
                _graph(attr.g, source, target)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    _graph(sub, source, target)


def retype_floats(model: onnx.ModelProto, source: int, target: int) -> onnx.ModelProto:
    """A copy of ``model`` whose ``source``-typed tensors, values and casts are ``target``.

    Widening (bfloat16 -> float32) keeps every value; narrowing (float32 -> float16, how the
    tests make a half-precision twin of a float32 layer) rounds each constant once.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _graph(out.graph, source, target)
    for f in out.functions:
        _nodes(f.node, source, target)
        for v in f.value_info:
            _value_info(v, source, target)
    return out


def upcast_to_float32(
    model: onnx.ModelProto, source: int = TensorProto.BFLOAT16
) -> onnx.ModelProto:
    """A copy of ``model`` whose ``source``-typed tensors and casts are float32 (see above)."""
    return retype_floats(model, source, TensorProto.FLOAT)
