"""The MoE layer pass: canonicalise a working copy, fuse there, splice each proved layer into the model.

The target's contract is applied at emission, just before a MoE/QMoE node is spliced; a node
the target cannot run becomes a near miss of part ``target``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import onnx_ir as ir

from onnx_moe_fuse.contract.ops import QMOE
from onnx_moe_fuse.contract.targets import DEFAULT, Target
from onnx_moe_fuse.pipeline.canonicalise import canonicalise
from onnx_moe_fuse.pipeline.common import (
    ALL_FUSED_OPS,
    attr_value,
    fused_nodes,
    label,
    rule_name,
)
from onnx_moe_fuse.pipeline.near_misses import (
    GENERIC_UNRECOGNISED,
    UNRECOGNISED,
    NearMissTracer,
    dense_near_miss,
    departs_before,
    meaning_near_miss,
    pointing_record,
    unrecognised,
)
from onnx_moe_fuse.pipeline.quantized_layers import (
    check_block_sizes,
    quantization_record,
    set_accuracy_level,
)
from onnx_moe_fuse.pipeline.report import FusionReport
from onnx_moe_fuse.pipeline.splice import origin_tail, splice_fused_node, tag_origin
from onnx_moe_fuse.pipeline.split_rows_diagnosis import SPLIT_UNPROVED, split_rows_diagnosis
from onnx_moe_fuse.rewrites.canonical.experts.meaning.meaning_pass import CanonicalMeaningPass
from onnx_moe_fuse.rewrites.canonical.weights.fold_weight_layout import FoldWeightLayoutPass
from onnx_moe_fuse.rewrites.graph.refusals import NearMiss, Refusal
from onnx_moe_fuse.rewrites.graph.selection_rounds import same_topk, selection_round
from onnx_moe_fuse.rewrites.graph.weight_sink import WeightSink
from onnx_moe_fuse.rewrites.moe.layer_rules import (
    FUSED_OPS,
    REPLACED_KEY,
    moe_layer_rule_set,
)
from onnx_moe_fuse.rewrites.moe.quantize import Quantization
from onnx_moe_fuse.rewrites.moe.routers import SELECTED, classify_router
from onnx_moe_fuse.rewrites.moe.rule_base import (
    CAST_KEY,
    LAYER_OUT_KEY,
    RESCALED_KEY,
    ROUTING_KEY,
    TOPK_KEY,
)


class LayerObserver(Protocol):
    """Told how the MoE pass advances (the command line's progress bar); never changes the work.

    ``layers_found(count)`` once, with the number of candidate layers (routing TopK/ArgMax nodes
    of the canonicalised working copy), then ``layer_done(name, fused)`` once per candidate:
    each fused layer as it is spliced, then every candidate that did not fuse.
    """

    def layers_found(self, count: int) -> None:
        """``count`` candidate layers are about to be analysed."""
        ...

    def layer_done(self, name: str, fused: bool) -> None:
        """The candidate ``name`` (a TopK's output, or the fused node) is done."""
        ...


def emitted(only: Iterable[str] | None) -> frozenset[str]:
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


def _zero_points(node: ir.Node) -> str | None:
    """A fused QMoE node's zero-point granularity ("per-channel"/"block-wise"), or None.

    The rule writes zero-point inputs only for asymmetric weights (``rewrites/moe/emit.py``).
    """
    if node.op_type != QMOE.name:
        return None
    slots = [QMOE.index(n) for n in ("fc1_zero_points", "fc2_zero_points")]
    if all(i >= len(node.inputs) or node.inputs[i] is None for i in slots):
        return None
    block = node.attributes.get("block_size")
    return "block-wise" if block is not None and block.value > 0 else "per-channel"


def _target_refusal(node: ir.Node, target: Target) -> str | None:
    """Why the fused ``node`` cannot be written for ``target`` (the contract's words), or None."""
    activation = node.attributes.get("activation_type")
    return target.refusal(
        node.op_type,
        activation.value if activation is not None else None,
        _activation_dtype(node),
        _zero_points(node),
    )


def _producer_of(graph: ir.Graph, name: str | None) -> ir.Node | None:
    """The node of ``graph`` whose first output is named ``name``."""
    if not name:
        return None
    return next((n for n in graph if n.outputs and n.outputs[0].name == name), None)


def _only_user(node: ir.Node, op_type: str) -> ir.Node:
    users = node.outputs[0].uses()
    assert len(users) == 1 and users[0][0].op_type == op_type, users
    return users[0][0]


def _end_of(node: ir.Node) -> ir.Node:
    """The last node the rule put after the fused ``node`` (``node`` itself when none).

    Its rescale ``Mul`` (the routing construction's), then its ``Cast`` to the replaced value's
    type (a float32 combine of a float16 layer).
    """
    end = node
    if node.metadata_props.get(RESCALED_KEY):
        end = _only_user(end, "Mul")
    if node.metadata_props.get(CAST_KEY):
        end = _only_user(end, "Cast")
    return end


def _routing_record(node: ir.Node, graph: ir.Graph) -> dict[str, Any] | None:
    """The report's words on a fused node fed by the routing construction (None otherwise)."""
    construction = node.metadata_props.get(ROUTING_KEY)
    if construction is None:
        return None
    topk = _producer_of(graph, node.metadata_props.get(TOPK_KEY))
    form = classify_router(topk) if topk is not None else None
    record = {
        "construction": construction,
        "rescaled": bool(node.metadata_props.get(RESCALED_KEY)),
        "router": form.kind if form is not None else "unknown",
        "router_description": form.description if form is not None else "",
        "topk": label(topk),
    }
    dtype = _activation_dtype(node)
    if dtype not in (None, "float32"):
        # why a softmax router the node could compute itself is fed as its selection
        record["why"] = (
            f"the layer computes in {dtype}: fed the model's own selection, so router values "
            f"that tie or swap in {dtype} cannot change which experts a token uses"
        )
    return record


def apply_target_attributes(node: ir.Node, target: Target) -> None:
    """Give the fused ``node`` the attribute set ``target`` takes (``contract.targets``)."""
    attrs = target.node_attributes(
        node.op_type, {k: attr_value(a) for k, a in node.attributes.items()}
    )
    node.attributes.clear()
    for attr in ir.convenience.convert_attributes(attrs):
        node.attributes[attr.name] = attr


class FuseMoELayersPass(ir.passes.InPlacePass):
    """Rewrite every provable MoE layer into ``com.microsoft.MoE`` / ``QMoE``.

    ``only`` restricts the ops emitted (``{"MoE"}``, ``{"QMoE"}``; default both), ``target``
    the runtime they are written for: a layer whose op, activation or dtype the target has no
    kernel for stays as it is and becomes a near miss of part ``target``
    (:meth:`onnx_moe_fuse.contract.targets.Target.refusal`); a fused node gets the target's
    attribute set (:meth:`~onnx_moe_fuse.contract.targets.Target.node_attributes`) before it is
    spliced. The fusions and near misses are appended to ``report`` (a :class:`FusionReport`,
    shared with the caller).

    ``quantize``/``accuracy_level`` (opt-in): :mod:`.quantized_layers` (float layers as QMoE of
    quantised weights, measured; ``accuracy_level`` on every QMoE node).
    """

    def __init__(
        self,
        report: FusionReport | None = None,
        only: Iterable[str] | None = None,
        target: Target = DEFAULT,
        weight_sink: WeightSink | None = None,
        observer: LayerObserver | None = None,
        quantize: Quantization | None = None,
        accuracy_level: int | None = None,
    ):
        """Set up the pass; ``report`` receives what it did, ``weight_sink`` the weights.

        ``observer`` (a :class:`LayerObserver`) is told of each candidate layer as it is done.
        """
        super().__init__()
        self.quantize = quantize
        self.accuracy_level = accuracy_level
        self.weight_sink = weight_sink
        self.observer = observer
        self.emit = emitted(only) & FUSED_OPS
        self.target = target
        self.report = report if report is not None else FusionReport()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Canonicalise a working copy, fuse there, splice into ``model``; fill the report."""
        if not self.emit:
            return ir.passes.PassResult(model, modified=False)
        # the working copy shares tensor objects with the model; some onnx-ir helpers rename a
        # tensor they read (get_const_tensor names a Constant's tensor after its value), so the
        # names are put back afterwards and the model's bytes outside fused layers stay the same
        tensor_names = shared_tensor_names(model.graph)
        work = model.clone()
        tag_origin(work.graph)
        # the canonical passes record why they left a layer while they run; the near misses
        # read those records instead of analysing the layer again
        refusals: list[Refusal] = []
        self.report.canonicalisation.extend(canonicalise(work, refusals))

        candidates = [n for n in work.graph if n.op_type in ("TopK", "ArgMax")]
        if self.observer is not None:
            self.observer.layers_found(len(candidates))
        tracer = NearMissTracer(refusals)
        moe_layer_rule_set(
            self.emit, probe=True, splice=True, target=self.target, quantize=self.quantize
        ).apply_to_model(work, tracer=tracer)
        check_block_sizes(tracer)  # a user's block size that does not fit: before any rewrite
        rules = moe_layer_rule_set(
            self.emit,
            splice=True,
            weight_sink=self.weight_sink,
            target=self.target,
            quantize=self.quantize,
        )
        rules.apply_to_model(work)
        tracer = self._by_meaning(work, refusals, tracer, rules)

        spliced = 0
        fused_roots: set[str] = set()
        fused_topks: set[str] = set()
        done: set[str] = set()
        for node in fused_nodes(work.graph):
            layer_out = node.metadata_props.get(LAYER_OUT_KEY, "")
            topk_name = node.metadata_props.get(TOPK_KEY, "")
            fused_topks.add(topk_name)
            reason = _target_refusal(node, self.target)
            if reason is not None:
                self.report.add_near_miss(
                    NearMiss(
                        rule=rule_name(node),
                        part="target",
                        node=layer_out,
                        reason=reason,
                        root=layer_out,
                        topk=label(_producer_of(work.graph, node.metadata_props.get(TOPK_KEY))),
                        router=None,
                        values=(),
                    )
                )
                continue
            apply_target_attributes(node, self.target)
            set_accuracy_level(node, self.accuracy_level)
            # the proved output (the rescale after the node, where the routing construction
            # has one, and the cast to a float32 combine's type), or a Reshape after it that the original has (a split moved out)
            end = _end_of(node)
            last, replaces = origin_tail(end, layer_out, model.graph)
            try:
                result = splice_fused_node(model, node, replaces, last=last)
            except Refusal as refusal:  # the splice's, of part region, naming a model value
                name = refusal.value.name if refusal.value is not None else None
                self.report.add_near_miss(
                    NearMiss.of(
                        refusal,
                        rule=rule_name(node),
                        values=[name] if name else [],
                        node=layer_out,
                        root=layer_out,
                    )
                )
                continue
            spliced += 1
            if self.observer is not None:
                done.add(topk_name)
                self.observer.layer_done(result.node.name or layer_out, True)
            fused_roots.add(layer_out or "")
            fusion = {
                "op": result.node.op_type,
                "name": result.node.name,
                "rule": rule_name(result.node),
                "replaced": list(result.replaced),
                "kept": list(result.kept),
                "attributes": {k: attr_value(a) for k, a in result.node.attributes.items()},
                "dtype": _activation_dtype(node),
            }
            routing = _routing_record(node, work.graph)
            if routing is not None:
                fusion["routing"] = routing
            quantization = quantization_record(result.node)
            if quantization is not None:
                fusion["quantization"] = quantization
            self.report.fusions.append(fusion)
            for key in (REPLACED_KEY, LAYER_OUT_KEY, TOPK_KEY, ROUTING_KEY, RESCALED_KEY, CAST_KEY):
                result.node.metadata_props.pop(key, None)
        self._near_misses(tracer, work, refusals, fused_roots, fused_topks)
        if self.observer is not None:
            for node in candidates:
                name = node.outputs[0].name or node.name or ""
                if name not in done:
                    self.observer.layer_done(name, False)
        for tensor, name in tensor_names:
            if tensor.name != name:
                tensor.name = name
        return ir.passes.PassResult(model, modified=spliced > 0)

    def _by_meaning(self, work, refusals, tracer, rules):
        """The second round: layers no rule fused, recognised by what they compute.

        :class:`CanonicalMeaningPass` rewrites the unfused layers whose meaning is the fused
        op's contract into the per-slot form (the weight-layout pass then folds the layout ops
        it puts on constants), and the rules run again there; its records of the layers it
        left (the node whose meaning departs) join ``refusals``. The exporter forms fused in
        the first round are not analysed again.
        """
        fused = {n.metadata_props.get(TOPK_KEY, "") for n in fused_nodes(work.graph)}
        unfused = [
            n.outputs[0].name
            for n in work.graph
            if n.op_type == "TopK" and n.outputs[0].name not in fused
        ]
        if not unfused:
            return tracer
        meaning = CanonicalMeaningPass(refusals, only=unfused)
        if not meaning(work).modified:
            return tracer
        FoldWeightLayoutPass()(work)
        second = NearMissTracer(refusals)
        moe_layer_rule_set(
            self.emit, probe=True, splice=True, target=self.target, quantize=self.quantize
        ).apply_to_model(work, tracer=second)
        check_block_sizes(second)
        rules.apply_to_model(work)
        # a rewritten layer's refusals are the second round's (on its per-slot form); the
        # others keep the first round's, on the spelling the model has
        rewritten = {id(t) for t in meaning.rewritten}
        second.attempts = [
            *(a for a in tracer.attempts if a.topk is None or id(a.topk) not in rewritten),
            *(a for a in second.attempts if a.topk is not None and id(a.topk) in rewritten),
        ]
        return second

    def _near_misses(
        self,
        tracer: NearMissTracer,
        work: ir.Model,
        refusals: list[Refusal],
        fused: set[str],
        fused_topks: set[str],
    ) -> None:
        """Record the refused matches of layers that did not fuse, and unmatched routers."""
        seen: set[tuple[int, str]] = set()
        explained: set[int] = set()
        explained_topks: list[ir.Node] = []  # the TopKs of the attempts, for their twins
        for a in tracer.attempts:
            root_out = a.root.outputs[0].name if a.root.outputs else None
            topk_out = a.topk.outputs[0].name if a.topk is not None else None
            if a.root.graph is None or root_out in fused or topk_out in fused_topks:
                continue  # the layer fused after all
            key = (id(a.root), a.refusal.message())
            if key in seen:
                continue
            seen.add(key)
            if a.topk is not None:
                explained.add(id(a.topk))
                explained_topks.append(a.topk)
            departs = pointing_record(refusals, a.topk) if a.topk is not None else None
            if departs is not None and departs_before(departs, a.refusal):
                # the rule failed at a part after the one where the analysis of meaning saw the
                # layer stop being the op's: that node is named instead (once per TopK)
                if ("meaning", id(a.topk)) not in seen:
                    seen.add(("meaning", id(a.topk)))  # type: ignore[arg-type]
                    reason = f"{UNRECOGNISED}{a.refusal.part}: {a.refusal.reason}"
                    self.report.add_near_miss(meaning_near_miss(a.topk, departs, reason))
                continue
            self.report.add_near_miss(a.near_miss())
        routers: set[int] = set()
        diagnosis: dict[str, NearMiss] | None = None  # made once, for the first split combine
        # a TopK computing the same as one a rule's refusal explains (Switch's ReduceMax beside
        # its ArgMax, both TopK(1) on the copy) is that layer's router, already explained
        explained_topks = [n for n in work.graph if id(n) in explained and n.op_type == "TopK"]
        for node in work.graph:
            if node.op_type not in ("TopK", "ArgMax") or id(node) in explained:
                continue
            if node.op_type == "TopK" and any(same_topk(node, t) for t in explained_topks):
                continue  # Switch's ReduceMax TopK beside its ArgMax's: that layer's near miss
            if node.outputs[0].name in fused_topks or _round_of_fused(node, fused_topks):
                continue
            if node.op_type == "TopK" and any(same_topk(node, e) for e in explained_topks):
                continue
            reason, dense = unrecognised(node, refusals)
            part = None
            departs = pointing_record(refusals, node)
            if (
                departs is not None
                and reason is None
                and dense is None
                and departs.part != "tokens"
            ):
                reason = UNRECOGNISED + "the indices of this TopK reach expert work"
            behind = None
            if dense is None and reason == GENERIC_UNRECOGNISED:
                if diagnosis is None:
                    diagnosis = split_rows_diagnosis(work, self.emit, refusals)
                behind = diagnosis.get(node.outputs[0].name or "")
            # a router the fused node takes as its selection (grouped, biased, scaled): where
            # the analysis read past it into the experts, the expert-side node is named
            selectable = bool(reason) and reason.startswith("router not fus") and SELECTED in reason
            if (
                departs is not None
                and behind is None
                and dense is None
                and reason
                and (
                    reason.startswith(UNRECOGNISED)
                    or (selectable and departs.part not in (None, "tokens", "routing"))
                )
            ):
                # the analysis of meaning names the node where the layer stops being the op's
                self.report.add_near_miss(meaning_near_miss(node, departs, reason))
                continue
            if dense is not None:
                reason = dense.reason  # the pass recognised the layer: its refusal names the part
            elif reason == GENERIC_UNRECOGNISED:
                if behind is not None:  # the split was not proved: the rules say what else
                    part = behind.part or "combine"
                    reason = f"{SPLIT_UNPROVED}; with the split moved out, {behind.message}"
            if reason is not None:
                # the Softmax/Sigmoid of the router (before or after the TopK), else what it reads
                router = classify_router(node).scores
                if router is None and node.inputs and node.inputs[0] is not None:
                    router = node.inputs[0].producer()
                if reason.startswith("router not fus") and id(router) in routers:
                    continue  # one near miss per router: PhiMoE's two rounds read one router
                routers.add(id(router))
                if dense is not None:
                    self.report.add_near_miss(dense_near_miss(node, dense, router))
                    continue
                if part is None and reason.startswith("router not fus"):
                    part = "routing"  # a router the fused ops cannot express
                self.report.add_near_miss(
                    NearMiss(
                        rule=None,
                        part=part,
                        node=label(node),
                        reason=reason,
                        root=None,
                        topk=label(node),
                        router=label(router),
                        values=(),
                    )
                )


def shared_tensor_names(graph: ir.Graph) -> list[tuple[Any, str | None]]:
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


def _round_of_fused(node: ir.Node, fused_topks: set[str]) -> bool:
    """Part of a fused layer's router, not a layer of its own.

    A top-1 round (PhiMoE's) of a selection that fused, or a TopK computing the same as one
    (Switch's ReduceMax beside its ArgMax).
    """
    fused = [
        n for n in node.graph or () if n.op_type == "TopK" and n.outputs[0].name in fused_topks
    ]
    if any(same_topk(node, f) for f in fused):
        return True
    found = selection_round(node.outputs[1]) if len(node.outputs) > 1 else None
    if found is None:
        return False
    return any(
        user.op_type == "TopK" and user.outputs[0].name in fused_topks
        for user in found.logits.consumers()
    )
