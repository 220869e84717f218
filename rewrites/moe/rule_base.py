"""The base of the MoE layer rules: a small combine pattern, part recognisers, the proofs.

A layer rule's pattern is the combine that ends the layer (:mod:`.parts.combine`, one form per
rule instance) weighted by the values of a routing TopK (:func:`.parts.routing.routing_pattern`):
the few nodes that anchor a layer at its TopK and keep the rule from firing on sums that are no
MoE. Everything between the TopK and the combine's expert output is recognised part by part in
``check`` (:func:`.parts.layer.recognise_layer`: routing, FC2, activation, FC1), and the
recognised :class:`~.parts.facts.LayerParts` is proved by the layout's proof
(:func:`~.analysis.analyse_layer` for per-slot projections,
:func:`~.rows_analysis.analyse_rows_layer` for flattened rows) into a
:class:`~.analysis.LayerPlan`, or refused with a
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal`, which ``check`` hands to onnxscript as
its failed ``MatchResult`` (reading ``"part: reason"``, and carrying the refusal for the
pipeline's tracer). ``rewrite`` recognises and proves again
(nothing is kept on the rule) and emits the fused node from the plan.

The concrete rules (:mod:`.layer_rules`, :mod:`.batched_rules`) give an activation ``family``
and their combine forms: a rule recognises a layer of any family and fuses only its own, so a
layer's near misses are the same whichever rule reports them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _basics, pattern

from onnx_moe_fuse.contract.ops import CONTRIB_OPS, MOE, MS_DOMAIN, QMOE
from onnx_moe_fuse.contract.targets import DEFAULT, Target, as_target
from onnx_moe_fuse.rewrites.graph.facts import default_opset
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.graph.weight_sink import WeightSink, in_memory
from onnx_moe_fuse.rewrites.moe.analysis import LayerPlan, analyse_layer
from onnx_moe_fuse.rewrites.moe.emit import float_arrays, fused_arrays, quantize_arrays
from onnx_moe_fuse.rewrites.moe.parts.activation import FAMILIES
from onnx_moe_fuse.rewrites.moe.parts.combine import combine_pattern
from onnx_moe_fuse.rewrites.moe.parts.facts import LayerParts
from onnx_moe_fuse.rewrites.moe.parts.layer import escaping_value, recognise_layer
from onnx_moe_fuse.rewrites.moe.parts.routing import routing_pattern
from onnx_moe_fuse.rewrites.moe.quantize import SCHEME, Quantization
from onnx_moe_fuse.rewrites.moe.routing_construction import build_routing, construction_for
from onnx_moe_fuse.rewrites.moe.rows_analysis import analyse_rows_layer

__all__ = [
    "FAMILIES",
    "FUSED_OPS",
    "MS_DOMAIN",
    "LAYER_OUT_KEY",
    "QUANTIZATION_KEY",
    "REPLACED_KEY",
    "TOPK_KEY",
    "MoELayerRule",
    "prove_layer",
    "routing_pattern",
    "var",
]

#: The ops the layer rules emit (all in the ``com.microsoft`` domain).
FUSED_OPS = frozenset({MOE.name, QMOE.name})
#: Node metadata key carrying the replaced node names (JSON list), read by the fusion pass.
REPLACED_KEY = "onnx_moe_fuse.replaced"
#: Node metadata keys naming the value a fused node replaces and its routing TopK's first output.
LAYER_OUT_KEY = "onnx_moe_fuse.layer_out"
TOPK_KEY = "onnx_moe_fuse.topk"
#: Node metadata key: the routing construction a fused node is fed by ("router_weights" or
#: "logits"; absent for its own softmax routing), and whether a ``Mul`` after it rescales.
ROUTING_KEY = "onnx_moe_fuse.routing"
RESCALED_KEY = "onnx_moe_fuse.rescaled"
#: Node metadata key: a ``Cast`` after the fused node (after its rescale, if any) gives its
#: output the type of the value it replaces (a float16 layer whose combine sums in float32).
CAST_KEY = "onnx_moe_fuse.cast"
#: Node metadata key: a float layer quantised on request, with its measured error (JSON).
QUANTIZATION_KEY = "onnx_moe_fuse.quantization"


def var(name: str, optional: bool = False) -> pattern.Var:
    """A pattern variable; ``optional`` ones also match an absent (empty) input."""
    return pattern.Var(name, can_match_none=optional)


# -- the rule ----------------------------------------------------------------------------------


def _layer_nodes(plan: LayerPlan) -> list[ir.Node]:
    """The nodes the fused node replaces, in graph order (walked back from the layer output)."""
    stop = {id(plan.tokens), id(plan.router_probs)}
    stop.update(id(v) for v in (plan.selection, plan.selected_weights) if v is not None)
    seen: dict[int, ir.Node] = {}
    todo = [plan.root]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        for v in node.inputs:
            if v is None or id(v) in stop:
                continue
            p = v.producer()
            if p is None or p.op_type == "Constant" or v.is_initializer():
                continue
            todo.append(p)
    graph = plan.root.graph
    order = {id(n): i for i, n in enumerate(graph)} if graph is not None else {}
    return sorted(seen.values(), key=lambda n: order.get(id(n), 0))


def _fresh_name(graph: ir.Graph | None, base: str) -> str:
    taken = graph.initializers if graph is not None else {}
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    return name


def prove_layer(
    parts: LayerParts,
    *,
    combine: str,
    emit: frozenset[str],
    standalone: bool,
    quantize: Quantization | None = None,
) -> LayerPlan:
    """Prove the recognised ``parts`` one fused node; raise the first part's failure otherwise.

    ``standalone``: the rule runs alone (not in the pipeline's splice), so nothing the fused
    node replaces may be used outside the layer (the splice proves its region itself).
    ``quantize``: float layers become QMoE of quantised weights (:mod:`.quantize`).
    """
    b = parts.bindings
    inside = parts.nodes if standalone else None
    if parts.layout == "rows":
        plan = analyse_rows_layer(
            b, family=parts.family, emit=emit, matched=inside, combine=combine, quantize=quantize
        )
    else:
        plan = analyse_layer(
            b, family=parts.family, combine=combine, emit=emit, matched=inside, quantize=quantize
        )
    if standalone:
        escape = escaping_value(parts, parts.nodes)
        if escape is not None:
            raise escape
    return plan


class MoELayerRule(pattern.RewriteRuleClassBase):
    """A layer rule: a small combine pattern; ``check`` recognises and proves, ``rewrite`` emits.

    A concrete rule gives its activation ``family`` and the combine forms it anchors at
    (``combines``, class attributes); recognition and proofs are shared (:func:`prove_layer`).
    """

    family: ClassVar[str] = ""
    combines: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        name: str | None = None,
        *,
        combine: str | None = None,
        emit: Iterable[str] = FUSED_OPS,
        probe: bool = False,
        splice: bool = False,
        weight_sink: WeightSink | None = None,
        target: Target | str = DEFAULT,
        quantize: Quantization | None = None,
    ) -> None:
        """Configure the rule: which combine form it anchors at, which ops it may emit.

        ``combine`` defaults to the layout's first form. A ``probe`` rule checks like the
        real one but its rewrite builds only a placeholder: it serves dry runs with a tracer
        (which never apply a rewrite), to collect near misses without repacking weights.

        A ``splice`` rule runs on a canonicalised working copy whose fused nodes are spliced
        into the original graph afterwards (``onnx_moe_fuse.pipeline``): the splice proves the
        layer's region in the original, keeps what escapes upstream of the experts (a router
        Softmax that is also a graph output) and refuses the rest. So a splice rule does not
        check escapes; used alone (the default), a rule refuses a layer with an intermediate
        used outside it. Either way the rule removes no node itself (its pattern is the combine
        and the TopK only): the rewriter replaces the layer output and the rest of the layer is
        left dead, for a dead-code pass (the pipeline's, or the rule set's own when alone).

        ``weight_sink`` stores each repacked array as an initializer's tensor
        (:mod:`.weight_sink`; default in memory). ``target`` picks the routing construction
        of a layer fed as its selection and weights (:func:`.routing_construction.construction_for`).
        ``quantize`` (opt-in) makes float layers QMoE of quantised weights, measured by its
        ``error_meter`` at the rewrite (:mod:`.quantize`).
        """
        combine = self.combines[0] if combine is None else combine
        if combine not in self.combines:
            raise ValueError(f"combine must be one of {self.combines}, got {combine!r}")
        emit = frozenset(emit)
        if not emit <= FUSED_OPS:
            raise ValueError(f"emit must be a subset of {sorted(FUSED_OPS)}, got {sorted(emit)}")
        super().__init__(name or f"{type(self).__name__}[{combine}]", remove_nodes=False)
        # configuration only: nothing about a match is ever stored on the rule
        self._combine_form = combine
        self._emit = emit
        self._probe = probe
        self._splice = splice
        self._weight_sink = in_memory if weight_sink is None else weight_sink
        self._target = as_target(target)
        self._quantize = quantize

    def pattern(self, op):
        """The combine form of this rule, weighted by any weights (``check`` finds the TopK)."""
        return combine_pattern(op, self._combine_form, var("expert_out"), var("routing_weights"))

    def _plan(self, bindings: dict[str, Any]) -> LayerPlan:
        """Recognise the layer's parts and prove them (a pure function of the graph)."""
        root = bindings["layer_out"].producer()
        parts = recognise_layer(root, self._combine_form, FAMILIES)
        try:
            plan = prove_layer(
                parts,
                combine=self._combine_form,
                emit=self._emit,
                standalone=not self._splice,
                quantize=self._quantize,
            )
        except Refusal as refusal:
            if refusal.topk is None:  # the layer's TopK, for the near miss
                refusal.topk = parts.routing.topk
            raise
        if parts.family != self.family:
            # another rule of this combine fuses it; failing with the same words as that rule
            # would on a refusal keeps one near miss per layer (the proof above raised it)
            raise Refusal(
                f"the activation is {parts.activation.kind} ({parts.family} family), which "
                f"another rule of this combine fuses",
                parts.activation.output,
                part="activation",
            )
        return plan

    def check(self, context, **bindings) -> pattern.MatchResult:
        """Prove the rewrite equivalent; a failure names the part and the reason in plain words."""
        del context  # the layer's nodes are the recognised parts', not the small pattern's
        try:
            self._plan(bindings)
        except _basics.MatchFailureError as error:
            # the failure reads "part: reason" and carries the refusal for a tracer
            return Refusal.of(error).fail()
        return pattern.MatchResult()

    def rewrite(self, op, **bindings):
        """Emit one ``com.microsoft.MoE``/``QMoE`` node (weights repacked, attributes explicit)."""
        if self._probe:
            return op.Identity(bindings["expert_out"])
        plan = self._plan(bindings)
        quantization = None
        if plan.from_float:
            floats = float_arrays(plan)
            arrays = quantize_arrays(floats, plan.bits, plan.block)
            quantization = self._measure(plan, floats.by_input(), arrays.by_input())
        else:
            arrays = fused_arrays(plan)
        graph = plan.root.graph
        base = re.sub(
            r"[^A-Za-z0-9_.]+", "_", plan.topk.name or plan.topk.outputs[0].name or "layer"
        )
        base = f"{plan.op.lower()}_{base}"

        def const(suffix: str, array: np.ndarray | None) -> ir.Value | None:
            if array is None:
                return None
            name = _fresh_name(graph, f"{base}.{suffix}")
            return op.initializer(self._weight_sink(array, name), name=name)

        fused_op = CONTRIB_OPS[plan.op]
        attributes = plan.attributes()
        routing = None
        if plan.selection is not None:
            assert plan.selected_weights is not None
            construction = construction_for(plan.op, self._target)
            weights = plan.selected_weights
            if weights.dtype is not None and weights.dtype != plan.dtype:
                # the node's router inputs are of its type T: weights a float16 export
                # computes in float32 are rounded to T (the node's own precision)
                weights = op.Cast(weights, to=plan.dtype)
            routing = build_routing(
                op,
                plan.selection,
                weights,
                plan.num_experts,
                construction,
                dtype=plan.dtype,
                weights_sum_to_one=plan.weights_sum_to_one,
                rank=plan.rank,
                opset=default_opset(graph),
            )
            values: dict[str, ir.Value | None] = {"input": plan.tokens, **routing.inputs()}
            attributes.update(routing.attributes())
        else:
            router = plan.router_probs
            if plan.rank != 2:
                shape = op.Constant(
                    value=ir.tensor(np.array([-1, plan.num_experts], dtype=np.int64))
                )
                router = op.Reshape(router, shape)
            values = {"input": plan.tokens, "router_probs": router}
        values.update((name, const(name, array)) for name, array in arrays.by_input().items())
        inputs = fused_op.input_list(values)
        fused = op.op(
            fused_op.name,
            *inputs,
            _domain=fused_op.domain,
            _name=f"{base}/{plan.op}",
            **attributes,
        )
        out = fused if routing is None else routing.rescaled(op, fused)
        layer_dtype = plan.root.outputs[0].dtype or plan.out_dtype
        if layer_dtype is not None and layer_dtype != plan.dtype:
            # the layer sums in a wider type than its experts (a float16 export's float32
            # combine): the fused output, of type T, is cast to the type of the value it replaces
            out = op.Cast(out, to=layer_dtype)
            fused.producer().metadata_props[CAST_KEY] = "1"
        replaced = [n.name or f"{n.op_type}({n.outputs[0].name})" for n in _layer_nodes(plan)]
        meta = fused.producer().metadata_props
        if routing is not None:
            meta[ROUTING_KEY] = routing.construction
            if routing.scale is not None:
                meta[RESCALED_KEY] = "1"
        meta[REPLACED_KEY] = json.dumps(replaced)
        if quantization is not None:
            meta[QUANTIZATION_KEY] = json.dumps(quantization)
        # for the pipeline's splice: a splice rule keeps the matched nodes, so the rewriter
        # gives the fused output a fresh name; these name what it replaces and its router
        meta[LAYER_OUT_KEY] = plan.root.outputs[0].name or ""
        meta[TOPK_KEY] = plan.topk.outputs[0].name or ""
        return out

    def _measure(
        self, plan: LayerPlan, floats: dict[str, Any], quantized: dict[str, Any]
    ) -> dict[str, Any]:
        """The record of a float layer quantised on request: scheme, and the measured error."""
        assert self._quantize is not None
        weights = str(plan.fc2.dtype.numpy())
        record: dict[str, Any] = {
            "from": f"{weights} weights",
            "bits": plan.bits,
            "block_size": plan.block,
            "scheme": SCHEME,
        }
        meter = self._quantize.error_meter
        if meter is None:
            record["measured"] = None
            return record
        record.update(meter(floats, quantized, plan.attributes()))
        return record
