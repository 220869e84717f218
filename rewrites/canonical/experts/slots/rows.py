"""Repeated token rows -> per-slot projections: the hand-decomposed Qwen3-MoE spelling.

A user decomposing a Qwen3/Mixtral MoE block by hand repeats each token k times as ``R = T*k``
rows and gathers each row's expert weights by the flattened top-k ids::

    rows   = Reshape(Expand(Unsqueeze(x, [1]), [1, k, 1]), [-1, 1, H])    [R, 1, H], r = t*k + j
    ids    = Reshape(idx, [-1])                                           [R]   (idx = TopK ids)
    fc1    = MatMul(rows, Gather(W1, ids))                                [R, 1, N]  (one or two)
    act    = element-wise / last-axis Split or Slice of the fc1 values    [R, 1, I]
    out    = Reshape(MatMul(act, Gather(W2, ids)), [-1, k, H2])           [T, k, H2]

No layer rule takes this: the flattened-rows (batched_mm) rules want ``GatherND`` ids, ``[R, N]``
projections and the routing weights applied to the rows before the ``[T, k, H]`` Reshape; the
per-slot rules want ``[T, k, N]`` projections. This module rewrites it into the per-slot form::

    fc1'   = Squeeze(MatMul(Expand(Unsqueeze(x, [1, 2]), [1, k, 1, 1]), Gather(W1, idx)), [2])
    out'   = Squeeze(MatMul(Unsqueeze(act', [2]), Gather(W2, idx)), [2])

Exact: row ``t*k + j`` of the rows form is the dot products of ``x[t]`` with the columns of
``W[idx[t, j]]``, which is element ``[t, j]`` of the per-slot form, computed by the same MatMul
arithmetic; the activation between is proven element-wise along every axis but the last (its
ops are listed in :data:`_ELEMENTWISE`, or Split/Slice of the last axis; other operands are
constants with unit leading dims), so it computes the same values on ``[T, k, N]`` as on
``[R, 1, N]``. Every value of the activation must stay inside it (an escaping value would change
shape). ``fc1``'s and ``out``'s names go to their replacements; the activation values keep
theirs. Anything not proven is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.slots.unsqueeze import ints_constant, is_onnx
from onnx_moe_fuse.rewrites.graph.facts import (
    attr_int,
    const_ints,
    normalize_axes,
    static_last_dim,
    static_rank,
)
from onnx_moe_fuse.rewrites.graph.fresh_names import FreshNames

__all__ = ["rewrite_repeated_rows"]

#: Ops computing each element from the same element of their inputs (broadcast operands aside).
_ELEMENTWISE = frozenset(
    {
        "Sigmoid", "Tanh", "Relu", "Neg", "Exp", "Erf", "Abs", "Softplus", "Identity", "Gelu",
        "HardSigmoid", "Swish", "Elu", "LeakyRelu", "Clip", "Add", "Sub", "Mul", "Div", "Pow",
        "Max", "Min",
    }
)  # fmt: skip


#: An activation is a handful of ops; a larger closure is not one (and is not walked further).
_MAX_ACTIVATION_NODES = 64


@dataclass
class _RowsLayer:
    """The proven parts of one repeated-rows layer."""

    tokens: ir.Value
    ids: ir.Value
    k: int
    fc1: list[ir.Node]
    fc2: ir.Node
    unflatten: ir.Node
    activation: list[ir.Node]


def _topk_k(idx: ir.Value) -> int | None:
    """k of the TopK whose ids are ``idx`` ``[T, E]`` -> ``[T, k]`` over the last axis."""
    topk = idx.producer()
    if not is_onnx(topk, "TopK") or len(topk.outputs) < 2 or topk.outputs[1] is not idx:
        return None
    if static_rank(topk.inputs[0]) != 2 or attr_int(topk, "axis", -1) not in (-1, 1):
        return None
    k = const_ints(topk.inputs[1])
    return k[0] if k is not None and len(k) == 1 else None


def _weight_last_dim(value: ir.Value) -> int | None:
    """Last dim of a rank-3 weight (a constant, or a DequantizeLinear of one), shape only."""
    node = value.producer()
    if is_onnx(node, "DequantizeLinear") and node.inputs[0].const_value is not None:
        shape = node.inputs[0].const_value.shape
        return int(shape[-1]) if len(shape) == 3 and isinstance(shape[-1], int) else None
    if static_rank(value) != 3:
        return None
    return static_last_dim(value)


def _repeated_tokens(rows: ir.Value, k: int) -> ir.Value | None:
    """``x`` when ``rows`` is ``Reshape(Expand(Unsqueeze(x, [1]), [1, k, 1]), [-1, 1, H])``."""
    reshape = rows.producer()
    if not is_onnx(reshape, "Reshape"):
        return None
    expand = reshape.inputs[0].producer()
    if not is_onnx(expand, "Expand"):
        return None
    unsq = expand.inputs[0].producer()
    if not is_onnx(unsq, "Unsqueeze") or len(unsq.inputs) != 2:
        return None
    x = unsq.inputs[0]
    hidden = static_last_dim(x)
    axes = const_ints(unsq.inputs[1])
    if static_rank(x) != 2 or hidden is None or axes is None:
        return None
    if normalize_axes(axes, 3) != [1]:
        return None
    shape = const_ints(expand.inputs[1])
    if shape is None or len(shape) > 3:
        return None
    padded = [1] * (3 - len(shape)) + shape
    if padded[0] != 1 or padded[1] != k or padded[2] not in (1, hidden):
        return None
    if const_ints(reshape.inputs[1]) != [-1, 1, hidden]:
        return None
    return x


def _activation(fc1: list[ir.Node], fc2: ir.Node) -> list[ir.Node] | None:
    """The nodes from the fc1 outputs to fc2's lhs, if all are element-wise off the last axis."""
    inside: set[ir.Value] = {mm.outputs[0] for mm in fc1}
    order: list[ir.Node] = []
    frontier = list(inside)
    while frontier:  # the forward closure first: a node's other inputs may come later
        value = frontier.pop()
        if value.is_graph_output():
            return None
        for user, index in value.uses():
            if (user is fc2 and index == 0) or user in order:
                continue
            if user is fc2 or len(order) > _MAX_ACTIVATION_NODES:
                return None
            order.append(user)
            inside.update(user.outputs)
            frontier.extend(user.outputs)
    if fc2.inputs[0] not in inside or not all(_shape_agnostic(n, inside) for n in order):
        return None
    return order


