"""Fresh value and node names for the canonicalisation passes: one allocator for all of them.

The splice finds a fused layer's boundary values in the original graph by name
(``fuser/pipeline/splice.py``), so a pass that adds a value must give it a name that collides with no
name anywhere in the model (graphs, subgraphs, functions; values and nodes), nor with another
fresh one. Each pass tags its names (``x__folded3``, ``x__canon7``) so that a reader of a
working copy sees which pass made a value.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["FreshNames"]


def _taken_names(owner: ir.Model | ir.Graph) -> set[str]:
    graphs: list[ir.Graph | ir.Function]
    if isinstance(owner, ir.Model):
        graphs = [owner.graph, *owner.functions.values()]
    else:
        graphs = [owner]
    taken: set[str] = set()
    for graph in graphs:
        taken.update(v.name for v in [*graph.inputs, *graph.outputs] if v.name)
        if isinstance(graph, ir.Graph):
            taken.update(graph.initializers)
        for node in ir.traversal.RecursiveGraphIterator(graph):
            if node.name:
                taken.add(node.name)
            taken.update(v.name for v in [*node.inputs, *node.outputs] if v is not None and v.name)
    return taken


class FreshNames:
    """Names that collide with none in the model (or graph), nor with each other."""

    def __init__(
        self, owner: ir.Model | ir.Graph, tag: str = "canon", *, base_when_free: bool = False
    ) -> None:
        """Collect every name of ``owner``; new names read ``<base>__<tag><n>``.

        ``base_when_free``: hand out ``base`` itself while no value or node has it (the
        weight-layout pass names folded tensors ``<output>_quantized``, ``<output>_scale``).
        """
        self._taken = _taken_names(owner)
        self._tag = tag
        self._base_when_free = base_when_free
        self._counter = 0
        #: The names handed out, i.e. the values and nodes this pass created.
        self.created: set[str] = set()

    def __call__(self, base: str | None) -> str:
        """A new name built from ``base`` (the value or node the new one derives from)."""
        if self._base_when_free and base and base not in self._taken:
            self._taken.add(base)
            self.created.add(base)
            return base
        stem = f"{base or 'v'}__{self._tag}"
        while True:
            self._counter += 1
            name = f"{stem}{self._counter}"
            if name not in self._taken:
                self._taken.add(name)
                self.created.add(name)
                return name

    fresh = __call__
