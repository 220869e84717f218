"""Why a layer whose combine splits the token rows did not fuse: its other parts, named.

``canonical/spellings/split_rows.py`` moves a ``[B, S]`` split out of a combine only when it proves the
weights and the expert outputs split the same way. When it cannot (the router reads other rows,
the TopK runs over another axis, the dims are unknown), no layer rule matches the combine, and
the near miss would only say the layer is not recognised. This diagnosis says more: on a
throw-away clone of the working copy, the rules' diagnostic twins move every split out on its
structure alone (``split_rows_rules(proved=False)``: not exact, never emitted), the MoE layer
rules run there in probe mode, and their refusal for each TopK is what the near miss reports,
after the fact that the split itself was not proved.

This is a third run of the rules, on a throw-away clone, and it stays one: no run of the pass
sees a graph with the unproved split moved out. A traced run applies no rewrite, so the twins
cannot move the split in the probe run; and the real run must never see them (they are not
exact, and on their structure alone they also match the combines of layers that do fuse). It
runs only when a split combine is there and a TopK is otherwise "not recognised".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.pipeline.near_misses import NearMissTracer
from onnx_moe_fuse.rewrites.canonical.spellings.split_rows import split_rows_rules
from onnx_moe_fuse.rewrites.graph.fresh_names import FreshNames
from onnx_moe_fuse.rewrites.graph.refusals import NearMiss, Refusal
from onnx_moe_fuse.rewrites.moe.layer_rules import moe_layer_rule_set

__all__ = ["SPLIT_UNPROVED", "split_rows_diagnosis"]

SPLIT_UNPROVED = (
    "the combine splits the token rows (a Reshape of the expert outputs and of the routing "
    "weights to [B, S, ...]) and the two splits are not proved the same"
)


def _has_split_combine(graph: ir.Graph) -> bool:
    """A ``Mul`` of two Reshapes' outputs (one through an Unsqueeze): a split combine."""
    for node in graph:
        if node.op_type != "Mul" or len(node.inputs) != 2:
            continue
        producers = [v.producer() if v is not None else None for v in node.inputs]
        ops = sorted(p.op_type if p is not None else "" for p in producers)
        if ops == ["Reshape", "Unsqueeze"]:
            unsq = next(p for p in producers if p is not None and p.op_type == "Unsqueeze")
            inner = unsq.inputs[0].producer() if unsq.inputs and unsq.inputs[0] else None
            if inner is not None and inner.op_type == "Reshape":
                return True
    return False


def split_rows_diagnosis(
    work: ir.Model, emit: Iterable[str], refusals: Sequence[Refusal] = ()
) -> dict[str, NearMiss]:
    """``{TopK output name: the rules' first refusal}`` once the unproved splits are moved out.

    Empty when the working copy has no split combine (the common case: nothing is cloned).
    ``refusals``: the canonical passes' records, as for the pass's own tracer.
    """
    if not _has_split_combine(work.graph):
        return {}
    copy = work.clone()
    names = FreshNames(copy, "diagnosis")
    opset = copy.opset_imports.get("", 1)
    rules = pattern.RewriteRuleSet(split_rows_rules(names, opset, proved=False))
    if not rules.apply_to_model(copy):
        return {}
    tracer = NearMissTracer(refusals)
    moe_layer_rule_set(frozenset(emit), probe=True, splice=True).apply_to_model(copy, tracer=tracer)
    found: dict[str, NearMiss] = {}
    for attempt in tracer.attempts:
        if attempt.topk is not None and attempt.topk.outputs:
            found.setdefault(attempt.topk.outputs[0].name or "", attempt.near_miss())
    return found
