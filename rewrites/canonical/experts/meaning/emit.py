"""Write the per-slot form of a layer proved by its meaning (:mod:`.contract`), then drop the old.

The form is the one every layer-form pass writes and the layer rules take::

    fc1_i = GroupedMatMul(tokens [T, H], W1_i [E, H, N] (, b1_i [E, N]), idx [T, k])
    act   = the model's activation nodes, copied onto fc1 (feature axes written -1)
    fc2   = Reshape(GroupedMatMul(Reshape(act, [-1, I]), W2, Reshape(idx, [-1, 1]) (, b2)),
                    [-1, k, O])
    out   = ReduceSum(Mul(fc2, Unsqueeze(w, [-1])), [1], keepdims=0)   (Reshape to [B, S, O])

Weights are the model's own constants: an output-major stack gets a ``Transpose`` node, a
``DequantizeLinear`` whose inputs were gathered at the ids becomes one DQ of the ungathered
constants (its axis moved to the stack's rank), a ``[E, 1, N]`` bias a ``Reshape``; the
pipeline's weight-layout pass folds those afterwards, lazily. Nothing is read here but shapes.
The new output takes over the old output's name and uses, new nodes standing for old ones take
their names, and what only fed the old layer is removed.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.contract import LayerParts, Projection
from onnx_moe_fuse.rewrites.canonical.experts.meaning.interpret import Interpretation
from onnx_moe_fuse.rewrites.canonical.experts.meaning.shared_parts import add_shared_term
from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import Act, Param, Proj
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import const_shape, value_dims
from onnx_moe_fuse.rewrites.canonical.experts.writer import GraphWriter
from onnx_moe_fuse.rewrites.graph.facts import attr_int

__all__ = ["write_per_slot"]


def _weight(writer: GraphWriter, proj: Projection, base: str) -> ir.Value:
    """FC weight ``[E, K, N]`` (K-major) as a value: the stack, or the experts' own stacked."""
    if len(proj.weights) == 1 and not proj.weights[0].single:
        value = _stack_value(writer, proj.weights[0], base)
        if not proj.k_major:  # output-major [E, N, K]
            value = writer.node("Transpose", [value], f"{base}_k_major", perm=[0, 2, 1]).outputs[0]
        return value
    parts = []
    for e, p in enumerate(proj.weights):
        value = _stack_value(writer, p, f"{base}_{e}")
        if not proj.k_major:
            value = writer.node("Transpose", [value], f"{base}_{e}_k_major", perm=[1, 0]).outputs[0]
        axes = writer.ints(f"{base}_{e}_axes", [0])
        parts.append(writer.node("Unsqueeze", [value, axes], f"{base}_{e}_stacked").outputs[0])
    return writer.node("Concat", parts, f"{base}_experts", axis=0).outputs[0]


def _stack_value(writer: GraphWriter, param: Param, base: str) -> ir.Value:
    source = param.source
    if source.dq is None:
        assert source.value is not None
        return source.value
    dq = source.dq
    gathered = value_dims(dq.inputs[0])
    rank = len(gathered) if gathered is not None else None
    stack = const_shape(source.inputs[0]) or ()
    attrs = dict(dq.attributes.items())
    if rank is not None:
        axis = attr_int(dq, "axis", 1) or 1
        axis = axis + rank if axis < 0 else axis
        attrs["axis"] = ir.Attr("axis", ir.AttributeType.INT, axis - (rank - len(stack)))
    return writer.node("DequantizeLinear", list(source.inputs), f"{base}_dq", **attrs).outputs[0]


def _bias(writer: GraphWriter, proj: Projection, base: str) -> list[ir.Value]:
    """FC bias ``[E, N]`` as a value (none when the projection has no bias)."""
    if proj.biases is None:
        return []
    rows = []
    for e, b in enumerate(proj.biases):
        value = _stack_value(writer, b, f"{base}_{e}")
        shape = const_shape(value)
        wanted = [1, -1] if b.single else [shape[0] if shape else -1, -1]
        if shape is None or len(shape) != 2 or b.single:
            target = writer.ints(f"{base}_{e}_shape", wanted)
            value = writer.node("Reshape", [value, target], f"{base}_{e}_rows").outputs[0]
        rows.append(value)
    if len(rows) == 1:
        return rows
    return [writer.node("Concat", rows, f"{base}_experts", axis=0).outputs[0]]


