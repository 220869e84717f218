"""Canonicalise MoE layers recognised by what they compute into the per-slot form.

:class:`CanonicalMeaningPass` interprets the nodes around each routing TopK
(:mod:`.interpret`: every value as an indexed expression over tokens, slots, experts and
features), and where the layer's output holds the fused op's contract (:mod:`.contract`), writes
the per-slot form the layer rules take (:mod:`.emit`). It is exact: every op it describes is
described by what it computes (a Reshape regroups index factors, a Gather at the ids selects
experts, a scatter-add at the rows' tokens sums over the slots), and the per-slot form computes
the same expression. Where a layer is not the contract, the pass records why (a
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` of stage ``meaning`` naming the part, the
first node whose meaning departs, what it computes and what the layer needed), which the near
miss carries. The pipeline runs it on the layers the earlier forms did not bring to the rules
(``only``): the exporter forms' own passes stay the fast path.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.meaning.contract import layer_parts
from onnx_moe_fuse.rewrites.canonical.experts.meaning.emit import write_per_slot
from onnx_moe_fuse.rewrites.canonical.experts.meaning.interpret import (
    DepartureAt,
    Interpretation,
    interpret_layer,
    router_rows,
    twins,
)
from onnx_moe_fuse.rewrites.canonical.experts.meaning.layout import Departure
from onnx_moe_fuse.rewrites.canonical.experts.meaning.rounds import round_departure
from onnx_moe_fuse.rewrites.canonical.experts.meaning.values import value_dims
from onnx_moe_fuse.rewrites.graph.refusals import MEANING, Refusal

__all__ = ["CanonicalMeaningPass", "analyse_topk", "part_of"]

GROUPED_MATMUL_OPSET = 29

#: The layer part a departure at each progress is in.
_PARTS = {
    -1: "routing",
    0: "tokens",
    1: "fc1",
    2: "activation",
    3: "fc2",
    4: "combine",
    5: "combine",
    6: "combine",
}


def part_of(progress: int) -> str:
    """The part named by a departure after a value of ``progress``."""
    return _PARTS.get(progress, "fc1")


def _experts(topk: ir.Node) -> int | None:
    dims = value_dims(topk.inputs[0]) if topk.inputs else None
    axis = topk.attributes.get("axis")
    if dims is None or (axis is not None and axis.value not in (-1, len(dims) - 1)):
        return None
    last = dims[-1]
    return None if last.syms else last.coef


def _off_the_expert_axis(topk: ir.Node) -> DepartureAt | None:
    """A routing departure for a TopK of a router's scores along other than their expert axis.

    Its indices then number tokens (or batch rows), not experts, whatever reads them; a TopK
    of scores that no router projection of token rows computes is not a routing at all (a
    sampler's, say) and gets no departure.
    """
    dims = value_dims(topk.inputs[0]) if topk.inputs else None
    axis = topk.attributes.get("axis")
    if dims is None or axis is None or len(topk.outputs) < 2 or dims[-1].syms:
        return None
    if router_rows(topk) is None:
        return None
    why = (
        f"a selection along axis {axis.value} of its router scores (of shape "
        f"[{', '.join(str(d) for d in dims)}]), not along their last axis, the "
        f"{dims[-1].coef} experts: its indices do not number experts"
    )
    return DepartureAt(topk, why, -1, ())


def analyse_topk(topk: ir.Node, order: dict[int, int]) -> tuple[Interpretation | None, object]:
    """The interpretation around ``topk`` and its :class:`~.contract.LayerParts` or departure."""
    experts = _experts(topk)
    if experts is None:
        off_axis = _off_the_expert_axis(topk)
        if off_axis is None:
            return None, None
        return Interpretation(topk, None, 0, value_dims(topk.inputs[0])[-1].coef), off_axis
    if len(topk.outputs) < 2:
        return None, None
    in_rounds = round_departure(topk)
    if in_rounds is not None:  # a top-1 round of a selection: the router, not the layer
        concat, parts, ok = in_rounds
        what = (
            f"a Concat of top-1 rounds' indices ({parts})"
            if concat is not topk
            else f"{parts}, one top-1 round of a selection in rounds"
        )
        why = what + (
            "; the layer is analysed at the TopK of all rounds" if ok
            else "; these are not the columns of one top-k"
        )  # fmt: skip
        return Interpretation(topk, None, 1, experts), DepartureAt(concat, why, -1, ())
    found = interpret_layer(topk, order, experts)
    if found.tokens is None:
        why = "a selection whose scores are not a router projection of token rows"
        return found, DepartureAt(topk, why, 0, ())
    if not found.meanings:  # seeded nothing: the router reads rows of another rank
        why = (
            f"a selection over router rows '{found.tokens.name}' that are not [T, H] token rows "
            "(rank-3 tokens routed without flattening are not read by this analysis yet)"
        )
        return found, DepartureAt(topk, why, 0, ())
    if found.output is None:
        furthest = found.furthest()
        if furthest is None:
            return found, DepartureAt(topk, "a selection whose indices nothing reads", 1, ())
        return found, furthest
    try:
        return found, layer_parts(found, order)
    except Departure as why:
        node = found.output.producer()
        return found, DepartureAt(node, str(why), 6, ()) if node is not None else None


class CanonicalMeaningPass(ir.passes.InPlacePass):
    """Rewrite layers whose meaning is the fused op's contract into the per-slot form."""

    def __init__(self, refusals: list[Refusal] | None = None, only: Iterable[str] | None = None):
        """``refusals`` receives why a layer is left; ``only``: TopK output names to analyse."""
        super().__init__()
        self.refusals = refusals if refusals is not None else []
        self.only = None if only is None else frozenset(only)
        self.rewritten: list[ir.Node] = []  # the TopKs whose layers were rewritten

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Analyse each routing TopK of the main graph; rewrite the layers that hold the contract."""
        graph = model.graph
        topks = [
            n
            for n in graph
            if n.op_type == "TopK" and (self.only is None or n.outputs[0].name in self.only)
        ]
        modified = False
        order: dict[int, int] = {}
        done: set[int] = set()  # rewritten TopKs and their twins (the same selection)
        for topk in topks:
            if id(topk) in done:
                continue
            if not order:  # graph positions, again after each rewrite (it adds nodes)
                order = {id(n): i for i, n in enumerate(graph)}
            try:
                found, outcome = analyse_topk(topk, order)
            except Exception:  # noqa: BLE001 - a graph the analysis cannot read: no rewrite
                # (it only reads the graph, so nothing is half-done; the layer stays as it is)
                continue
            if found is None or outcome is None:
                continue
            if isinstance(outcome, DepartureAt):
                self.refusals.append(_refusal(outcome).recorded_by(MEANING, topk))
                continue
            write_per_slot(graph, found, outcome)  # type: ignore[arg-type]
            # a twin's TopK is the same selection: the rules' refusals may name either
            self.rewritten.extend((topk, *twins(topk)))
            done.update(id(t) for t in (topk, *twins(topk)))
            modified = True
            order = {}
        if modified:
            current = int(graph.opset_imports.get("", 1))
            graph.opset_imports[""] = max(current, GROUPED_MATMUL_OPSET)
        return ir.passes.PassResult(model, modified)


def _refusal(departure: DepartureAt) -> Refusal:
    return Refusal(
        departure.sentence(),
        departure.node,
        part=departure.part or part_of(departure.progress),
        expected=departure.expected,
    )
