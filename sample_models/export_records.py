"""Checks and records of an export: ORT sessions, errors, node listings, spellings, versions.

Shared by :mod:`export_transformers` and :mod:`export_causal_lm`.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
import torch
import transformers

# -- checks and records --------------------------------------------------------------------------


def ort_session(path: Path | bytes) -> ort.InferenceSession:
    """ORT CPU, graph optimisations off, on a model file (or its serialized bytes)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    source = path if isinstance(path, bytes) else str(path)
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected|."""
    return float(np.abs(actual.astype(np.float64) - expected).max() / np.abs(expected).max())


def _attr_text(attr: onnx.AttributeProto) -> str:
    if attr.type in (onnx.AttributeProto.TENSOR, onnx.AttributeProto.GRAPH):
        return f"{attr.name}=<{onnx.AttributeProto.AttributeType.Name(attr.type).lower()}>"
    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, float):
        value = round(value, 6)
    return f"{attr.name}={value}"


def node_listing(model: onnx.ModelProto) -> list[str]:
    """The graph as text, one line a node: ``out = Op(in, ...) attrs``.

    Initializers show as ``name[shape]``; small constants (initializers or Constant nodes) by value.
    """
    shapes = {init.name: list(init.dims) for init in model.graph.initializer}
    small: dict[str, list[Any]] = {}
    for init in model.graph.initializer:
        if (
            init.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.FLOAT)
            and math.prod(init.dims) <= 4
        ):
            small[init.name] = onnx.numpy_helper.to_array(init).ravel().tolist()
    for node in model.graph.node:
        if (
            node.op_type == "Constant"
            and node.attribute
            and node.attribute[0].type == onnx.AttributeProto.TENSOR
        ):
            arr = onnx.numpy_helper.to_array(node.attribute[0].t)
            if arr.size <= 4:
                small[node.output[0]] = arr.ravel().tolist()

    def arg(name: str) -> str:
        if name in small:
            vals = small[name]
            vals = [round(v, 6) if isinstance(v, float) else v for v in vals]
            return f"{name}={vals}"
        if name in shapes:
            return f"{name}{shapes[name]}"
        return name

    lines = []
    for node in model.graph.node:
        if node.op_type == "Constant":
            continue
        attrs = " ".join(_attr_text(a) for a in node.attribute)
        domain = f"{node.domain}." if node.domain not in ("", "ai.onnx") else ""
        ins = ", ".join(arg(i) for i in node.input)
        outs = ", ".join(node.output)
        lines.append(f"{outs} = {domain}{node.op_type}({ins}) {attrs}".rstrip())
    return lines


def io_record(values: Any) -> list[dict[str, Any]]:
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_param if d.HasField("dim_param") else d.dim_value for d in t.shape.dim]
        out.append(
            {"name": v.name, "dtype": onnx.TensorProto.DataType.Name(t.elem_type), "shape": dims}
        )
    return out


def spellings(model: onnx.ModelProto) -> dict[str, Any]:
    """The op spellings of the MoE parts, read off the graph (what a rule must match)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name: i for i in model.graph.initializer}
    consts = {
        n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t)
        for n in model.graph.node
        if n.op_type == "Constant"
        and n.attribute
        and n.attribute[0].type == onnx.AttributeProto.TENSOR
    }

    def const(name: str) -> Any:
        if name in inits:
            return onnx.numpy_helper.to_array(inits[name]).tolist()
        if name in consts:
            return consts[name].tolist()
        return None

    def chain(name: str, depth: int = 3) -> str:
        node = producers.get(name)
        if node is None or depth == 0:
            return "initializer" if name in inits else ("input" if name else "")
        return f"{node.op_type}({chain(node.input[0], depth - 1)})" if node.input else node.op_type

    rec: dict[str, Any] = {}
    rec["router"] = sorted(
        {
            f"{producers[n.input[0]].op_type} -> {n.op_type}"
            for n in model.graph.node
            if n.op_type in ("Softmax", "TopK") and n.input[0] in producers
        }
    )
    rec["stacked_weight_consumers"] = sorted(
        {
            f"{n.op_type}({i}{list(inits[i].dims)})"
            for n in model.graph.node
            for i in n.input
            if i in inits
            and inits[i].data_type == onnx.TensorProto.FLOAT
            and len(inits[i].dims) == 3
        }
    )
    rec["gemms"] = [
        f"Gemm({', '.join(n.input)}) " + " ".join(_attr_text(a) for a in n.attribute)
        for n in model.graph.node
        if n.op_type == "Gemm"
    ]
    rec["matmuls"] = [
        f"MatMul({chain(n.input[0], 1)}, {chain(n.input[1], 1)})"
        for n in model.graph.node
        if n.op_type == "MatMul"
    ]
    rec["splits"] = [
        "Split(" + chain(n.input[0], 1) + ") " + " ".join(_attr_text(a) for a in n.attribute)
        for n in model.graph.node
        if n.op_type == "Split"
    ]
    rec["slices"] = [
        {
            "starts": const(n.input[1]),
            "ends": const(n.input[2]),
            "axes": const(n.input[3]) if len(n.input) > 3 else None,
            "steps": const(n.input[4]) if len(n.input) > 4 else None,
        }
        for n in model.graph.node
        if n.op_type == "Slice"
    ]
    rec["clips"] = [
        {
            "min": const(n.input[1]) if len(n.input) > 1 and n.input[1] else None,
            "max": const(n.input[2]) if len(n.input) > 2 and n.input[2] else None,
        }
        for n in model.graph.node
        if n.op_type == "Clip"
    ]
    rec["repeat_tokens"] = [
        chain(n.output[0], 3) for n in model.graph.node if n.op_type in ("Expand", "Tile")
    ]
    return rec


def versions() -> dict[str, str]:
    import onnxscript

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
    }


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
