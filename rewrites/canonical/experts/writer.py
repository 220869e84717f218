"""Write new nodes into a working copy: fresh names, constants, and taking over old names.

:class:`GraphWriter` is what the layer-form passes share when they write the per-slot form
(:mod:`.dense.emit`, :mod:`.meaning.emit`): every name it makes is new in the graph
(``<prefix>/<base>``), new nodes are collected in order for one ``insert_before``, and a new node
that stands for a removed one takes over its name and its outputs' names afterwards, so the
layer rules' near misses name what the user's model has.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

__all__ = ["GraphWriter", "all_names"]


def all_names(graph: ir.Graph) -> set[str]:
    """Every value, initializer and node name of ``graph`` (subgraphs included)."""
    names = {v.name for v in graph.inputs if v.name}
    names |= set(graph.initializers)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        names |= {o.name for o in node.outputs if o.name}
        if node.name:
            names.add(node.name)
    return names


class GraphWriter:
    """Fresh names, initializers and nodes for one rewrite of ``graph``."""

    def __init__(self, graph: ir.Graph, prefix: str) -> None:
        """Names are made unique against all of ``graph``, under ``prefix``."""
        self.graph = graph
        self.names = all_names(graph)
        self.prefix = prefix
        self.new_nodes: list[ir.Node] = []
        self.stands_for: list[tuple[ir.Node, ir.Node]] = []  # (new node, the old node it replaces)

    # -- names and constants ------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        """A name not used anywhere in the graph yet."""
        name, n = f"{self.prefix}/{base}", 1
        while name in self.names:
            n += 1
            name = f"{self.prefix}/{base}_{n}"
        self.names.add(name)
        return name

    def initializer(self, base: str, array: np.ndarray) -> ir.Value:
        """A new initializer holding ``array`` (ml_dtypes int4/uint4 included)."""
        name = self.fresh(base)
        tensor = ir.tensor(array, name=name)
        value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype))
        value.const_value = tensor
        self.graph.register_initializer(value)
        return value

    def ints(self, base: str, values: list[int]) -> ir.Value:
        """A new ``int64`` 1-D initializer."""
        return self.initializer(base, np.array(values, dtype=np.int64))

    def node(
        self, op: str, inputs, base: str, output_count: int = 1, domain: str = "", **attrs
    ) -> ir.Node:
        """A new node with fresh output names (appended to ``new_nodes``).

        ``attrs`` are Python values or ``ir.Attr`` objects (copied).
        """
        outs = [
            ir.Value(name=self.fresh(f"{base}_{i}" if output_count > 1 else base))
            for i in range(output_count)
        ]
        converted = [
            ir.Attr(k, v.type, v.value) if isinstance(v, ir.Attr) else None
            for k, v in attrs.items()
        ]
        plain = {k: v for k, v in attrs.items() if not isinstance(v, ir.Attr)}
        attributes = [a for a in converted if a is not None]
        attributes += list(ir.convenience.convert_attributes(plain))
        node = ir.Node(
            domain, op, list(inputs), attributes, outputs=outs, name=self.fresh(f"{base}/{op}")
        )
        self.new_nodes.append(node)
        return node

    # -- taking over -------------------------------------------------------------------------
    def take_over(self, old: ir.Value, new: ir.Value) -> None:
        """``new`` replaces ``old`` everywhere (graph outputs included) and takes its name."""
        name = old.name
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        old.name = self.fresh("dense_out")
        new.name = name
        new.type, new.shape = old.type, old.shape

    def take_over_node_names(self, root: ir.Node) -> None:
        """Each new node standing for a removed one takes its name, and its outputs' names.

        Only names nothing in the graph has now; the final ReduceSum's output has the layer
        output's name already.
        """
        taken = all_names(self.graph)
        for new, old in self.stands_for:
            if old.graph is not None:
                continue
            if old.name and old.name not in taken:
                new.name = old.name
                taken.add(old.name)
            if old is root:
                continue
            for n_out, o_out in zip(new.outputs, old.outputs, strict=True):
                if o_out.name and o_out.name not in taken:
                    n_out.name = o_out.name
                    taken.add(o_out.name)

    def remove_dead(self, values: list[ir.Value]) -> None:
        """Remove what fed ``values`` and is used by nothing now, walking up (initializers too)."""
        todo = [v for v in values if v is not None]
        while todo:
            v = todo.pop()
            if v.uses() or v.is_graph_output() or v.is_graph_input():
                continue
            node = v.producer()
            if node is not None and node.graph is None:
                continue  # removed already (a value can feed several nodes)
            if node is not None and all(
                not o.uses() and not o.is_graph_output() for o in node.outputs
            ):
                todo.extend(i for i in node.inputs if i is not None)
                self.graph.remove(node, safe=True)
            elif node is None and v.is_initializer() and v.name in self.graph.initializers:
                del self.graph.initializers[v.name]
