"""The accumulation of an expert loop: one scatter-add of each expert's weighted rows.

Each iteration adds expert ``e``'s weighted outputs ``v_e [n, H]`` into the rows ``t_e`` of the
``[T, H]`` accumulator, in one of these spellings (torch's ``index_add_``):

* TorchScript: ``acc_e = Add(acc, ScatterElements(zeros, I, U, axis=0))`` with ``zeros =
  ConstantOfShape(Shape(acc))`` (value 0), ``U = Expand(v_e, Shape(Slice(acc, rows 0:1)))``
  (``[1, H]`` or ``[0, H]``: a broadcast that keeps ``v_e``'s shape) and ``I =
  Expand(Unsqueeze(t_e, 1), Shape(U))``, so ``I[i, j] = t_e[i]``; reduction ``none`` is exact
  because a token appears at most once among an expert's ids (a TopK's ids in one row are
  distinct), ``add`` is exact anyway;
* dynamo: ``acc_e = ScatterND(acc, Unsqueeze(t_e, -1), v_e, reduction='add')``;
* either scatter with reduction ``add`` straight into ``acc``.

:func:`read_step` proves one iteration from its ``v_e`` and ``t_e``; :func:`chain` orders the
iterations into one chain from a start value to the last accumulator, each expert once. Only
reads the graph; refusals are :class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.loops.values import unsqueezed_last
from onnx_moe_fuse.rewrites.canonical.experts.value_proofs import producer_op, uses
from onnx_moe_fuse.rewrites.graph.facts import attr_int, attr_str, const_ints, label
from onnx_moe_fuse.rewrites.graph.refusals import Refusal

__all__ = ["Step", "read_step", "chain"]

_INT64_MAX = 2**63 - 1


@dataclass
class Step:
    """``acc_out = acc_in + scatter of expert e's rows``; ``shape_of`` must be an accumulator."""

    expert: int
    acc_in: ir.Value
    acc_out: ir.Value
    spelling: str
    nodes: list[ir.Node] = field(default_factory=list)
    shape_of: list[ir.Value] = field(default_factory=list)


def _data_users(value: ir.Value) -> list[ir.Node]:
    """The users of ``value`` that read its numbers (a ``Shape`` reads only its shape)."""
    return [n for n in uses(value) if n.op_type not in ("Shape", "Size")]


def _is_shape_of(value: ir.Value | None, of: ir.Value) -> bool:
    node = producer_op(value, "Shape")
    return (
        node is not None
        and node.inputs[0] is of
        and attr_int(node, "start", 0) == 0
        and attr_int(node, "end", None) is None
    )


def _keeping_broadcast(
    shape: ir.Value, hidden: int, e: int
) -> tuple[list[ir.Node], ir.Value | None]:
    """Prove ``Expand(v [n, H], shape)`` is ``v``: ``(nodes, sliced accumulator or None)``.

    ``shape`` is a constant of 1s and ``H``s (rank <= 2), or ``Shape(Slice(acc, [0, 0], [1, >= H],
    [0, 1]))`` whose rows are at most 1 and columns ``H`` when ``acc`` is ``[T, H]`` (which the
    caller checks: the returned value must be an accumulator of the chain).
    """
    ints = const_ints(shape)
    if ints is not None:
        if len(ints) <= 2 and all(d in (1, hidden) for d in ints):
            return [], None
        raise Refusal(f"expert {e}: the Expand to {ints} changes the weighted rows' shape")
    node = producer_op(shape, "Shape")
    sl = producer_op(node.inputs[0], "Slice") if node is not None else None
    if sl is None or attr_int(node, "start", 0) != 0 or attr_int(node, "end", None) is not None:
        raise Refusal(f"expert {e}: the Expand of the weighted rows is not proved a no-op")
    args = [const_ints(v) if v is not None else None for v in sl.inputs[1:]]
    starts, ends = args[0], args[1]
    axes = args[2] if len(args) > 2 else list(range(len(starts or [])))
    steps = args[3] if len(args) > 3 and sl.inputs[4] is not None else [1] * len(starts or [])
    if starts is None or ends is None or axes is None or steps is None:
        raise Refusal(f"expert {e}: {label(sl)} has bounds that are not constant")
    bounds = dict(zip(axes, zip(starts, ends, steps, strict=True), strict=True))
    rows = bounds.get(0, (0, _INT64_MAX, 1))
    cols = bounds.get(1, bounds.get(-1, (0, _INT64_MAX, 1)))
    if rows[0] != 0 or rows[1] != 1 or rows[2] != 1 or cols[0] != 0 or cols[2] != 1:
        raise Refusal(f"expert {e}: {label(sl)} is not the first row of the accumulator")
    if cols[1] < hidden or set(bounds) - {0, 1, -1}:
        raise Refusal(f"expert {e}: {label(sl)} cuts the accumulator's columns")
    return [sl], sl.inputs[0]


