"""onnx-ir passes of the MoE fusion pipeline, composed with ``onnx_ir.passes.PassManager``.

:func:`fusion_pipeline` builds the pipeline :func:`onnx_moe_fuse.fuse` runs::

    FuseMoELayersPass      layer rules (onnx_moe_fuse.rewrites.moe_layer) -> MoE / QMoE;
                           fills a FusionReport with the fusions and the near misses
    FuseQkvPass            RMSNorm + three 4-bit projections (onnx_moe_fuse.rewrites.
                           matmul_nbits_qkv) -> MatMulNBitsQkv; fusions and near misses too
    RemoveDeadCodePass     drop what the fused layers left dead (DequantizeLinear, the router
                           Softmax, Constants, unused initializers); only after a fusion
    LowerOpsetPass         "" : 29 -> 28 once no GroupedMatMul is left (opset 29 adds only
                           GroupedMatMul, and ONNX Runtime 1.32 refuses opset-29 models), and on
                           down to the target's opset past versions whose changes are unused
    FusedNodesCheckPass    postconditions: no private-domain (internal) op survives, and every
                           fused node is an op the target has and carries its attribute set

Every pass knows the ``target`` runtime (:mod:`onnx_moe_fuse.rewrites.ort_contract`): the rules
stay target-free and emit what a layer means; at emission (before a MoE/QMoE node is spliced,
after a MatMulNBitsQkv rewrite) the node gets the target's attribute set, and a node whose op,
activation or dtype the target has no kernel for is not emitted but reported as a near miss of
part ``target`` naming the alternative.

A model in which nothing fused comes out of the pipeline unchanged: the clean-up passes act only
when the report holds a fusion.

Near misses come from a dry run of the same rules with a tracer
(:class:`NearMissTracer`): every match whose ``check`` failed is recorded with the reason, and so
is a whole-pattern match that the rewriter refused because an intermediate value escapes the layer
(with the escaping value named). A TopK whose indices feed expert selections but that no rule
matched at all is reported too, as "not recognised", saying which known unfused form it is when
it can tell: a sort of the ids (grouped_mm exports) or a one-hot mask (a loop over experts).
A router MoE/QMoE cannot express (sigmoid scores, a selection bias, a group-limited top-k, a
scaling factor, PhiMoE's sparse mixer: :mod:`onnx_moe_fuse.rewrites.routers`) is reported as
"router not fusable", naming its form, once per router, with the scores node as ``router``.
Near misses of layers that did fuse in the end are dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import pattern

from onnx_moe_fuse.canonicalise import canonicalise
from onnx_moe_fuse.rewrites import matmul_nbits_qkv as qkv
from onnx_moe_fuse.rewrites import ort_contract
from onnx_moe_fuse.rewrites._moe_analysis import PARTS
from onnx_moe_fuse.rewrites._moe_rule import LAYER_OUT_KEY, TOPK_KEY
from onnx_moe_fuse.rewrites.canonical.dense_experts import DenseRefusal, dense_refusal_for
from onnx_moe_fuse.rewrites.canonical.loop_experts import loop_refusal_for
from onnx_moe_fuse.rewrites.canonical.sorted_experts import sorted_refusal_for
from onnx_moe_fuse.rewrites.moe_layer import (
    FUSED_OPS,
    REPLACED_KEY,
    RULE_CLASSES,
    moe_layer_rule_set,
)
from onnx_moe_fuse.rewrites.routers import classify_router, router_near_miss
from onnx_moe_fuse.rewrites.weight_sink import WeightSink
from onnx_moe_fuse.splice import SpliceRefusal, splice_fused_node, tag_origin

#: Every op the pipeline can emit.
ALL_FUSED_OPS = FUSED_OPS | {qkv.FUSED_OP}

__all__ = [
    "INTERNAL_DOMAIN",
    "FusionReport",
    "NearMissTracer",
    "FuseMoELayersPass",
    "FuseQkvPass",
    "ALL_FUSED_OPS",
    "RemoveDeadCodePass",
    "LowerOpsetPass",
    "FusedNodesCheckPass",
    "fusion_pipeline",
]

#: Private domain for internal ops. The rules work on the standard-ONNX graph directly and never
#: create one; the postcondition keeps it that way.
INTERNAL_DOMAIN = "ai.onnx_moe_fuse.internal"
MS_DOMAIN = "com.microsoft"

#: Ops each default-domain opset adds or changes: the installed onnx's schemas by
#: ``since_version``, and opset 29, past onnx 1.23, which adds GroupedMatMul and changes nothing
#: else (read from onnx-weekly 1.24.0.dev20261026's schema list: the only schema with
#: since_version 29 is GroupedMatMul).
OPSET_CHANGES: dict[int, frozenset[str]] = {
    29: frozenset({"GroupedMatMul"}),
    **{
        version: frozenset(
            s.name
            for s in onnx.defs.get_all_schemas_with_history()
            if s.domain == "" and s.since_version == version
        )
        for version in range(2, onnx.defs.onnx_opset_version() + 1)
    },
}

#: Attributes every emitted node writes for the default target (ORT's defaults differ between
#: builds); :func:`onnx_moe_fuse.rewrites.ort_contract.attribute_names` gives them per target.
REQUIRED_ATTRIBUTES: dict[str, frozenset[str]] = {
    op: ort_contract.attribute_names(op, ort_contract.DEFAULT_TARGET)
    for op in ort_contract.ops_for(ort_contract.DEFAULT_TARGET)
}

_RULE_PREFIXES = (*(cls.__name__ for cls in RULE_CLASSES), f"{qkv.FUSED_OP}[")
_RULE_NAME_TAG = "pkg.onnxscript.rewriter.rule_name"

# onnxscript's matcher refuses a whole-pattern match whose nodes feed values outside the pattern
# with this reason (onnxscript/rewriter/_matcher.py); the tracer turns it into a named escape.
_ESCAPE_REASON = "Matched nodes have other uses preventing replacement."


@dataclass
class FusionReport:
    """What a fusion run did: one entry per emitted node and one per near miss.

    ``fusions``: ``{"op", "name", "rule", "replaced": [node names], "kept": [node names],
    "attributes": {...}}``; ``kept`` names the nodes of the layer's region that stay because a
    value they compute is also used outside the layer, upstream of the experts (a router Softmax
    that is also a graph output).
    ``near_misses``: ``{"rule", "part", "node", "reason", "root", "topk", "router", "values"}``:
    ``part`` is the layer part at fault (one of ``tokens, routing, fc1, activation, fc2,
    combine, weights, target, region``; None when no rule matched), ``node`` the node or value
    the reason is about, ``root`` the node whose output the layer would have replaced (its
    combine), ``topk`` and ``router`` the routing TopK and the Softmax/Sigmoid before it (None
    when unknown), ``values`` every value or node the failing check names. Unnamed nodes are
    written ``OpType(first output)``. Nodes are named as in the canonicalised working copy,
    which keeps the model's names for every node it did not rewrite.
    ``canonicalisation``: one line per canonicalisation pass that failed on the working copy
    and was skipped (canonicalisation never changes the model itself).
    ``target``: the runtime the fused nodes were written for (one of
    :data:`onnx_moe_fuse.rewrites.ort_contract.TARGETS`); a layer whose fused op that runtime
    lacks is a near miss of part ``target``.
    """

    fusions: list[dict[str, Any]] = field(default_factory=list)
    near_misses: list[dict[str, Any]] = field(default_factory=list)
    canonicalisation: list[str] = field(default_factory=list)
    target: str = ort_contract.DEFAULT_TARGET

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return asdict(self)


def _label(node: ir.Node | None) -> str | None:
    if node is None:
        return None
    if node.name:
        return node.name
    out = node.outputs[0].name if node.outputs else ""
    return f"{node.op_type}({out})"


def _source_label(item: ir.Node | ir.Value) -> str:
    if isinstance(item, ir.Node):
        return _label(item) or ""
    return item.name or f"output {item.index()} of {_label(item.producer())}"


@dataclass
class _Attempt:
    rule: str
    root: ir.Node
    reason: str
    topk: ir.Node | None
    router: ir.Node | None
    values: list[str]


def _escape_reason(nodes: Iterable[ir.Node], root: ir.Node) -> tuple[str, list[str]]:
    inside = set(nodes)
    for node in inside:
        for out in node.outputs:
            if node is root:
                continue
            if out.is_graph_output():
                where = "a graph output"
            else:
                users = [u for u, _ in out.uses() if u not in inside]
                if not users:
                    continue
                where = f"used by {users[0].op_type} '{_label(users[0])}' outside the layer"
            name = out.name or f"output {out.index()} of {_label(node)}"
            return (
                f"an intermediate value escapes the layer: '{name}' ({node.op_type} "
                f"'{_label(node)}') is also {where}",
                [name],
            )
    return "an intermediate value of the layer is used outside it", []


class NearMissTracer(pattern.MatchingTracer):
    """A tracer that keeps every refused whole-layer match (the base keeps only the best)."""

    def __init__(self) -> None:
        """Start with no attempts."""
        super().__init__()
        self.attempts: list[_Attempt] = []
        self.successes: set[int] = set()

    def log(self, rule, container, node, match_result, status) -> None:  # noqa: D102
        if status == pattern.MatchStatus.SUCCESS:
            self.successes.add(id(node))
            return
        reason = match_result.reason
        escape = status == pattern.MatchStatus.NO_MATCH and reason == _ESCAPE_REASON
        if status == pattern.MatchStatus.NO_MATCH and not escape:
            return
        topk = router = None
        try:
            values = match_result.bindings.get("topk_values")
            scores = match_result.bindings.get("router_scores")
        except ValueError:  # bindings of an unfinished alternative
            values = scores = None
        if isinstance(values, ir.Value):
            topk = values.producer()
        if isinstance(scores, ir.Value) and scores.producer() is not None:
            if scores.producer().op_type in ("Softmax", "Sigmoid"):
                router = scores.producer()
        if escape:
            reason, names = _escape_reason(match_result.nodes, node)
        else:
            names = [_source_label(s) for s in match_result.failure_nodes_and_values]
        self.attempts.append(_Attempt(str(rule), node, reason, topk, router, names))


def _rule_name(node: ir.Node) -> str | None:
    """The layer rule that emitted ``node``.

    onnxscript tags a replacement node with the rule's name, then appends (", ") the tags the
    replaced nodes carried: an exporter that ran onnxscript rules itself (torch.onnx runs
    ``MaterializeReshapeShape``) leaves e.g. ``"FusedSwiGLUMoELayer[...], MaterializeReshapeShape"``.
    """
    tag = node.metadata_props.get(_RULE_NAME_TAG, "")
    return next((r for r in tag.split(", ") if r.startswith(_RULE_PREFIXES)), None)


def _fused_nodes(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if n.domain == MS_DOMAIN and REPLACED_KEY in n.metadata_props]


def _attr_value(attr: ir.Attr) -> Any:
    """A plain Python value; a FLOAT attribute as the shortest decimal of its float32."""
    v = attr.value
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if attr.type == ir.AttributeType.FLOAT:
        return v if math.isinf(v) else float(str(np.float32(v)))
    return v


_SHAPE_ONLY = ("Reshape", "Unsqueeze", "Squeeze", "Flatten", "Cast")
_GENERIC_UNRECOGNISED = (
    "not recognised: the indices of this TopK select experts, but no MoE layer rule matched the "
    "layer around it (its routing, expert, activation or combine spelling is not one the rules "
    "know)"
)
_SORTED_UNRECOGNISED = (
    "not recognised: the expert ids of this TopK are sorted (a TopK over the flattened ids, i.e. "
    "an argsort) so that each expert's rows are computed as a group of their own, the sorted "
    "per-expert form of grouped_mm exports; no rule takes that spelling, so the layer is left "
    "as it is"
)
_ONE_HOT_UNRECOGNISED = (
    "not recognised: the experts are chosen by a one-hot mask of this TopK's indices (a dense "
    "all-experts form, or a loop over the experts such as a traced eager loop with NonZero per "
    "expert), and the dense-experts canonicalisation could not prove it equal to the selected "
    "experts (a trace of a data-dependent loop may hold only the experts its example input hit), "
    "so the layer is left as it is"
)

_DENSE_UNRECOGNISED = (
    "not recognised: the experts are weighted by this TopK's values scattered into dense [T, E] "
    "routing weights (a dense all-experts form), and the dense-experts canonicalisation could "
    "not prove it equal to the selected experts, so the layer is left as it is"
)


def _sorts_expert_ids(topk: ir.Node) -> bool:
    """True for a TopK that sorts another TopK's indices ascending (an argsort, not a router)."""
    attr = topk.attributes.get("largest")
    if attr is None or attr.value != 0:
        return False
    v = topk.inputs[0] if topk.inputs else None
    for _ in range(8):
        node = v.producer() if v is not None else None
        if node is None:
            return False
        if node.op_type == "TopK":
            return v.index() == 1
        if node.op_type not in _SHAPE_ONLY:
            return False
        v = node.inputs[0]
    return False


