"""A model of N stacked MoE layers (int4 or float32), for memory measurements of whole models.

``x_{i+1} = x_i + layer_i(x_i)``: each layer is the sample generator's Gather/Expand/MatMul
decomposition behind blocked ``DequantizeLinear`` (int4, block 32, SwiGLU, softmax top-k
renormalised; or float32 weights, ``weights="f32"``), with its own weights (seeded by ``seed_key`` and the layer index), its names
prefixed ``l<i>/``. ``benchmarks/bench_memory.py`` and ``tests/io/test_streaming.py`` build their
models here: the fuser's peak memory on 1, 2, 4, ... layers shows whether it grows with the model.
"""

from __future__ import annotations

import onnx

from onnx_moe_fuse.samples.layers import LayerSpec, Weights, build_layer

__all__ = ["stacked_moe_model"]


def _layer_spec(
    i: int, hidden: int, inter: int, experts: int, seed_key: str, weights: Weights
) -> LayerSpec:
    return LayerSpec(
        name=f"layer{i}",
        hidden=hidden,
        inter=inter,
        experts=experts,
        top_k=8 if experts >= 8 else 2,
        routing="softmax_topk_renorm",
        activation="swiglu",
        spelling="dec",
        weights=weights,
        seed_key=f"{seed_key}_{i}",
    )


def stacked_moe_model(
    layers: int,
    hidden: int,
    inter: int,
    experts: int,
    seed_key: str = "bench_memory",
    weights: Weights = "int4b32",
) -> onnx.ModelProto:
    """``layers`` MoE layers in sequence, each added to its input (a residual Add)."""
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    nodes, inits, value_info = [], [], []
    first = None
    current = "x"
    for i in range(layers):
        layer = build_layer(_layer_spec(i, hidden, inter, experts, seed_key, weights))
        first = first or layer
        g = layer.graph
        prefix = f"l{i}/"
        entry = g.input[0].name

        def rename(name: str, prefix: str = prefix, source: str = current, entry=entry) -> str:
            if not name:
                return name
            return source if name == entry else prefix + name

        for j, node in enumerate(g.node):  # unnamed nodes get unique names: ORT insists
            node.input[:] = [rename(n) for n in node.input]
            node.output[:] = [rename(n) for n in node.output]
            node.name = prefix + (node.name or f"{node.op_type}_{j}")
            nodes.append(node)
        for t in g.initializer:
            t.name = rename(t.name)
            inits.append(t)
        for vi in g.value_info:
            vi.name = rename(vi.name)
            value_info.append(vi)
        out = rename(g.output[0].name)
        residual = f"x{i + 1}"
        nodes.append(onnx.helper.make_node("Add", [current, out], [residual], name=f"residual{i}"))
        current = residual
    assert first is not None
    graph = onnx.helper.make_graph(
        nodes,
        "stacked_moe",
        [first.graph.input[0]],
        [onnx.helper.make_tensor_value_info(current, onnx.TensorProto.FLOAT, None)],
        initializer=inits,
        value_info=value_info,
    )
    model = onnx.helper.make_model(graph, opset_imports=list(first.opset_import))
    model.ir_version = first.ir_version
    return model
