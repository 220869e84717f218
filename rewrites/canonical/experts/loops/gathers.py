"""The two gathers of one expert in an expert loop: its token rows and its routing weights.

With ``s_e`` / ``t_e`` the slot and token ids of expert ``e`` (:func:`.values.read_coords`),
a loop iteration reads

* the rows ``x[t_e]`` ``[n, H]``: ``Reshape(Gather(Unsqueeze(x, 0), t_e, axis=1), [-1, H])``
  (TorchScript's ``hidden_states[None, top_x]``), the dynamo spelling
  ``Reshape(Transpose(GatherND(Transpose(Unsqueeze(x, 0), [1, 0, 2]), Unsqueeze(t_e, -1)),
  [1, 0, 2]), [-1, H])``, or plainly ``Gather(x, t_e)``;
* the weights ``w[t_e, s_e]`` as ``[n, 1]``: ``Gather(Flatten(Unsqueeze(w, 2), 2), s_e + t_e * k)``
  (row ``t * k + s`` of the flattened ``[T * k, 1]`` weights is ``w[t, s]``) under Reshapes to
  two dims ending in 1, or ``GatherND(Unsqueeze(w, 2), Concat(Unsqueeze(t_e, -1),
  Unsqueeze(s_e, -1)))``.

:func:`read_rows` and :func:`read_weight` prove one of these and return what they read, or raise
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` naming the expert and the node. Only reads
the graph.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.loops.values import is_k, unsqueezed_last
from onnx_moe_fuse.rewrites.canonical.experts.value_proofs import producer_op
from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_ints, label, node_axes
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.graph.symbolic_dims import shape_value, value_dims

__all__ = ["read_rows", "read_weight"]


def _transposed_102(value: ir.Value) -> ir.Value | None:
    node = producer_op(value, "Transpose")
    perm = node.attributes.get("perm") if node is not None else None
    if perm is None or list(perm.value) != [1, 0, 2]:
        return None
    return node.inputs[0]


def _unsqueezed_0(value: ir.Value | None) -> ir.Value | None:
    node = producer_op(value, "Unsqueeze")
    return node.inputs[0] if node is not None and node_axes(node) == [0] else None


def read_rows(rows: ir.Value, e: int, token_ids: ir.Value, slot_ids: ir.Value) -> tuple:
    """``(x, spelling, nodes)``: ``rows`` is ``x[token_ids]`` ``[n, H]`` with ``x`` ``[T, H]``."""
    nodes: list[ir.Node] = []
    value = rows
    reshape = producer_op(value, "Reshape")
    hidden = None
    if reshape is not None:
        target = const_ints(reshape.inputs[1])
        if target is None or len(target) != 2 or target[0] != -1 or target[1] <= 0:
            raise Refusal(f"expert {e}: {label(reshape)} does not reshape the rows to [-1, H]")
        hidden = target[1]
        nodes.append(reshape)
        value = reshape.inputs[0]
    gather = producer_op(value, "Gather")
    if gather is not None:
        index, axis = gather.inputs[1], attr_int(gather, "axis", 0)
        source = _unsqueezed_0(gather.inputs[0]) if axis == 1 else gather.inputs[0]
        spelling = "gather_axis1" if axis == 1 else "gather"
        if source is None or axis not in (0, 1):
            raise Refusal(f"expert {e}: {label(gather)} does not gather token rows")
        nodes.append(gather)
    else:
        inner = _transposed_102(value)
        gnd = producer_op(inner, "GatherND")
        if gnd is None or attr_int(gnd, "batch_dims", 0) != 0:
            raise Refusal(
                f"expert {e}: the expert's input {rows.name!r} is not a gather of token rows"
            )
        source = _unsqueezed_0(_transposed_102(gnd.inputs[0]))
        index_node = producer_op(gnd.inputs[1], "Unsqueeze")
        index = index_node.inputs[0] if index_node is not None else None
        if source is None or not unsqueezed_last(gnd.inputs[1], index):
            raise Refusal(f"expert {e}: {label(gnd)} does not gather token rows")
        spelling = "gathernd"
        nodes += [value.producer(), gnd, index_node]
    if index is slot_ids:
        raise Refusal(
            f"expert {e}: the expert's rows are gathered by the slot ids {slot_ids.name!r}, "
            f"not the token ids {token_ids.name!r}"
        )
    if index is not token_ids:
        raise Refusal(
            f"expert {e}: the expert's rows are gathered by {index.name!r}, not by the token "
            f"ids {token_ids.name!r} of its mask slice"
        )
    if spelling != "gather" and reshape is None:
        raise Refusal(f"expert {e}: the gathered rows {value.name!r} are not reshaped to [n, H]")
    dims = value_dims(source)
    last = dims[-1] if dims is not None and len(dims) == 2 else None
    if hidden is not None and (last is None or last.syms or last.coef != hidden):
        raise Refusal(
            f"expert {e}: the rows are reshaped to [-1, {hidden}], which is not proved to be the "
            f"tokens' {source.name!r} feature size"
        )
    return source, spelling, nodes


def _two_dims_ending_in_one(target: ir.Value) -> bool:
    """A Reshape target of two entries whose last is 1 (``[-1, 1]``, ``[n, 1]``)."""
    ints = const_ints(target)
    if ints is not None:
        return len(ints) == 2 and ints[1] == 1
    concat = producer_op(target, "Concat")
    if concat is None or len(concat.inputs) != 2 or attr_int(concat, "axis", 0) not in (0, -1):
        return False
    if not _holds_one(concat.inputs[1]):
        return False
    first = concat.inputs[0]
    if const_ints(first) is not None:
        return len(const_ints(first)) == 1
    shape = producer_op(first, "Shape")
    if shape is None or attr_int(shape, "start", 0) != 0 or attr_int(shape, "end", None):
        return False
    source = shape.inputs[0]
    return (source.shape is not None and len(source.shape) == 1) or _one_dimensional(source)


def _holds_one(value: ir.Value) -> bool:
    """``value`` is ``[1]``: a constant, or ``Gather(Shape(Unsqueeze(v, axes)), [a])``, a in axes.

    An axis that Unsqueeze inserts has size 1 whatever ``v`` is.
    """
    known = shape_value(value)
    if known is not None and known.ints is not None:
        return known.ints == [1]
    gather = producer_op(value, "Gather")
    index = const_ints(gather.inputs[1]) if gather is not None else None
    shape = producer_op(gather.inputs[0], "Shape") if gather is not None else None
    unsq = producer_op(shape.inputs[0], "Unsqueeze") if shape is not None else None
    if unsq is None or index is None or len(index) != 1 or attr_int(gather, "axis", 0) != 0:
        return False
    if attr_int(shape, "start", 0) != 0 or attr_int(shape, "end", None) is not None:
        return False
    return index[0] >= 0 and index[0] in (node_axes(unsq) or [])


def _one_dimensional(value: ir.Value) -> bool:
    """``value`` is 1-D: a squeezed column, or a sum / product of one with 1-element values."""
    node = value.producer()
    if node is None:
        return False
    if node.op_type == "Squeeze":
        return node_axes(node) in ([1], [-1])
    if node.op_type in ("Add", "Mul"):
        return any(_one_dimensional(v) for v in node.inputs) and all(
            _one_dimensional(v) or _one_element(v) for v in node.inputs
        )
    return False


def _one_element(value: ir.Value) -> bool:
    """A scalar or ``[1]``: a constant, or ``Gather(Shape(v), [i])`` of one index."""
    ints = const_ints(value)
    if ints is not None:
        return len(ints) <= 1
    gather = producer_op(value, "Gather")
    if gather is None or producer_op(gather.inputs[0], "Shape") is None:
        return False
    index = const_ints(gather.inputs[1])
    return index is not None and len(index) <= 1


def _flat_weights(value: ir.Value) -> ir.Value | None:
    """``w`` for ``Flatten(Unsqueeze(w, [2]), axis=2)`` or ``Reshape(w, [-1, 1])``."""
    flatten = producer_op(value, "Flatten")
    if flatten is not None:
        unsq = producer_op(flatten.inputs[0], "Unsqueeze")
        inserts_last = unsq is not None and node_axes(unsq) in ([2], [-1])
        if attr_int(flatten, "axis", 1) == 2 and inserts_last:
            return unsq.inputs[0]
        return None
    reshape = producer_op(value, "Reshape")
    if reshape is not None and const_ints(reshape.inputs[1]) == [-1, 1]:
        return reshape.inputs[0]
    return None


def _linear_index(
    index: ir.Value, s: ir.Value, t: ir.Value, k: int, w: ir.Value
) -> list[ir.Node] | None:
    """``[Add, Mul]`` when ``index`` is ``s + t * k`` (operands in either order), else None."""
    add = producer_op(index, "Add")
    if add is None:
        return None
    for a, b in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        mul = producer_op(b, "Mul")
        if a is not s or mul is None:
            continue
        for x, y in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            if x is t and is_k(y, k, w):
                return [add, mul]
    return None


def read_weight(
    value: ir.Value, e: int, slots: ir.Value, tokens: ir.Value, k: int, weights_of
) -> tuple:
    """``(w, spelling, nodes)``: ``value`` is ``w[tokens, slots]`` as ``[n, 1]``.

    ``weights_of(v)`` returns ``v`` when it is a ``[T, k]`` value of the routing TopK's values
    (else None): the flat index ``s + t * k`` is only ``w[t, s]`` for ``w`` of width k.
    """
    nodes: list[ir.Node] = []
    reshape = producer_op(value, "Reshape")
    last_target = None
    while reshape is not None:
        nodes.append(reshape)
        last_target = last_target or reshape.inputs[1]
        value = reshape.inputs[0]
        reshape = producer_op(value, "Reshape")
    if last_target is not None and not _two_dims_ending_in_one(last_target):
        raise Refusal(
            f"expert {e}: the routing weight is reshaped by {label(nodes[0])} to a shape not "
            "proved to be [n, 1]"
        )
    gather = producer_op(value, "Gather", "GatherND")
    if gather is None:
        raise Refusal(f"expert {e}: {value.name!r} is not a gather of the routing weights")
    nodes.append(gather)
    if gather.op_type == "Gather":
        w = _flat_weights(gather.inputs[0]) if attr_int(gather, "axis", 0) == 0 else None
        if w is None or weights_of(w) is None:
            raise Refusal(
                f"expert {e}: {label(gather)} does not gather from the flattened [T * k, 1] "
                "routing weights of the mask's TopK"
            )
        index_nodes = _linear_index(gather.inputs[1], slots, tokens, k, w)
        if index_nodes is None:
            if _linear_index(gather.inputs[1], tokens, slots, k, w) is not None:
                raise Refusal(
                    f"expert {e}: {label(gather)} gathers the routing weight at t + s * k "
                    "(token and slot ids swapped), not s + t * k"
                )
            raise Refusal(
                f"expert {e}: {label(gather)} does not gather the routing weight at slot + "
                f"token * {k}"
            )
        nodes += [gather.inputs[0].producer(), *index_nodes]
        return w, "flat", nodes
    unsq = producer_op(gather.inputs[0], "Unsqueeze")
    w = unsq.inputs[0] if unsq is not None and node_axes(unsq) in ([2], [-1]) else None
    if w is None or weights_of(w) is None or attr_int(gather, "batch_dims", 0) != 0:
        raise Refusal(
            f"expert {e}: {label(gather)} does not gather from the [T, k, 1] routing weights of "
            "the mask's TopK"
        )
    concat = producer_op(gather.inputs[1], "Concat")
    if concat is None or len(concat.inputs) != 2 or attr_int(concat, "axis", 0) not in (1, -1):
        raise Refusal(f"expert {e}: {label(gather)}'s indices are not (token, slot) pairs")
    first, second = concat.inputs
    if unsqueezed_last(first, slots) and unsqueezed_last(second, tokens):
        raise Refusal(
            f"expert {e}: {label(gather)} gathers the routing weight at (slot, token), not "
            "(token, slot)"
        )
    if not (unsqueezed_last(first, tokens) and unsqueezed_last(second, slots)):
        raise Refusal(f"expert {e}: {label(gather)}'s indices are not (token, slot) pairs")
    nodes += [unsq, concat, first.producer(), second.producer()]
    return w, "nd", nodes