_HALF = {ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16"}


def _half_precision(node: ir.Node) -> set[str]:
    """The half-precision float types among ``node``'s inputs."""
    return {_HALF[v.dtype] for v in node.inputs if v is not None and v.dtype in _HALF}


def _expert_ids(node: ir.Node) -> ir.Value | None:
    """The ids a TopK (output 1) or an ArgMax (output 0, a top-1 in torch exports) writes."""
    index = 0 if node.op_type == "ArgMax" else 1
    return node.outputs[index] if len(node.outputs) > index else None


def _half_precision_near(topk: ir.Node, depth: int = 6) -> set[str]:
    """Half-precision types among the values a few nodes downstream of a TopK.

    A float16 export routes in float32 (the router softmax is upcast) and computes the experts
    and the combine in float16: the weights meet the float16 expert outputs a few nodes on.
    """
    found: set[str] = set()
    frontier, seen = [topk], {id(topk)}
    for _ in range(depth):
        nxt = []
        for node in frontier:
            for v in node.outputs:
                if v.dtype in _HALF:
                    found.add(_HALF[v.dtype])
                for user, _ in v.uses():
                    if id(user) not in seen:
                        seen.add(id(user))
                        found.update(_half_precision(user))
                        nxt.append(user)
        frontier = nxt
    return found


def _unrecognised_reason(topk: ir.Node) -> str | None:
    """Why a TopK / ArgMax whose ids select experts matched no rule (None: they select nothing).

    A router that MoE/QMoE cannot express is named first (:mod:`onnx_moe_fuse.rewrites.routers`):
    it is the refusal even where the experts' spelling is one no rule takes.
    """
    ids = _expert_ids(topk)
    if ids is None or _sorts_expert_ids(topk):
        return None
    todo, seen, uses = [ids], 0, set()
    half: set[str] = set()
    while todo and seen < 8:
        v = todo.pop()
        seen += 1
        for user, _ in v.uses():
            if user.op_type in _SHAPE_ONLY:
                todo.extend(user.outputs)
            elif user.op_type == "TopK" and _sorts_expert_ids(user):
                uses.add("argsort")
            else:
                uses.add(user.op_type)
                half.update(_half_precision(user))
    selects = uses & {
        "Gather",
        "GroupedMatMul",
        "GatherND",
        "GatherElements",
        "OneHot",
        "Equal",
        "argsort",
    }
    half.update(_half_precision(topk))
    half.update(_half_precision_near(topk))
    if selects and half:
        return (
            f"not fused: the layer computes in {'/'.join(sorted(half))}; this version fuses "
            "float32 layers only (float16/bfloat16 layers are left as they are)"
        )
    # a router no MoE/QMoE computes is the refusal, whatever else; ids scattered into a dense
    # [T, E] weights tensor (Llama4's code) select experts too
    router = router_near_miss(topk) if selects or "ScatterElements" in uses else None
    if router is not None:
        return router
    if "argsort" in uses:
        # the sorted-experts pass left this block: its proof says which link it could not show
        detail = sorted_refusal_for(topk)
        if detail is None:
            return _SORTED_UNRECOGNISED
        return f"{_SORTED_UNRECOGNISED}; the sorted-experts pass: {detail}"
    if "ScatterElements" in uses and not selects:
        # ids scattered into dense [T, E] weights (gpt-oss's router): the dense-experts pass
        # left the layer, its refusal says which part it could not read
        # (only a recognised layer: DeepSeek's group selection scatters ids into a group mask)
        dense = dense_refusal_for(topk)
        if dense is not None and dense.recognised:
            return f"{_DENSE_UNRECOGNISED}; the dense-experts pass: {dense.part}: {dense.reason}"
    if uses & {"OneHot", "Equal"}:
        # the expert-loop pass left this layer: its proof says which link it could not show
        detail = loop_refusal_for(topk)
        if detail is not None:
            return f"{_ONE_HOT_UNRECOGNISED}; the expert-loop pass: {detail}"
        return _ONE_HOT_UNRECOGNISED
    if uses & {"Gather", "GroupedMatMul", "GatherND", "GatherElements"}:
        return _GENERIC_UNRECOGNISED
    return None


def _emitted(only: Iterable[str] | None) -> frozenset[str]:
    """The ops ``only`` names (default: every op); ``ValueError`` for an unknown one."""
    emit = ALL_FUSED_OPS if only is None else frozenset(only)
    if not emit <= ALL_FUSED_OPS:
        raise ValueError(f"only must name ops among {sorted(ALL_FUSED_OPS)}, got {sorted(emit)}")
    return emit


_RESHAPES = ("Reshape", "Unsqueeze", "Squeeze", "Flatten")


def _activation_dtype(node: ir.Node) -> str | None:
    """``"float32"``, ``"float16"``, ...: the element type of the fused node's activations.

    Input 0 (the tokens) and output 0 share it. A value the rule made (its Reshape of rank-3
    tokens) may not carry its type: then the value it reshapes is read.
    """
    for value in (*node.inputs[:1], *node.outputs[:1]):
        for _ in range(4):
            if value is None:
                break
            if value.dtype is not None:
                return str(value.dtype.numpy())
            producer = value.producer()
            if producer is None or producer.op_type not in _RESHAPES or not producer.inputs:
                break
            value = producer.inputs[0]
    return None


def _target_refusal(node: ir.Node, target: str) -> str | None:
    """Why the fused ``node`` cannot be written for ``target`` (ort_contract's words), or None."""
    activation = node.attributes.get("activation_type")
    return ort_contract.refusal(
        node.op_type,
        activation.value if activation is not None else None,
        target,
        _activation_dtype(node),
    )


def _producer_of(graph: ir.Graph, name: str | None) -> ir.Node | None:
    """The node of ``graph`` whose first output is named ``name``."""
    if not name:
        return None
    return next((n for n in graph if n.outputs and n.outputs[0].name == name), None)


def _apply_target_attributes(node: ir.Node, target: str) -> None:
    """Give the fused ``node`` the attribute set ``target`` takes (ort_contract)."""
    attrs = ort_contract.node_attributes(
        node.op_type, {k: _attr_value(a) for k, a in node.attributes.items()}, target
    )
    node.attributes.clear()
    for attr in ir.convenience.convert_attributes(attrs):
        node.attributes[attr.name] = attr


class FuseMoELayersPass(ir.passes.InPlacePass):
    """Rewrite every provable MoE layer into ``com.microsoft.MoE`` / ``QMoE``.

    ``only`` restricts the ops emitted (``{"MoE"}``, ``{"QMoE"}``; default both), ``target``
    the runtime they are written for: a layer whose op, activation or dtype the target has no
    kernel for stays as it is and becomes a near miss of part ``target``
    (:func:`onnx_moe_fuse.rewrites.ort_contract.refusal`); a fused node gets the target's
    attribute set (:func:`~onnx_moe_fuse.rewrites.ort_contract.node_attributes`) before it is
    spliced. The fusions and near misses are appended to ``report`` (a :class:`FusionReport`,
    shared with the caller).
    """

    def __init__(
        self,
        report: FusionReport | None = None,
        only: Iterable[str] | None = None,
        target: str = ort_contract.DEFAULT_TARGET,
        weight_sink: WeightSink | None = None,
    ):
        """Set up the pass; ``report`` receives what it did, ``weight_sink`` the weights."""
        super().__init__()
        self.weight_sink = weight_sink
        self.emit = _emitted(only) & FUSED_OPS
        self.target = ort_contract.check_target(target)
        self.report = report if report is not None else FusionReport()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Canonicalise a working copy, fuse there, splice into ``model``; fill the report."""
        if not self.emit:
            return ir.passes.PassResult(model, modified=False)
        # the working copy shares tensor objects with the model; some onnx-ir helpers rename a
        # tensor they read (get_const_tensor names a Constant's tensor after its value), so the
        # names are put back afterwards and the model's bytes outside fused layers stay the same
        tensor_names = _shared_tensor_names(model.graph)
        work = model.clone()
        tag_origin(work.graph)
        self.report.canonicalisation.extend(canonicalise(work))

        tracer = NearMissTracer()
        moe_layer_rule_set(self.emit, probe=True, splice=True).apply_to_model(work, tracer=tracer)
        rules = moe_layer_rule_set(self.emit, splice=True, weight_sink=self.weight_sink)
        rules.apply_to_model(work)

        spliced = 0
        fused_roots: set[str] = set()
        fused_topks: set[str] = set()
        for node in _fused_nodes(work.graph):
            layer_out = node.metadata_props.get(LAYER_OUT_KEY, "")
            fused_topks.add(node.metadata_props.get(TOPK_KEY, ""))
            reason = _target_refusal(node, self.target)
            if reason is not None:
                self.report.near_misses.append(
                    _near_miss(
                        rule=_rule_name(node),
                        part="target",
                        node=layer_out,
                        reason=reason,
                        root=layer_out,
                        topk=_label(_producer_of(work.graph, node.metadata_props.get(TOPK_KEY))),
                        router=None,
                        values=[],
                    )
                )
                continue
            _apply_target_attributes(node, self.target)
            try:
                result = splice_fused_node(model, node, layer_out)
            except SpliceRefusal as refusal:
                self.report.near_misses.append(
                    _near_miss(
                        rule=_rule_name(node),
                        part="region",
                        node=refusal.value or layer_out,
                        reason=refusal.reason,
                        root=layer_out,
                        topk=None,
                        router=None,
                        values=[refusal.value] if refusal.value else [],
                    )
                )
                continue
            spliced += 1
            fused_roots.add(layer_out or "")
            self.report.fusions.append(
                {
                    "op": result.node.op_type,
                    "name": result.node.name,
                    "rule": _rule_name(result.node),
                    "replaced": list(result.replaced),
                    "kept": list(result.kept),
                    "attributes": {k: _attr_value(a) for k, a in result.node.attributes.items()},
                }
            )
            for key in (REPLACED_KEY, LAYER_OUT_KEY, TOPK_KEY):
                result.node.metadata_props.pop(key, None)
        self._near_misses(tracer, work, fused_roots, fused_topks)
        for tensor, name in tensor_names:
            if tensor.name != name:
                tensor.name = name
        return ir.passes.PassResult(model, modified=spliced > 0)

    def _near_misses(
        self, tracer: NearMissTracer, work: ir.Model, fused: set[str], fused_topks: set[str]
    ) -> None:
        """Record the refused matches of layers that did not fuse, and unmatched routers."""
        seen: set[tuple[int, str]] = set()
        explained: set[int] = set()
        for a in tracer.attempts:
            root_out = a.root.outputs[0].name if a.root.outputs else None
            topk_out = a.topk.outputs[0].name if a.topk is not None else None
            if a.root.graph is None or root_out in fused or topk_out in fused_topks:
                continue  # the layer fused after all
            key = (id(a.root), a.reason)
            if key in seen:
                continue
            seen.add(key)
            if a.topk is not None:
                explained.add(id(a.topk))
            part, reason = _split_part(a.reason)
            self.report.near_misses.append(
                _near_miss(
                    rule=a.rule,
                    part=part,
                    node=a.values[0] if a.values else _label(a.root),
                    reason=reason,
                    root=_label(a.root),
                    topk=_label(a.topk),
                    router=_label(a.router),
                    values=a.values,
                )
            )
        routers: set[int] = set()
        for node in work.graph:
            if node.op_type not in ("TopK", "ArgMax") or id(node) in explained:
                continue
            if node.outputs[0].name in fused_topks:
                continue
            reason = _unrecognised_reason(node)
            dense = _recognised_dense(node, reason)
            if dense is not None:
                reason = dense.reason  # the pass recognised the layer: its refusal names the part
            if reason is not None:
                # the Softmax/Sigmoid of the router (before or after the TopK), else what it reads
                router = classify_router(node).scores
                if router is None and node.inputs and node.inputs[0] is not None:
                    router = node.inputs[0].producer()
                if reason.startswith("router not fusable") and id(router) in routers:
                    continue  # one near miss per router: PhiMoE's two rounds read one router
                routers.add(id(router))
                self.report.near_misses.append(
                    _near_miss(
                        rule=None,
                        part=dense.part if dense is not None else None,
                        node=dense.node if dense is not None else _label(node),
                        reason=reason,
                        root=None,
                        topk=_label(node),
                        router=_label(router),
                        values=list(dense.values) if dense is not None else [],
                    )
                )


def _recognised_dense(topk: ir.Node, reason: str | None) -> DenseRefusal | None:
    """The dense-experts pass's refusal of a dense layer it recognised, where it explains more.

    For the dense messages (one-hot or scattered ids) only: the pass read this TopK's mask, so
    the layer is a dense MoE, and its refusal names the part, node and reason (a TopK over
    another axis, a router over other rows, weights that are graph inputs).
    """
    if reason is not None and not reason.startswith((_ONE_HOT_UNRECOGNISED, _DENSE_UNRECOGNISED)):
        return None
    dense = dense_refusal_for(topk)
    return dense if dense is not None and dense.recognised else None


def _shared_tensor_names(graph: ir.Graph) -> list[tuple[Any, str | None]]:
    """Every initializer and Constant-attribute tensor of ``graph`` with its name now."""
    out: list[tuple[Any, str | None]] = [
        (v.const_value, v.const_value.name)
        for v in graph.initializers.values()
        if v.const_value is not None
    ]
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.TENSOR and not attr.is_ref():
                out.append((attr.value, attr.value.name))
    return out


def _split_part(reason: str) -> tuple[str | None, str]:
    """``"fc2: the weights ..."`` -> ``("fc2", "the weights ...")`` (the rules' check prefix)."""
    head, sep, rest = reason.partition(": ")
    if sep and head in PARTS:
        return head, rest
    return None, reason


def _near_miss(**fields: Any) -> dict[str, Any]:
    """One near-miss record, keys in report order (see :class:`FusionReport`)."""
    keys = ("rule", "part", "node", "reason", "root", "topk", "router", "values")
    return {k: fields[k] for k in keys}


def _report_fusions(graph: ir.Graph, report: FusionReport) -> None:
    """Move each new fused node's replaced-nodes marker into a report entry."""
    for node in _fused_nodes(graph):
        replaced = json.loads(node.metadata_props.pop(REPLACED_KEY))
        report.fusions.append(
            {
                "op": node.op_type,
                "name": node.name,
                "rule": _rule_name(node),
                "replaced": replaced,
                "attributes": {k: _attr_value(a) for k, a in node.attributes.items()},
            }
        )


class FuseQkvPass(ir.passes.InPlacePass):
    """Rewrite RMSNorm + three 4-bit projections into ``com.microsoft.MatMulNBitsQkv``.

    Runs when ``only`` (default: every op) names MatMulNBitsQkv. Near misses come from the
    rule module's own dry run (:func:`onnx_moe_fuse.rewrites.matmul_nbits_qkv.near_misses`),
    which also sees norms read by other than three projections. When ``target`` has no
    MatMulNBitsQkv kernel (ORT CPU and CUDA), the model is left as it is and every prelude that
    would have fused is a near miss of part ``target`` saying so (found by fusing a clone).
    """

    def __init__(
        self,
        report: FusionReport | None = None,
        only: Iterable[str] | None = None,
        target: str = ort_contract.DEFAULT_TARGET,
        weight_sink: WeightSink | None = None,
    ):
        """Set up the pass; ``report`` receives what it did, ``weight_sink`` the weights."""
        super().__init__()
        self.weight_sink = weight_sink
        self.enabled = qkv.FUSED_OP in _emitted(only)
        self.target = ort_contract.check_target(target)
        self.report = report if report is not None else FusionReport()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Dry-run for near misses, then rewrite; fill the report."""
        if not self.enabled:
            return ir.passes.PassResult(model, modified=False)
        # the rule runs name values and type constants they read; that is put back, so that
        # what does not fuse stays as it was
        names, untyped = _names(model.graph), _untyped(model.graph)
        misses = qkv.near_misses(model)
        reason = ort_contract.refusal(qkv.FUSED_OP, None, self.target)
        count = 0
        if reason is None:
            count = qkv.rules(self.weight_sink).apply_to_model(model)
            _restore_names(names)
            _restore_untyped(untyped)
            for node in _fused_nodes(model.graph):
                if node.op_type == qkv.FUSED_OP:
                    _apply_target_attributes(node, self.target)
            _report_fusions(model.graph, self.report)
        else:
            _restore_names(names)
            _restore_untyped(untyped)
            self._refuse_for_target(model, reason)
        for miss in misses:
            self.report.near_misses.append(
                _near_miss(
                    rule=miss.rule,
                    part="attention prelude",
                    node=miss.values[0] if miss.values else miss.root,
                    reason=miss.reason,
                    root=miss.root,
                    topk=None,
                    router=None,
                    values=list(miss.values),
                )
            )
        return ir.passes.PassResult(model, modified=count > 0)

    def _refuse_for_target(self, model: ir.Model, reason: str) -> None:
        """A near miss for every prelude that would fuse; ``model`` is not changed."""
        tensor_names = _shared_tensor_names(model.graph)
        work = model.clone()
        qkv.rules(self.weight_sink).apply_to_model(work)  # spilled, not kept: memory stays flat
        for node in _fused_nodes(work.graph):
            if node.op_type != qkv.FUSED_OP:
                continue
            replaced = json.loads(node.metadata_props[REPLACED_KEY])
            self.report.near_misses.append(
                _near_miss(
                    rule=_rule_name(node),
                    part="target",
                    node=replaced[0] if replaced else _label(node),
                    reason=reason,
                    root=replaced[0] if replaced else _label(node),
                    topk=None,
                    router=None,
                    values=list(replaced),
                )
            )
        for tensor, name in tensor_names:
            if tensor.name != name:
                tensor.name = name


def _names(graph: ir.Graph) -> list[tuple[ir.Node | ir.Value, str | None]]:
    names: list[tuple[ir.Node | ir.Value, str | None]] = []
    for node in graph:
        names.append((node, node.name))
        names.extend((v, v.name) for v in node.outputs)
    names.extend((v, v.name) for v in graph.inputs)
    return names


def _restore_names(names: list[tuple[ir.Node | ir.Value, str | None]]) -> None:
    for item, name in names:
        if isinstance(item, ir.Node):
            if item.graph is not None and item.name != name:
                item.name = name
        elif item.name != name and (item.producer() is None or item.producer().graph is not None):
            item.name = name


def _untyped(graph: ir.Graph) -> list[tuple[ir.Value, bool, bool]]:
    """Every node output with no type or no shape: ``(value, lacks type, lacks shape)``."""
    return [
        (v, v.type is None, v.shape is None)
        for node in graph
        for v in node.outputs
        if v.type is None or v.shape is None
    ]


def _restore_untyped(untyped: list[tuple[ir.Value, bool, bool]]) -> None:
    """Take back the types and shapes a rule run gave values (onnx-ir's constant readers do)."""
    for value, no_type, no_shape in untyped:
        if no_type:
            value.type = None
        if no_shape:
            value.shape = None


def _fused(report: FusionReport | None) -> bool:
    return report is None or bool(report.fusions)


class _AfterFusionPass(ir.passes.InPlacePass):
    """A clean-up pass that, given a ``report``, acts only when the report records a fusion."""

    def __init__(self, report: FusionReport | None = None):
        """``report``: act only if it holds a fusion (None: always act)."""
        super().__init__()
        self.report = report

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Leave an unfused model as it was; otherwise :meth:`clean`."""
        if not _fused(self.report):
            return ir.passes.PassResult(model, modified=False)
        return self.clean(model)

    def clean(self, model: ir.Model) -> ir.passes.PassResult:
        """The pass's work on a fused model."""
        raise NotImplementedError


class RemoveDeadCodePass(_AfterFusionPass):
    """Remove dead nodes and unused initializers (onnx-ir's ``RemoveUnusedNodesPass``).

    With a ``report``, only when it records a fusion: an unfused model stays as it was, dead code
    it already had included.
    """

    def clean(self, model: ir.Model) -> ir.passes.PassResult:
        """Sweep."""
        return RemoveUnusedNodesPass()(model)


def _uses_op(graph_like: ir.Graph | ir.Function, ops: frozenset[str]) -> bool:
    return any(
        n.domain in ("", "ai.onnx") and n.op_type in ops
        for n in ir.traversal.RecursiveGraphIterator(graph_like)
    )


class LowerOpsetPass(_AfterFusionPass):
    """Lower the default-domain opset to the target's, past versions whose changes are unused.

    Opset 29 only adds ``GroupedMatMul`` (:data:`OPSET_CHANGES`); once fusion removed the last
    one, ``"" : 29`` means the same as ``"" : 28``, which ONNX Runtime 1.32 loads. The same holds
    for any version whose added or changed ops the model does not use, so the pass goes on down
    to the newest opset the target loads (:func:`onnx_moe_fuse.rewrites.ort_contract.max_opset`:
    onnxruntime-webgpu 1.27 stops at 26) and stops at the first version whose changes the model
    uses. With a ``report``, only when it records a fusion.
    """

    def __init__(
        self, report: FusionReport | None = None, target: str = ort_contract.DEFAULT_TARGET
    ):
        """``report``: act only if it holds a fusion (None: always); ``target``: its opset."""
        super().__init__(report)
        self.floor = ort_contract.max_opset(target)

    def clean(self, model: ir.Model) -> ir.passes.PassResult:
        """Lower while above the target's opset and the newest version's changes are unused."""
        modified = False
        while True:
            version = model.opset_imports.get("")
            changes = OPSET_CHANGES.get(version) if version is not None else None
            if changes is None or version <= self.floor:
                break
            if _uses_op(model.graph, changes) or any(
                _uses_op(f, changes) for f in model.functions.values()
            ):
                break
            model.opset_imports[""] = version - 1
            model.graph.opset_imports[""] = version - 1
            for f in model.functions.values():
                if f.opset_imports.get("") == version:
                    f.opset_imports[""] = version - 1
            modified = True
        return ir.passes.PassResult(model, modified=modified)


class FusedNodesCheckPass(ir.passes.InPlacePass):
    """Postconditions only: no internal (private-domain) op survives, fused nodes are complete.

    A fused node must be an op ``target`` has a kernel for and carry exactly the attribute set
    the target takes (:func:`onnx_moe_fuse.rewrites.ort_contract.attribute_names`).
    """

    def __init__(self, target: str = ort_contract.DEFAULT_TARGET):
        """``target``: the runtime the fused nodes were written for."""
        super().__init__()
        self.target = ort_contract.check_target(target)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Change nothing."""
        return ir.passes.PassResult(model, modified=False)

    def ensures(self, model: ir.Model) -> None:
        """Raise ``PostconditionError`` on an internal op or a fused node the target cannot run."""
        graphs: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
        for g in graphs:
            for node in ir.traversal.RecursiveGraphIterator(g):
                if node.domain.startswith(INTERNAL_DOMAIN):
                    raise ir.passes.PostconditionError(
                        f"internal op {node.domain}.{node.op_type} survived fusion ({_label(node)})"
                    )
                if node.domain == MS_DOMAIN and REPLACED_KEY in node.metadata_props:
                    raise ir.passes.PostconditionError(
                        f"fused node {_label(node)} still carries the {REPLACED_KEY} marker"
                    )
                if node.domain != MS_DOMAIN or node.op_type not in ALL_FUSED_OPS:
                    continue
                if not _rule_name(node):
                    continue  # a node the model already had
                if node.op_type not in ort_contract.ops_for(self.target):
                    raise ir.passes.PostconditionError(
                        f"fused {node.op_type} {_label(node)} was emitted for {self.target}, "
                        "which has no kernel for it"
                    )
                expected = ort_contract.attribute_names(node.op_type, self.target)
                if set(node.attributes) != expected:
                    raise ir.passes.PostconditionError(
                        f"fused {node.op_type} {_label(node)} carries attributes "
                        f"{sorted(node.attributes)}, but {self.target} takes {sorted(expected)}"
                    )


def fusion_pipeline(
    report: FusionReport | None = None,
    only: Iterable[str] | None = None,
    target: str = ort_contract.DEFAULT_TARGET,
    weight_sink: WeightSink | None = None,
) -> ir.passes.PassManager:
    """The whole pipeline as one ``PassManager`` (one step); ``report`` collects the results.

    ``weight_sink`` receives every repacked weight (:mod:`onnx_moe_fuse.weight_sink`; default in
    memory): the command line's streaming path spills them to a scratch file.

    ``only`` names the ops that may be emitted (default: all of :data:`ALL_FUSED_OPS`);
    ``target`` (one of :data:`onnx_moe_fuse.rewrites.ort_contract.TARGETS`, default
    ``"ort-cpu"``) the runtime the fused nodes are written for: only ops it has kernels for are
    emitted, each with the attribute set it takes. ``ValueError`` for an unknown op or target.
    """
    report = report if report is not None else FusionReport()
    report.target = ort_contract.check_target(target)
    return ir.passes.PassManager(
        [
            FuseMoELayersPass(report, only, target, weight_sink),
            FuseQkvPass(report, only, target, weight_sink),
            RemoveDeadCodePass(report),
            LowerOpsetPass(report, target),
            FusedNodesCheckPass(target),
        ],
        steps=1,
    )