def _zeros_of(value: ir.Value, acc: ir.Value) -> bool:
    """``value`` is ``ConstantOfShape(Shape(acc))`` holding 0."""
    node = producer_op(value, "ConstantOfShape")
    if node is None or not _is_shape_of(node.inputs[0], acc):
        return False
    attr = node.attributes.get("value")
    return attr is None or not np.any(attr.value.numpy())


def read_step(v: ir.Value, tokens: ir.Value, e: int, hidden: int) -> Step:
    """The iteration adding expert ``e``'s weighted rows ``v`` at the accumulator's ``tokens``."""
    nodes: list[ir.Node] = []
    shape_of: list[ir.Value] = []
    updates = v
    users = _data_users(v)
    if len(users) == 1 and users[0].op_type == "Expand" and users[0].inputs[0] is v:
        expand = users[0]
        more, sliced = _keeping_broadcast(expand.inputs[1], hidden, e)
        nodes += [expand, *more]
        shape_of += [sliced] if sliced is not None else []
        updates = expand.outputs[0]
        users = _data_users(updates)
    if len(users) != 1 or users[0].op_type not in ("ScatterElements", "ScatterND"):
        raise Refusal(
            f"expert {e}: its weighted rows {v.name!r} are not scattered into the accumulator "
            "(once)"
        )
    scatter = users[0]
    nodes.append(scatter)
    data, index, upd = scatter.inputs[:3]
    if upd is not updates:
        raise Refusal(f"expert {e}: {label(scatter)} scatters its rows as indices or data")
    if scatter.op_type == "ScatterND":
        if not unsqueezed_last(index, tokens):
            raise Refusal(f"expert {e}: {label(scatter)} does not scatter at its token ids")
        nodes.append(index.producer())
    else:
        expand = producer_op(index, "Expand")
        if attr_int(scatter, "axis", 0) != 0 or expand is None:
            raise Refusal(f"expert {e}: {label(scatter)} does not scatter whole rows")
        if not unsqueezed_last(expand.inputs[0], tokens) or not (
            _is_shape_of(expand.inputs[1], updates) or _is_shape_of(expand.inputs[1], v)
        ):
            raise Refusal(
                f"expert {e}: {label(scatter)}'s indices are not its token ids repeated along "
                "each row"
            )
        nodes += [expand, expand.inputs[0].producer()]
    reduction = attr_str(scatter, "reduction", "none")
    if reduction == "add":
        return Step(e, data, scatter.outputs[0], scatter.op_type + "_add", nodes, shape_of)
    if reduction != "none":
        raise Refusal(f"expert {e}: {label(scatter)} reduces with {reduction!r}")
    add_users = _data_users(scatter.outputs[0])
    add = add_users[0] if len(add_users) == 1 else None
    if add is None or add.op_type != "Add" or scatter.outputs[0].is_graph_output():
        raise Refusal(
            f"expert {e}: {label(scatter)} overwrites rows without adding them to the accumulator"
        )
    acc = add.inputs[1] if add.inputs[0] is scatter.outputs[0] else add.inputs[0]
    if not _zeros_of(data, acc):
        raise Refusal(
            f"expert {e}: {label(scatter)} scatters into {data.name!r}, which is not zeros "
            "shaped like the accumulator"
        )
    nodes.append(add)
    return Step(e, acc, add.outputs[0], scatter.op_type + "_none", nodes, shape_of)


def chain(steps: list[Step]) -> tuple[ir.Value, list[ir.Value]]:
    """``(start, accumulators)``: the steps form one chain, each step's input the last output.

    Returns the value the first step adds into and every accumulator in order (the last is the
    layer output).
    """
    by_input: dict[int, Step] = {}
    for step in steps:
        if id(step.acc_in) in by_input:
            other = by_input[id(step.acc_in)]
            raise Refusal(
                f"accumulation: experts {other.expert} and {step.expert} both add into "
                f"{step.acc_in.name!r}"
            )
        by_input[id(step.acc_in)] = step
    outputs = {id(s.acc_out) for s in steps}
    starts = [s for s in steps if id(s.acc_in) not in outputs]
    if len(starts) != 1:
        raise Refusal(
            "accumulation: the experts' scatter-adds are not one chain from a single start"
        )
    start = starts[0].acc_in
    current, accs = start, []
    while id(current) in by_input:
        current = by_input.pop(id(current)).acc_out
        accs.append(current)
    if by_input:
        raise Refusal("accumulation: some experts' scatter-adds are off the chain")
    return start, accs