def write_per_slot(graph: ir.Graph, found: Interpretation, parts: LayerParts) -> None:
    """Rewrite the layer ``parts`` describes into the per-slot form (see the module)."""
    old_out = parts.output
    writer = GraphWriter(graph, f"{old_out.name or 'moe'}_meaning")
    idx = parts.topk.outputs[1]
    mapped: dict[int, ir.Value] = {}
    weights = parts.weights
    if parts.weights_at_ids:  # S [.., E] read at each slot's expert: w[t, j] = S[t, idx[t, j]]
        read = writer.node("GatherElements", [weights, idx], "weights_at_ids", axis=-1)
        weights = read.outputs[0]
    tokens, weights = parts.tokens, _replayed(writer, weights, parts.weight_post)
    if parts.prescale is not None:  # k = 1: the tokens times their weight, then the weight 1
        scale = _replayed(writer, parts.prescale.source, getattr(parts.prescale, "post", ()))
        column = writer.node("Reshape", [scale, writer.ints("scale_shape", [-1, 1])], "scale")
        tokens = writer.node("Mul", [tokens, column.outputs[0]], "scaled_tokens").outputs[0]
        values = parts.topk.outputs[0]
        weights = writer.node("Softmax", [values], "unit_weights", axis=-1).outputs[0]
    rank = len(value_dims(tokens) or ())
    for i, proj in enumerate(parts.fc1):
        base = f"fc1_{i}"
        if rank == 3:  # [B, S, H] tokens: [B, S, 1, 1, H] @ W[idx] [B, S, k, H, N]
            lhs = writer.node("Unsqueeze", [tokens, writer.ints(f"{base}_axes", [2, 3])], base)
            mapped[id(proj.term)] = _gathered(writer, lhs.outputs[0], proj, idx, base)
            continue
        inputs = [
            tokens,
            _weight(writer, proj, base),
            idx,
            *_bias(writer, proj, f"{base}_bias"),
        ]
        mapped[id(proj.term)] = writer.node("GroupedMatMul", inputs, base).outputs[0]
    for old in parts.act_nodes:
        new = _copy_activation_node(writer, found, old, mapped)
        writer.stands_for.append((new, old))
    act_out = mapped[id(parts.fc2_input)]
    if rank == 3:
        _finish_split(writer, found, parts, act_out, weights, idx)
        return
    fc2 = parts.fc2
    width, out_width = parts.widths
    rows = writer.node("Reshape", [act_out, writer.ints("fc2_rows_shape", [-1, width])], "fc2_rows")
    row_idx = writer.node("Reshape", [idx, writer.ints("fc2_idx_shape", [-1, 1])], "fc2_row_idx")
    grouped = writer.node(
        "GroupedMatMul",
        [
            rows.outputs[0],
            _weight(writer, fc2, "fc2"),
            row_idx.outputs[0],
            *_bias(writer, fc2, "fc2_bias"),
        ],
        "fc2_grouped",
    )
    k = found.k
    slots = writer.node(
        "Reshape",
        [grouped.outputs[0], writer.ints("fc2_slots_shape", [-1, k, out_width])],
        "fc2",
    )
    w3 = writer.node("Unsqueeze", [weights, writer.ints("weights_axes", [-1])], "weights_3d")
    mul = writer.node("Mul", [slots.outputs[0], w3.outputs[0]], "weighted")
    out = writer.node(
        "ReduceSum", [mul.outputs[0], writer.ints("slots_axes", [1])], "out", keepdims=0
    )
    result = out.outputs[0]
    if parts.shared is not None:  # sum_j w (FC2 + S): the layer plus (sum_j w) * S
        assert found.tokens is not None
        result = add_shared_term(writer, parts, weights, found.tokens, result)
    if parts.split_tokens is not None:
        shape = writer.node("Shape", [parts.split_tokens], "out_shape")
        result = writer.node("Reshape", [result, shape.outputs[0]], "out_split").outputs[0]
    _replace_layer(graph, writer, parts, result)


def _replace_layer(
    graph: ir.Graph, writer: GraphWriter, parts: LayerParts, result: ir.Value
) -> None:
    """The new nodes in, ``result`` (plus the scatter's base) taking over the layer's output."""
    old_out = parts.output
    if parts.base is not None:  # scatter-added into a value other than zeros: that value plus it
        result = writer.node("Add", [result, parts.base], "plus_base").outputs[0]
    root = old_out.producer()
    assert root is not None
    writer.stands_for.append((result.producer(), root))  # type: ignore[arg-type]
    graph.insert_before(root, writer.new_nodes)
    _take_over(writer, old_out, result)
    writer.remove_dead([old_out])
    writer.take_over_node_names(root)


