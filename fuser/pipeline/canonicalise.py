"""Run the canonicalisation passes on a working copy, skipping any pass that fails.

Canonicalisation must never stop a fusion run: a pass that raises on some model (a bug, or an
op it did not expect) is reported and skipped, and the working copy is rebuilt without it, so
the rules still see a consistent graph. The model the user gave is never touched here.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.pipeline.splice import ORIGIN_KEY
from onnx_moe_fuse.rewrites.canonical.passes import canonicalisation_passes
from onnx_moe_fuse.rewrites.graph.refusals import Refusal

__all__ = ["canonicalise"]


def canonicalise(work: ir.Model, refusals: list[Refusal] | None = None) -> list[str]:
    """Canonicalise ``work`` in place; return one line per pass that failed and was skipped.

    A failing pass may have half-rewritten the graph, so the whole sequence is re-run on a
    fresh state: the passes that had succeeded run again on a new clone taken before any of
    them, which the caller's model then takes over. ``refusals`` receives the passes' records
    of the layers they left as they were (of the final run only: the others' graphs are gone).
    """
    if refusals is None:
        refusals = []
    pristine = work.clone()
    _copy_origin(work.graph, pristine.graph, ORIGIN_KEY)
    skipped: list[str] = []
    failed: set[int] = set()
    passes = canonicalisation_passes(refusals)
    while True:
        try:
            for i, p in enumerate(passes):
                if i in failed:
                    continue
                current = i
                p(work)
            return skipped
        except Exception as error:  # noqa: BLE001 - any failure of a pass is reported, not raised
            failed.add(current)
            skipped.append(
                f"canonicalisation pass {type(passes[current]).__name__} failed and was "
                f"skipped: {type(error).__name__}: {error}"
            )
            fresh = pristine.clone()
            _copy_origin(pristine.graph, fresh.graph, ORIGIN_KEY)
            _adopt(work, fresh)
            refusals.clear()  # they name nodes of the graph just dropped
            passes = canonicalisation_passes(refusals)


def _copy_origin(src: ir.Graph, dst: ir.Graph, key: str) -> None:
    """Clones do not copy ``meta``: carry the origin tags over, value by value in order."""
    for a, b in zip(_all_values(src), _all_values(dst), strict=True):
        if a.meta.get(key):
            b.meta[key] = True


def _all_values(graph: ir.Graph) -> list[ir.Value]:
    out = [*graph.inputs, *graph.initializers.values()]
    for node in graph:
        out.extend(node.outputs)
    return out


def _adopt(work: ir.Model, fresh: ir.Model) -> None:
    """Make ``work`` hold ``fresh``'s graph (the caller keeps its reference to ``work``)."""
    work.graph = fresh.graph  # opset imports live on the graph
    work.functions.clear()
    work.functions.update(fresh.functions)
