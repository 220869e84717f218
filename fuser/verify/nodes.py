"""A ModelProto's nodes for the verifier: all of them, how messages name one, how one is refused."""

from __future__ import annotations

from collections.abc import Iterator

import onnx

__all__ = ["describe_node", "iter_nodes", "not_supported"]


def describe_node(node: onnx.NodeProto) -> str:
    """``com.microsoft.QMoE node 'moe_0'`` (or the first output's name for an unnamed node)."""
    op = f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
    if node.name:
        return f"{op} node {node.name!r}"
    first = next((o for o in node.output if o), "")
    return f"{op} node (unnamed, producing {first!r})"


def _graph_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graph_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graph_nodes(g)


def iter_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node of the model: main graph, subgraphs and model-local functions."""
    yield from _graph_nodes(model.graph)
    for function in model.functions:
        yield from function.node


def not_supported(op: str, what: str) -> NotImplementedError:
    """The reference path's refusal of a node it cannot compute: ``"<op>: <what> is not ..."``.

    ``op`` as messages name it (``com.microsoft.QMoE``; a default-domain op by its type).
    """
    return NotImplementedError(f"{op}: {what} is not supported by the reference path")
