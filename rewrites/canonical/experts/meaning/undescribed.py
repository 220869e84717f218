"""Why an operand of a departing node has no meaning, where that is a decisive fact of the layer.

The walk of :mod:`.interpret` describes what it reaches forward from the TopK and the router's
token rows; an operand it never reached is a value of the graph it was not seeded with. Two such
operands say, whatever the rest of the layer is, why no fused node computes it:

* the rows the experts project (a ``MatMul`` / ``Einsum`` by gathered expert weights, or a
  ``Gather`` / ``GatherND`` of the rows at a row index) are not the router's rows: the router's
  rows are computed from them by more than a view (a ``Slice`` that reverses the tokens, say),
  or the experts' rows come from graph inputs the router's rows are not computed from (a second
  input). The router then reads other rows than the experts (part ``routing``);
* the expert weights gathered at the ids are computed from a graph input: not constant, so no
  fused node can hold them (part ``weights``: whichever projection reads them).

Anything else stays the walk's own departure. Only the graph's structure is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import Ids, Meaning, Param, RowIndex
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import is_const
from onnx_moe_fuse.rewrites.graph.facts import label

__all__ = ["Decisive", "decisive_operand"]

#: Ops that lay out or repeat rows without computing on them (their first operand is the data;
#: a Concat's every operand is).
_ROW_LAYOUT = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Expand", "Tile",
               "Concat", "Transpose", "Cast")  # fmt: skip
#: Views: the same rows, regrouped (a router on a view of the experts' rows reads their rows).
_VIEWS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")
_DEPTH = 32


@dataclass(frozen=True)
class Decisive:
    """A departure's part and words, where an undescribed operand decides it."""

    part: str
    reason: str


def decisive_operand(
    node: ir.Node, ins: list[Meaning | None], rows: ir.Value | None
) -> Decisive | None:
    """Why ``node`` departs, when an operand the walk never reached decides it (else None).

    ``ins`` are the operands' meanings; ``rows`` the token rows the router projects.
    """
    if rows is None or len(ins) < 2:
        return None
    first, second = node.inputs[0], ins[1]
    if ins[0] is not None or first is None or is_const(first) or second is None:
        return None
    op = node.op_type
    if op in ("Gather", "GatherND") and isinstance(second.term, Ids):
        return _not_constant(node, first)
    row_reader = (op in ("Gather", "GatherND") and isinstance(second.term, RowIndex)) or (
        op in ("MatMul", "Einsum") and isinstance(second.term, Param)
    )
    return _other_rows(node, first, rows) if row_reader else None


def _not_constant(node: ir.Node, data: ir.Value) -> Decisive | None:
    """Expert weights gathered at the ids, computed from a graph input."""
    inputs = _graph_inputs(data)
    if not inputs:
        return None
    names = ", ".join(f"'{v.name}'" for v in inputs)
    what = "a graph input" if data in inputs else f"computed from the graph input {names}"
    return Decisive(
        "weights",
        f"a {node.op_type} at the expert indices of '{data.name}', {what}: expert weights not "
        "constant, which no fused node can hold (it repacks constant expert weights)",
    )


def _other_rows(node: ir.Node, operand: ir.Value, rows: ir.Value) -> Decisive | None:
    """Rows the experts project that are not the router's ``rows``."""
    sources = _layout_sources(operand)
    behind = _ancestors(rows)
    shared = [v for v in sources if id(v) in behind]
    rows_at = f"the router projects '{rows.name}'"
    if shared:
        chain = _path(rows, {id(v) for v in shared})
        computing = [n for n in chain if n.op_type not in _VIEWS]
        if chain is None or not computing:
            return None  # a view of the same rows: not decisive
        n = computing[-1]  # the first computing node from the shared rows to the router's
        return Decisive(
            "routing",
            f"a projection by the experts of rows of '{operand.name}', but {rows_at}, computed "
            f"from them by {n.op_type} '{label(n)}': the router reads other rows than the experts",
        )
    inputs = [v for v in sources if v.is_graph_input()]
    if not inputs or any(id(v) in behind for v in _graph_inputs(operand)):
        return None
    names = ", ".join(f"'{v.name}'" for v in inputs)
    return Decisive(
        "routing",
        f"a projection by the experts of rows of the graph input {names}, but {rows_at}, "
        "which is not computed from it: the router reads other rows than the experts",
    )


def _layout_sources(value: ir.Value) -> list[ir.Value]:
    """``value`` and the values it lays out or repeats (through :data:`_ROW_LAYOUT`)."""
    seen, todo, out = set(), [value], []
    while todo and len(out) < _DEPTH:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        out.append(v)
        node = v.producer()
        if node is None or node.op_type not in (*_ROW_LAYOUT, "Gather", "GatherND"):
            continue
        data = node.inputs if node.op_type == "Concat" else node.inputs[:1]
        todo.extend(i for i in data if i is not None and not is_const(i))
    return out


def _ancestors(value: ir.Value) -> set[int]:
    """The ``id`` s of ``value`` and every non-constant value it is computed from (bounded)."""
    seen: set[int] = set()
    todo = [value]
    while todo and len(seen) < 8 * _DEPTH:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        node = v.producer()
        if node is not None:
            todo.extend(i for i in node.inputs if i is not None and not is_const(i))
    return seen


def _graph_inputs(value: ir.Value) -> list[ir.Value]:
    """The graph inputs ``value`` is computed from (bounded)."""
    seen: set[int] = set()
    todo, out = [value], []
    while todo and len(seen) < 8 * _DEPTH:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if v.is_graph_input():
            out.append(v)
            continue
        node = v.producer()
        if node is not None:
            todo.extend(i for i in node.inputs if i is not None and not is_const(i))
    return out


def _path(rows: ir.Value, targets: set[int]) -> list[ir.Node] | None:
    """The nodes from ``rows`` back to a value of ``targets``, along the data operands."""
    chain: list[ir.Node] = []
    v: ir.Value | None = rows
    for _ in range(_DEPTH):
        if v is None:
            return None
        if id(v) in targets:
            return chain
        node = v.producer()
        if node is None or not node.inputs:
            return None
        chain.append(node)
        data = [i for i in node.inputs if i is not None and not is_const(i)]
        v = data[0] if data else None
    return None