def _broadcast_const(value: ir.Value) -> bool:
    """A constant whose dims are all 1 but the last (broadcasts the same on any leading dims)."""
    tensor = value.const_value
    if tensor is None:
        producer = value.producer()
        if not is_onnx(producer, "Constant"):
            return False
        attr = producer.attributes.get("value")
        tensor = attr.value if attr is not None and not attr.is_ref() else None
        if tensor is None:
            return False
    shape = list(tensor.shape)
    return len(shape) <= 3 and all(d == 1 for d in shape[:-1])


def _shape_agnostic(node: ir.Node, inside: set[ir.Value]) -> bool:
    if node.domain not in ("", "ai.onnx") or any(a.is_ref() for a in node.attributes.values()):
        return False
    if node.op_type in _ELEMENTWISE:
        return all(v is None or v in inside or _broadcast_const(v) for v in node.inputs)
    if node.op_type == "Split":
        split_ok = len(node.inputs) < 2 or node.inputs[1] is None or const_ints(node.inputs[1])
        return node.inputs[0] in inside and bool(split_ok) and attr_int(node, "axis", 0) in (-1, 2)
    if node.op_type == "Slice" and len(node.inputs) >= 4:
        consts = [const_ints(v) for v in node.inputs[1:] if v is not None]
        axes = const_ints(node.inputs[3])
        return (
            node.inputs[0] in inside
            and all(c is not None for c in consts)
            and axes is not None
            and all(a in (-1, 2) for a in axes)
        )
    return False


def _find(flat: ir.Node) -> _RowsLayer | None:
    """The layer whose weights are gathered by ``flat`` = ``Reshape(idx, [-1])``, if proven."""
    if not is_onnx(flat, "Reshape") or const_ints(flat.inputs[1]) != [-1]:
        return None
    idx = flat.inputs[0]
    k = _topk_k(idx) if idx is not None else None
    if k is None:
        return None
    fc1, fc2, tokens = [], [], None
    for gather, index in flat.outputs[0].uses():
        if not is_onnx(gather, "Gather") or index != 1 or attr_int(gather, "axis", 0) != 0:
            return None
        uses = list(gather.outputs[0].uses())
        if len(uses) != 1 or gather.outputs[0].is_graph_output():
            return None
        mm, slot = uses[0]
        if not is_onnx(mm, "MatMul") or slot != 1 or _weight_last_dim(gather.inputs[0]) is None:
            return None
        x = _repeated_tokens(mm.inputs[0], k)
        if x is not None and (tokens is None or x is tokens):
            tokens = x
            fc1.append(mm)
        else:
            fc2.append(mm)
    if tokens is None or not fc1 or len(fc2) != 1:
        return None
    out_uses = list(fc2[0].outputs[0].uses())
    if len(out_uses) != 1 or fc2[0].outputs[0].is_graph_output():
        return None
    unflatten = out_uses[0][0]
    h2 = _weight_last_dim(fc2[0].inputs[1].producer().inputs[0])
    if not is_onnx(unflatten, "Reshape") or const_ints(unflatten.inputs[1]) != [-1, k, h2]:
        return None
    activation = _activation(fc1, fc2[0])
    if activation is None:
        return None
    return _RowsLayer(tokens, idx, k, fc1, fc2[0], unflatten, activation)


