"""Slot-axis spellings: ``Unsqueeze`` of an ``Expand`` or of an ``Unsqueeze`` -> one ``Unsqueeze``.

The per-slot layer rules take the FC1 left operand as ``Expand?(Unsqueeze(tokens, axes), shape)``:
one Unsqueeze adding the slot and row axes at once, then (optionally) the Expand repeating the
tokens over the k slots. People (and the Einsum lowering) write the same tensor in other orders,
e.g. ``Unsqueeze(Expand(Unsqueeze(x, [1]), [1, k, 1]), [2])`` or
``Unsqueeze(Unsqueeze(x, [1]), [2])``. Two exact rewrites, applied to a fixpoint, bring every
such chain to the rules' form:

* **swap**: ``Unsqueeze(Expand(a, s), axes)`` -> ``Expand(Unsqueeze(a, axes'), s')``. With
  ``R = max(rank(a), len(s))`` and ``F = R + len(axes)``, ``axes`` (normalised over ``F``) are
  unit axes of the result; ``s'`` is ``s`` left-padded with ones to ``R`` and with a ``1``
  inserted at each of ``axes``; ``axes'`` are ``axes`` plus the first ``R - rank(a)`` other
  positions (Expand's implicit left-padding of ``a``, made explicit so that ``a``'s dims stay
  aligned with ``s'``). Each output dim is the broadcast of the same pair of dims as before, the
  inserted ones are ``1`` on both sides, and the data is the same copy of ``a``: bit-exact.
* **merge**: ``Unsqueeze(Unsqueeze(a, inner), outer)`` -> ``Unsqueeze(a, merged)``: ``outer``
  (normalised over the final rank) stay where they are; the positions of the intermediate tensor
  map, in order, onto the final positions not in ``outer``, so ``inner``'s go where they land.

Only the input form of Unsqueeze's axes (opset 13+) is rewritten, and only with constant axes,
a constant Expand shape and a rank of ``a`` the graph fixes; anything else is left as it is. The
rewritten Unsqueeze's output keeps its name (the replacement takes it); the replaced nodes are
removed when nothing else reads them.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import const_ints, normalize_axes, static_rank
from onnx_moe_fuse.rewrites.graph.fresh_names import FreshNames

__all__ = ["merged_unsqueeze_axes", "swapped_expand", "rewrite_unsqueeze_chains"]

#: Fixpoint guard: each sweep shortens some chain, so real models settle in a few sweeps.
_MAX_SWEEPS = 16


def merged_unsqueeze_axes(inner: list[int], outer: list[int], rank: int) -> list[int] | None:
    """Axes of one Unsqueeze of a rank-``rank`` tensor equal to ``inner`` then ``outer``.

    None if an axis is out of range or repeated (such a model is invalid; leave it alone).
    """
    mid_rank = rank + len(inner)
    final_rank = mid_rank + len(outer)
    inner_n = normalize_axes(inner, mid_rank)
    outer_n = normalize_axes(outer, final_rank)
    if inner_n is None or outer_n is None:
        return None
    if len(set(inner_n)) != len(inner_n) or len(set(outer_n)) != len(outer_n):
        return None
    kept = [p for p in range(final_rank) if p not in set(outer_n)]  # intermediate -> final
    return sorted(set(outer_n) | {kept[p] for p in inner_n})


def swapped_expand(
    axes: list[int], shape: list[int], rank: int
) -> tuple[list[int], list[int]] | None:
    """The ``(axes', shape')`` that move an Unsqueeze of ``Expand(a, shape)`` before the Expand.

    ``Unsqueeze(Expand(a, shape), axes)`` = ``Expand(Unsqueeze(a, axes'), shape')`` for ``a`` of
    rank ``rank``; None if the axes are invalid.
    """
    out_rank = max(rank, len(shape))
    final_rank = out_rank + len(axes)
    axes_n = normalize_axes(axes, final_rank)
    if axes_n is None or len(set(axes_n)) != len(axes_n):
        return None
    padded = [1] * (out_rank - len(shape)) + list(shape)
    others = [p for p in range(final_rank) if p not in set(axes_n)]
    new_shape = [1] * final_rank
    for p, dim in zip(others, padded, strict=True):
        new_shape[p] = dim
    new_axes = sorted(set(axes_n) | set(others[: out_rank - rank]))
    return new_axes, new_shape


def is_onnx(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _input_axes(node: ir.Node) -> list[int] | None:
    """Constant axes given as Unsqueeze's second input (opset 13+); None otherwise."""
    if len(node.inputs) < 2 or node.inputs[1] is None or "axes" in node.attributes:
        return None
    return const_ints(node.inputs[1])


def ints_constant(names: FreshNames, base: str, values: list[int]) -> ir.Node:
    tensor = ir.tensor(np.asarray(values, dtype=np.int64), name=names.fresh(base))
    node = ir.node("Constant", [], attributes={"value": tensor}, name=names.fresh(base))
    node.outputs[0].name = tensor.name
    node.outputs[0].const_value = tensor
    node.outputs[0].type = ir.TensorType(ir.DataType.INT64)
    node.outputs[0].shape = ir.Shape([len(values)])
    return node


def _replace(graph: ir.Graph, old: ir.Node, new_nodes: list[ir.Node], names: FreshNames) -> None:
    """Put ``new_nodes`` (the last one's output replacing ``old``'s) before ``old``; drop dead."""
    old_out, new_out = old.outputs[0], new_nodes[-1].outputs[0]
    sources = [v.producer() for v in old.inputs if v is not None]
    graph.insert_before(old, new_nodes)
    name = old_out.name
    old_out.name = names.fresh(name or "unsqueeze")  # free the name for the replacement
    new_out.name = name
    new_out.type, new_out.shape = old_out.type, old_out.shape
    ir.convenience.replace_all_uses_with(old_out, new_out, replace_graph_outputs=True)
    graph.remove(old, safe=True)
    for producer in sources:  # the Expand / inner Unsqueeze, and their shape/axes Constants
        _remove_if_dead(graph, producer)


def _remove_if_dead(graph: ir.Graph, node: ir.Node | None) -> None:
    if node is None or node.graph is not graph:
        return
    if any(out.uses() or out.is_graph_output() for out in node.outputs):
        return
    inputs = [v.producer() for v in node.inputs if v is not None]
    graph.remove(node, safe=True)
    for producer in inputs:
        if is_onnx(producer, "Constant"):
            _remove_if_dead(graph, producer)


def _rewrite_one(graph: ir.Graph, node: ir.Node, names: FreshNames) -> bool:
    axes = _input_axes(node)
    source = node.inputs[0]
    producer = source.producer() if source is not None else None
    if axes is None or producer is None or producer.graph is not graph:
        return False
    out_name = node.outputs[0].name or "unsqueeze"
    if is_onnx(producer, "Unsqueeze"):
        inner = _input_axes(producer)
        base = producer.inputs[0]
        rank = static_rank(base)
        if inner is None or base is None or rank is None:
            return False
        merged = merged_unsqueeze_axes(inner, axes, rank)
        if merged is None:
            return False
        axes_node = ints_constant(names, out_name, merged)
        unsq = ir.node("Unsqueeze", [base, axes_node.outputs[0]], name=names.fresh(out_name))
        _replace(graph, node, [axes_node, unsq], names)
        return True
    if is_onnx(producer, "Expand") and len(producer.inputs) == 2:
        base = producer.inputs[0]
        shape = const_ints(producer.inputs[1])
        rank = static_rank(base)
        if base is None or shape is None or rank is None:
            return False
        swapped = swapped_expand(axes, shape, rank)
        if swapped is None:
            return False
        new_axes, new_shape = swapped
        axes_node = ints_constant(names, out_name, new_axes)
        unsq = ir.node("Unsqueeze", [base, axes_node.outputs[0]], name=names.fresh(out_name))
        unsq.outputs[0].name = names.fresh(out_name)
        unsq.outputs[0].type = base.type
        shape_node = ints_constant(names, out_name, new_shape)
        expand = ir.node(
            "Expand", [unsq.outputs[0], shape_node.outputs[0]], name=names.fresh(out_name)
        )
        _replace(graph, node, [axes_node, unsq, shape_node, expand], names)
        return True
    return False


def rewrite_unsqueeze_chains(graph: ir.Graph) -> bool:
    """Apply swap and merge to every Unsqueeze of ``graph`` (not subgraphs) to a fixpoint."""
    names = FreshNames(graph, "slots")
    modified = False
    for _ in range(_MAX_SWEEPS):
        changed = False
        for node in list(graph):
            if node.graph is graph and is_onnx(node, "Unsqueeze"):
                changed |= _rewrite_one(graph, node, names)
        modified |= changed
        if not changed:
            break
    return modified
