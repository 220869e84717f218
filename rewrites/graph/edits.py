"""Graph edits the layer-form passes share: a node's ancestors, and removing what a rewrite left dead.

A layer-form pass (``sorted_experts``, ``expert_loop``) replaces a block's output with the
per-slot form and then removes the block: :func:`remove_dead` takes the block's nodes
(:func:`ancestors` of the replaced node) and removes, in reverse graph order, those nothing uses
any more, with the initializers only they read.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["ancestors", "remove_dead"]


def ancestors(node: ir.Node) -> list[ir.Node]:
    """Every node ``node`` depends on (in the main graph), nearest first."""
    seen: dict[int, ir.Node] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        for v in n.inputs:
            p = v.producer() if v is not None else None
            if p is not None and id(p) not in seen:
                seen[id(p)] = p
                stack.append(p)
    return list(seen.values())


def remove_dead(graph: ir.Graph, candidates: list[ir.Node]) -> None:
    """Remove the candidates nothing uses any more (reverse graph order), and their constants.

    An initializer goes only when the removed nodes were its last users: a weight shared with
    the rest of the model stays.
    """
    order = {id(n): i for i, n in enumerate(graph)}
    freed: dict[int, ir.Value] = {}
    for node in sorted(candidates, key=lambda n: -order.get(id(n), -1)):
        if id(node) not in order:
            continue
        if any(o.uses() or o.is_graph_output() for o in node.outputs):
            continue
        freed.update((id(v), v) for v in node.inputs if v is not None and v.is_initializer())
        graph.remove(node, safe=True)
    for value in freed.values():
        if not value.uses() and not value.is_graph_input() and not value.is_graph_output():
            graph.initializers.pop(value.name, None)
