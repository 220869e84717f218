"""Read the combine of a dense MoE layer: the sum over all E experts of mask * output.

Used by :mod:`.dense_experts`, after :mod:`.mask` has read the mask. The layer output is
``sum_e dense[:, e] * y_e``, spelled as an ``Add`` tree (chain or balanced) of
``Mul(y_e, column_e)`` over separate expert outputs, or, over stacked outputs ``Y [E, T, H]``,
``ReduceSum(Mul(Y, Unsqueeze(Transpose(dense), -1)), 0)``,
``Squeeze(MatMul(Unsqueeze(dense, 1), Transpose(Y, [1, 0, 2])), 1)`` or
``Einsum("te,eth->th", dense, Y)`` (any letters, either operand order). Substituting ``dense``,
``sum_e dense[t, e] y_e(x_t) = sum_j w[t, j] y_{idx[t, j]}(x_t)``: the per-slot layer. A failed
proof raises :class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` tagged part ``combine``.

The Einsum is read here as well as lowered by
:mod:`~onnx_moe_fuse.rewrites.canonical.spellings.einsum`: that lowering needs both operands'
element types, and the mask's is unknown where a model records types only at its boundary
(a ``OneHot``'s type is its values', which the type walk does not follow), so the Einsum can
reach this pass as it was written. Its equation is parsed by that module's
:func:`~onnx_moe_fuse.rewrites.canonical.spellings.einsum.parse_equation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.dense.consts import (
    axes_are,
    consumers,
    is_op,
    only_consumer,
    other_operand,
)
from onnx_moe_fuse.rewrites.canonical.experts.dense.mask import DenseWeights
from onnx_moe_fuse.rewrites.canonical.experts.dense.routing import Routing
from onnx_moe_fuse.rewrites.canonical.spellings.einsum import parse_equation
from onnx_moe_fuse.rewrites.graph.facts import attr_int, attr_str, label
from onnx_moe_fuse.rewrites.graph.refusals import Refusal, part

__all__ = ["Combine", "read_combine", "split_rows_outputs"]


@dataclass
class Combine:
    """The sum over all experts, ending at ``root``; ``nodes`` are the combine's own nodes.

    The expert outputs it weights: ``per_expert`` (expert e -> ``y_e [T, H]``, the Add-tree
    form) or ``stacked`` (``Y [E, T, H]``).
    """

    root: ir.Node
    per_expert: dict[int, ir.Value] | None  # expert -> y_e [T, H]
    stacked: ir.Value | None  # Y [E, T, H]
    nodes: list[ir.Node] = field(default_factory=list)


def _add_leaves(value: ir.Value, terms: dict[int, int], out: list[int], top: bool) -> bool:
    """Collect the terms under an Add tree at ``value``; False if a leaf is not a term.

    Inner Add outputs must feed only their parent Add (the top one may be used anywhere).
    """
    if id(value) in terms:
        out.append(terms[id(value)])
        return True
    node = value.producer()
    if not is_op(node, "Add"):
        return False
    if not top and (len(consumers(value)) != 1 or value.is_graph_output()):
        return False
    return all(_add_leaves(v, terms, out, False) for v in node.inputs)


def _combine_columns(mask: DenseWeights, routing: Routing) -> Combine:
    terms: dict[int, int] = {}
    outputs: dict[int, ir.Value] = {}
    nodes: list[ir.Node] = []
    for e, col in mask.columns.items():
        mul = only_consumer(col, f"expert {e}'s weight")
        if not is_op(mul, "Mul"):
            raise Refusal(f"expert {e}'s weight does not multiply an expert output", mul)
        outputs[e] = other_operand(mul, col)
        terms[id(mul.outputs[0])] = e
        nodes.append(mul)
    # Walk up from one term to the highest Add whose leaves are all terms.
    value = nodes[0].outputs[0]
    root, leaves = None, []
    while True:
        users = consumers(value)
        if len(users) != 1 or not is_op(users[0], "Add") or value.is_graph_output():
            break
        found: list[int] = []
        if not _add_leaves(users[0].outputs[0], terms, found, True):
            break
        root, leaves, value = users[0], found, users[0].outputs[0]
    if root is None or sorted(leaves) != list(range(routing.experts)):
        raise Refusal(
            "the combine does not add the weighted outputs of all "
            f"E = {routing.experts} experts exactly once",
            root if root is not None else nodes[0],
        )
    _collect_adds(root.outputs[0], terms, nodes)
    return Combine(root, outputs, None, nodes)


def _collect_adds(value: ir.Value, terms: dict[int, int], nodes: list[ir.Node]) -> None:
    if id(value) in terms:
        return
    node = value.producer()
    nodes.append(node)
    for v in node.inputs:
        _collect_adds(v, terms, nodes)


def _perm(node: ir.Node | None) -> list[int] | None:
    if not is_op(node, "Transpose"):
        return None
    attr = node.attributes.get("perm")
    return None if attr is None else [int(p) for p in attr.value]


def _combine_dense(mask: DenseWeights) -> Combine:
    dense = mask.dense
    user = only_consumer(dense, "the dense routing weights")
    nodes: list[ir.Node] = [user]
    if _perm(user) == [1, 0]:  # ReduceSum(Mul(Y, Unsqueeze(Transpose(dense), -1)), 0)
        unsq = only_consumer(user.outputs[0], "the transposed dense weights")
        if is_op(unsq, "Reshape"):  # the [B, S] split that the split-rows spelling did not undo
            raise Refusal(
                f"{label(unsq)}: the dense routing weights are split into token rows that are not "
                "proved to be the expert outputs' rows split the same way",
                unsq,
            )
        if not is_op(unsq, "Unsqueeze") or not axes_are(unsq, 3, [2]):
            raise Refusal(f"{label(user)}: the dense weights are not made [E, T, 1]", user)
        mul = only_consumer(unsq.outputs[0], "the [E, T, 1] dense weights")
        red = (
            only_consumer(mul.outputs[0], "the weighted expert outputs")
            if is_op(mul, "Mul")
            else None
        )
        if red is None or not is_op(red, "ReduceSum") or not axes_are(red, 3, [0]):
            raise Refusal(f"{label(unsq)}: the weighted expert outputs are not summed over E", unsq)
        if attr_int(red, "keepdims", 1):
            raise Refusal(f"{label(red)}: keeps the expert axis", red)
        nodes += [unsq, mul, red]
        return Combine(red, None, other_operand(mul, unsq.outputs[0]), nodes)
    if is_op(user, "Unsqueeze") and axes_are(user, 3, [1]):  # MatMul(dense row, Y^T)
        mm = only_consumer(user.outputs[0], "the dense weights row")
        if not is_op(mm, "MatMul") or mm.inputs[0] is not user.outputs[0]:
            raise Refusal(
                f"{label(user)}: the dense weights row does not multiply the experts", user
            )
        tr = mm.inputs[1].producer()
        if _perm(tr) != [1, 0, 2]:
            raise Refusal(f"{label(mm)}: the expert outputs are not transposed to [T, E, H]", mm)
        sq = only_consumer(mm.outputs[0], "the mixed expert outputs")
        if not is_op(sq, "Squeeze") or not axes_are(sq, 3, [1]):
            raise Refusal(f"{label(mm)}: the unit axis of the mixed outputs is not squeezed", mm)
        nodes += [mm, sq]
        if len(consumers(tr.outputs[0])) == 1:
            nodes.append(tr)
        return Combine(sq, None, tr.inputs[0], nodes)
    if is_op(user, "Einsum") and _mixes_stacked_outputs(user, dense):
        return Combine(user, None, other_operand(user, dense), nodes)
    raise Refusal(
        f"{label(user)}: the dense routing weights are not combined with stacked experts", user
    )


def _mixes_stacked_outputs(node: ir.Node, dense: ir.Value) -> bool:
    """``Einsum`` computing ``out[t, h] = sum_e dense[t, e] Y[e, t, h]`` (any letters)."""
    if len(node.inputs) != 2 or node.inputs[0] is node.inputs[1]:
        return False
    eq = parse_equation(attr_str(node, "equation", ""))
    if eq is None:
        return False
    mask, outputs = (eq.first, eq.second) if node.inputs[0] is dense else (eq.second, eq.first)
    if len(mask) != 2 or len(outputs) != 3 or len(eq.out) != 2:
        return False
    t, e = mask
    h = outputs[2]
    return outputs == f"{e}{t}{h}" and eq.out == f"{t}{h}" and len({t, e, h}) == 3


def split_rows_outputs(mask: DenseWeights) -> ir.Value | None:
    """The stacked expert outputs ``Y`` of a combine still split into ``[E, B, S, H]``, or None.

    ``Mul(Reshape(Y, [E, B, -1, H]), Unsqueeze(Reshape(Transpose(dense), [E, B, -1]), 3))``
    where the split was not proved equal (:mod:`~onnx_moe_fuse.rewrites.canonical.spellings.split_rows`): only for a diagnosis,
    which reads the experts from ``Y`` to find what else is wrong (a router over other rows).
    """
    users = consumers(mask.dense) if mask.dense is not None else []
    chain = users[0] if len(users) == 1 and _perm(users[0]) == [1, 0] else None
    for op in ("Reshape", "Unsqueeze", "Mul"):
        if chain is None:
            return None
        nxt = consumers(chain.outputs[0])
        chain = nxt[0] if len(nxt) == 1 and is_op(nxt[0], op) else None
    if chain is None or len(chain.inputs) != 2:
        return None
    split = next((v.producer() for v in chain.inputs if is_op(v.producer(), "Reshape")), None)
    return split.inputs[0] if split is not None else None


def read_combine(mask: DenseWeights, routing: Routing) -> Combine:
    """Prove that the layer output is ``sum_e dense[:, e] * y_e`` over all E experts."""
    with part("combine"):
        if mask.columns is not None:
            return _combine_columns(mask, routing)
        return _combine_dense(mask)
