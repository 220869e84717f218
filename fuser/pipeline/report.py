"""The fusion report: what fused (op, rule, replaced and kept nodes, attributes), the near misses, the target.

:class:`FusionReport` is a plain dataclass the passes fill and ``to_dict()`` makes JSON-ready;
the passes hand each near miss as a :class:`~onnx_moe_fuse.rewrites.graph.refusals.NearMiss`
record, which the report keeps serialised (:meth:`FusionReport.add_near_miss`) as
``{rule, part, node, reason, root, topk, router, values}``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx_ir as ir

from onnx_moe_fuse.contract import targets as ort_contract
from onnx_moe_fuse.pipeline.common import (
    attr_value,
    fused_nodes,
    rule_name,
)
from onnx_moe_fuse.rewrites.graph.refusals import NearMiss
from onnx_moe_fuse.rewrites.moe.layer_rules import (
    REPLACED_KEY,
)


@dataclass
class FusionReport:
    """What a fusion run did: one entry per emitted node and one per near miss.

    ``fusions``: ``{"op", "name", "rule", "replaced": [node names], "kept": [node names],
    "attributes": {...}}``; ``kept`` names the nodes of the layer's region that stay because a
    value they compute is also used outside the layer, upstream of the experts (a router Softmax
    that is also a graph output).
    ``near_misses``: ``{"rule", "part", "node", "reason", "root", "topk", "router", "values"}``,
    each a :class:`~onnx_moe_fuse.rewrites.graph.refusals.NearMiss` record serialised
    (:meth:`add_near_miss`): ``part`` is the layer part at fault (one of ``tokens, routing,
    fc1, activation, fc2, combine, weights, target, region``, or ``attention prelude``; None
    when no rule matched), ``node`` the node or value the reason is about, ``root`` the node
    whose output the layer would have replaced (its combine), ``topk`` and ``router`` the
    routing TopK and the Softmax/Sigmoid before it (None when unknown), ``values`` every value
    or node the failing check names. Unnamed nodes are written ``OpType(first output)``. Nodes
    are named as in the canonicalised working copy, which keeps the model's names for every
    node it did not rewrite.
    ``canonicalisation``: one line per canonicalisation pass that failed on the working copy
    and was skipped (canonicalisation never changes the model itself).
    ``target``: the runtime the fused nodes were written for (one of
    :data:`onnx_moe_fuse.contract.targets.TARGETS`); a layer whose fused op that runtime
    lacks is a near miss of part ``target``.
    ``quantization``: what ``--quantize`` / ``--accuracy-level`` asked for (``quantize``,
    ``block_size``, ``scheme``, ``accuracy_level``), None when neither was given; each fusion of
    a float layer quantised on request has its own ``quantization`` entry (the scheme and the
    measured error against the float layer).
    ``run``: how the run went, filled by the fronts (:mod:`onnx_moe_fuse.progress`): the tool's
    and its libraries' versions, each stage's wall time, the peak memory (empty when the
    pipeline was run directly).
    """

    fusions: list[dict[str, Any]] = field(default_factory=list)
    near_misses: list[dict[str, Any]] = field(default_factory=list)
    canonicalisation: list[str] = field(default_factory=list)
    target: str = ort_contract.DEFAULT_TARGET
    quantization: dict[str, Any] | None = None
    run: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return asdict(self)

    def add_near_miss(self, miss: NearMiss) -> None:
        """Record ``miss`` in its report form (:meth:`NearMiss.to_dict`)."""
        self.near_misses.append(miss.to_dict())


def report_fusions(graph: ir.Graph, report: FusionReport) -> None:
    """Move each new fused node's replaced-nodes marker into a report entry."""
    for node in fused_nodes(graph):
        replaced = json.loads(node.metadata_props.pop(REPLACED_KEY))
        report.fusions.append(
            {
                "op": node.op_type,
                "name": node.name,
                "rule": rule_name(node),
                "replaced": replaced,
                "attributes": {k: attr_value(a) for k, a in node.attributes.items()},
            }
        )
