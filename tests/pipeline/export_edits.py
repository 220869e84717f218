"""Edits of exported MoE blocks for the fusion tests: weights, nodes, shapes, int4 variants.

Used by ``test_exported_models_fuse.py`` (spelling variants of the committed exports),
``test_causal_lm_fuse.py`` and ``scripts/router_family_table.py`` /
``scripts/webgpu_router_check.py`` (int4 twins of whole models: :func:`quantized`).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper as nh
from onnx import helper

__all__ = [
    "initializer",
    "int4_blocked",
    "producer",
    "quantized",
    "replace_nodes",
    "set_initializer",
    "set_input",
    "stacked",
    "with_inter",
]


def producer(model: onnx.ModelProto, output: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if output in n.output)


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return nh.to_array(next(t for t in model.graph.initializer if t.name == name))


def set_initializer(model: onnx.ModelProto, name: str, array: np.ndarray | None) -> None:
    """Replace (or, with None, drop) initializer ``name``."""
    kept = [t for t in model.graph.initializer if t.name != name]
    if array is not None:
        kept.append(nh.from_array(array, name))
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def replace_nodes(model: onnx.ModelProto, new: dict[str, list[onnx.NodeProto]]) -> None:
    """Swap the node making each key of ``new`` for the given nodes (an empty list drops it)."""
    nodes = []
    for node in model.graph.node:
        key = next((o for o in node.output if o in new), None)
        nodes.extend([node] if key is None else new.pop(key))
    assert not new, f"no node makes {list(new)}"
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.value_info[:]


def set_input(model: onnx.ModelProto, output: str, index: int, array: np.ndarray) -> None:
    """Feed input ``index`` of the node making ``output`` from a new initializer ``array``."""
    node = producer(model, output)
    name = f"{output}_edited_{index}"
    node.input[index] = name
    model.graph.initializer.append(nh.from_array(array, name))


def stacked(model: onnx.ModelProto, rank: int) -> list[str]:
    """The GatherND data initializers of ``rank`` in graph order (FC1 first, then FC2)."""
    inits = {t.name: len(t.dims) for t in model.graph.initializer}
    return [
        n.input[0]
        for n in model.graph.node
        if n.op_type == "GatherND" and inits.get(n.input[0]) == rank
    ]


def with_inter(model: onnx.ModelProto, inter: int) -> onnx.ModelProto:
    """The layer with only the first ``inter`` SwiGLU channels of each expert (same spelling).

    Concatenated-halves exports (Split, weights [E, out, in]) keep rows ``[0, inter)`` and
    ``[I, I + inter)`` of gate_up; interleaved ones (gpt-oss, [E, in, out]) the first
    ``2 * inter`` columns. Stale value_info is dropped (the rules then work from constants).
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    (w1, w2) = stacked(m, 3)
    a1, a2 = initializer(m, w1), initializer(m, w2)
    if any(n.op_type == "Split" for n in m.graph.node):  # [E, 2I, H], [E, H, I]
        half = a1.shape[1] // 2
        a1 = np.concatenate([a1[:, :inter], a1[:, half : half + inter]], axis=1)
        a2 = a2[:, :, :inter]
    else:  # [E, H, 2I] interleaved, [E, I, H]; bias [E, 2I]
        a1, a2 = a1[:, :, : 2 * inter], a2[:, :inter, :]
        (b1, _) = stacked(m, 2)
        set_initializer(m, b1, np.ascontiguousarray(initializer(m, b1)[:, : 2 * inter]))
    set_initializer(m, w1, np.ascontiguousarray(a1))
    set_initializer(m, w2, np.ascontiguousarray(a2))
    del m.graph.value_info[:]
    return m


def int4_blocked(w: np.ndarray, axis: int, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 codes (in [-8, 7]) and float scales, blocked along ``axis``."""
    moved = np.moveaxis(w, axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], -1, block)
    scale = (np.abs(blocks).max(-1) / 7).astype(np.float32)
    q = np.clip(np.rint(blocks / scale[..., None]), -8, 7).astype(np.int8).reshape(moved.shape)
    return np.moveaxis(q, -1, axis), np.moveaxis(scale, -1, axis)


def quantized(
    model: onnx.ModelProto, along_input: bool = True, block: int = 32, keep_value_info=False
) -> onnx.ModelProto:
    """``model`` with every stacked expert weight W as DequantizeLinear of int4 codes.

    Blocks of ``block`` (32) along the input axis (axis 2 of ``[E, out, in]``, 1 of ``[E, in, out]``), or
    along the output axis when not ``along_input``; symmetric (no zero point); opset 21 for
    int4 and ``block_size``. The value_info is dropped unless ``keep_value_info`` (each DQ
    output has its weight's type and shape, so what the export declared stays true).
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    nodes = []
    for name in stacked(m, 3):
        w = initializer(m, name)
        made = {o: n for n in m.graph.node for o in n.output}  # (initializers: none)
        gathered = {
            o for n in m.graph.node if n.op_type == "GatherND" and n.input[0] == name
            for o in n.output
        }  # fmt: skip
        matmul = next(n for n in m.graph.node if n.op_type == "MatMul" and gathered & set(n.input))
        # weights on the left of the MatMul are [E, out, in], on the right [E, in, out]
        on_left = matmul.input[0] in gathered and made[matmul.input[0]].op_type == "GatherND"
        axis = 2 if on_left == along_input else 1
        q, s = int4_blocked(w, axis, block)
        set_initializer(m, name, None)
        m.graph.initializer.append(
            helper.make_tensor(f"{name}_q", onnx.TensorProto.INT4, q.shape, q.reshape(-1).tolist())
        )
        m.graph.initializer.append(nh.from_array(s, f"{name}_scale"))
        nodes.append(
            helper.make_node(
                "DequantizeLinear",
                [f"{name}_q", f"{name}_scale"],
                [name],
                name=f"dq_{name}",
                axis=axis,
                block_size=block,
            )
        )
    nodes.extend(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    for opset in m.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, 21)
    if not keep_value_info:
        del m.graph.value_info[:]
    onnx.checker.check_model(m, full_check=True)
    return m