def _gathered(
    writer: GraphWriter, lhs: ir.Value, proj: Projection, idx: ir.Value, base: str
) -> ir.Value:
    """``Squeeze(lhs @ Gather(W, idx), [3])`` (+ ``Gather(b, idx)``): rows of ``[B, S, k, N]``."""
    picked = writer.node("Gather", [_weight(writer, proj, base), idx], f"{base}_w", axis=0)
    mm = writer.node("MatMul", [lhs, picked.outputs[0]], f"{base}_mm")
    axes = writer.ints(f"{base}_drop_axes", [3])
    out = writer.node("Squeeze", [mm.outputs[0], axes], f"{base}_rows").outputs[0]
    for bias in _bias(writer, proj, f"{base}_bias"):
        picked_bias = writer.node("Gather", [bias, idx], f"{base}_b", axis=0)
        out = writer.node("Add", [out, picked_bias.outputs[0]], f"{base}_biased").outputs[0]
    return out


def _finish_split(
    writer: GraphWriter,
    found: Interpretation,
    parts: LayerParts,
    act: ir.Value,
    weights: ir.Value,
    idx: ir.Value,
) -> None:
    """FC2 and the combine of a layer routed on ``[B, S, H]`` tokens as they are.

    The ids are ``[B, S, k]``: the gathered-weights per-slot form, whose rules take any token
    rank (the opset-29 GroupedMatMul takes ``[M, K]`` rows only); the output ``[B, S, O]``, or
    ``[T, O]`` rows where the layer's output is laid out so.
    """
    lhs = writer.node("Unsqueeze", [act, writer.ints("fc2_axes", [3])], "fc2_lhs").outputs[0]
    slots = _gathered(writer, lhs, parts.fc2, idx, "fc2")
    w4 = writer.node("Unsqueeze", [weights, writer.ints("weights_axes", [-1])], "weights_4d")
    mul = writer.node("Mul", [slots, w4.outputs[0]], "weighted")
    out = writer.node(
        "ReduceSum", [mul.outputs[0], writer.ints("slots_axes", [2])], "out", keepdims=0
    )
    result = out.outputs[0]
    if parts.split_tokens is None:  # the layer's output is [T, O] rows: flatten [B, S, O] too
        shape = writer.ints("out_rows_shape", [-1, parts.widths[1]])
        result = writer.node("Reshape", [result, shape], "out_rows").outputs[0]
    _replace_layer(found.topk.graph, writer, parts, result)  # type: ignore[arg-type]


def _replayed(writer: GraphWriter, value: ir.Value, post: tuple) -> ir.Value:
    """``value`` through the scalar ops ``post`` (``(node, input index of the value)``)."""
    for node, at in post:
        inputs = [value if i == at else v for i, v in enumerate(node.inputs)]
        attrs = dict(node.attributes.items())
        value = writer.node(node.op_type, inputs, f"w_{node.op_type.lower()}", **attrs).outputs[0]
    return value


def _take_over(writer: GraphWriter, old: ir.Value, new: ir.Value) -> None:
    name = old.name
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    old.name = writer.fresh("replaced_out")
    new.name = name
    new.type, new.shape = old.type, old.shape


def _copy_activation_node(
    writer: GraphWriter, found: Interpretation, old: ir.Node, mapped: dict[int, ir.Value]
) -> ir.Node:
    """``old`` on the new FC1 outputs; feature-axis attributes and inputs written as -1."""
    inputs: list[ir.Value | None] = []
    for i, v in enumerate(old.inputs):
        m = found.meaning(v)
        if m is not None and isinstance(m.term, Proj | Act):
            inputs.append(mapped[id(m.term)])
        elif old.op_type == "Slice" and i == 3 and v is not None:
            inputs.append(writer.ints("slice_axes", [-1]))
        else:
            inputs.append(v)
    if old.op_type == "Slice" and len(inputs) == 3:  # no axes: the starts' own axes, proved last
        inputs.append(writer.ints("slice_axes", [-1]))
    attrs: dict = dict(old.attributes.items())
    if old.op_type in ("Split", "Gather"):
        attrs["axis"] = ir.Attr("axis", ir.AttributeType.INT, -1)
    new = writer.node(
        old.op_type, inputs, f"act_{old.op_type.lower()}", len(old.outputs), old.domain, **attrs
    )
    for o_old, o_new in zip(old.outputs, new.outputs, strict=True):
        m = found.meaning(o_old)
        if m is not None:
            mapped[id(m.term)] = o_new
    return new