def _per_slot(
    names: FreshNames, lhs: ir.Value, weight: ir.Value, ids: ir.Value, base: str
) -> list[ir.Node]:
    """``Squeeze(MatMul(lhs [T, k, 1, K], Gather(weight, ids) [T, k, K, N]), [2])`` nodes."""
    gather = ir.node("Gather", [weight, ids], attributes={"axis": 0}, name=names.fresh(base))
    gather.outputs[0].name = names.fresh(base)
    mm = ir.node("MatMul", [lhs, gather.outputs[0]], name=names.fresh(base))
    mm.outputs[0].name = names.fresh(base)
    axes = ints_constant(names, base, [2])
    squeeze = ir.node("Squeeze", [mm.outputs[0], axes.outputs[0]], name=names.fresh(base))
    return [gather, mm, axes, squeeze]


def _take_over(old: ir.Value, new: ir.Value, names: FreshNames) -> None:
    name = old.name
    old.name = names.fresh(name or "rows")
    new.name = name
    new.type = old.type
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)


def _rewrite(graph: ir.Graph, layer: _RowsLayer, names: FreshNames) -> None:
    base = layer.tokens.name or "tokens"
    axes = ints_constant(names, base, [1, 2])
    unsq = ir.node("Unsqueeze", [layer.tokens, axes.outputs[0]], name=names.fresh(base))
    unsq.outputs[0].name = names.fresh(base)
    shape = ints_constant(names, base, [1, layer.k, 1, 1])
    expand = ir.node("Expand", [unsq.outputs[0], shape.outputs[0]], name=names.fresh(base))
    expand.outputs[0].name = names.fresh(base)
    graph.insert_before(layer.fc1[0], [axes, unsq, shape, expand])
    dead: list[ir.Node] = []
    for mm in layer.fc1:
        weight = mm.inputs[1].producer().inputs[0]
        nodes = _per_slot(names, expand.outputs[0], weight, layer.ids, mm.outputs[0].name or "fc1")
        graph.insert_before(mm, nodes)
        _take_over(mm.outputs[0], nodes[-1].outputs[0], names)
        dead.append(mm)
    for node in layer.activation:  # same values, per-slot shapes now
        for out in node.outputs:
            out.shape = None
    act = layer.fc2.inputs[0]
    base = layer.unflatten.outputs[0].name or "fc2"
    row_axis = ints_constant(names, base, [2])
    lhs = ir.node("Unsqueeze", [act, row_axis.outputs[0]], name=names.fresh(base))
    lhs.outputs[0].name = names.fresh(base)
    weight = layer.fc2.inputs[1].producer().inputs[0]
    nodes = [row_axis, lhs, *_per_slot(names, lhs.outputs[0], weight, layer.ids, base)]
    graph.insert_before(layer.unflatten, nodes)
    _take_over(layer.unflatten.outputs[0], nodes[-1].outputs[0], names)
    for node in [layer.unflatten, layer.fc2, *dead]:
        sources = [v.producer() for v in node.inputs if v is not None]
        graph.remove(node, safe=True)
        for producer in sources:
            _remove_rows_chain(graph, producer)


def _remove_rows_chain(graph: ir.Graph, node: ir.Node | None) -> None:
    """Remove ``node`` and its dead producers up the old rows/ids chain (Gather, Reshape...)."""
    if node is None or node.graph is not graph or node.op_type not in (
        "Gather", "Reshape", "Expand", "Unsqueeze", "Constant"
    ):  # fmt: skip
        return
    if any(out.uses() or out.is_graph_output() for out in node.outputs):
        return
    sources = [v.producer() for v in node.inputs if v is not None]
    graph.remove(node, safe=True)
    for producer in sources:
        _remove_rows_chain(graph, producer)


def rewrite_repeated_rows(graph: ir.Graph) -> bool:
    """Rewrite every proven repeated-rows layer of ``graph`` into the per-slot form."""
    names = FreshNames(graph, "slots")
    modified = False
    for node in list(graph):
        if node.graph is not graph:
            continue  # removed by an earlier rewrite
        layer = _find(node)
        if layer is not None:
            _rewrite(graph, layer, names)
            modified = True
    return modified
