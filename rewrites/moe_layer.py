"""Whole-layer rules: a mixture-of-experts layer in standard ONNX -> ``com.microsoft.MoE``/``QMoE``.

One rule matches one whole layer, from the routing TopK and the expert projections to the
combine, in every spelling it knows (onnxscript ``OrValue`` alternatives, so spellings add up
instead of multiplying):

* routing: ``TopK(scores, k)`` with the weights ``Div(v, ReduceSum(v))`` / ``Mul(v,
  Reciprocal(ReduceSum(v)))`` (renormalised), ``Softmax(v)`` (top-k then softmax) or ``v`` as it
  is; whether ``scores`` is a ``Softmax`` of the logits is decided in ``check``;
* experts (FC1 on the tokens, FC2 on the activation): ``GroupedMatMul`` (opset 29; FC2 flattened
  to ``[M*k, I]`` rows with ``[M*k, 1]`` indices and reshaped back) or its decomposition
  ``Gather(weights, indices)`` + ``Unsqueeze`` (+ ``Expand``) + ``MatMul`` + ``Squeeze`` /
  ``Reshape``; biases as GroupedMatMul's 4th input or ``Gather(bias, indices)`` + ``Add``;
* activation, one rule class per family: :class:`GatedSwiGLUMoELayer` (SwiGLU from separate gate
  and up experts), :class:`FusedSwiGLUMoELayer` (SwiGLU from one FC1 cut by ``Slice`` - halves or
  strided - or ``Split``), :class:`ElementwiseMoELayer` (Relu, Gelu, SiLU, identity, and the
  exact-GELU spellings it must refuse); SwiGLU with optional ``Clip`` limits, alpha and beta;
* combine: ``ReduceSum(Mul(expert_out, Unsqueeze(weights, -1)), k axis)`` or ``MatMul`` of the
  weights as a row vector with the expert outputs (then ``Squeeze`` or ``Reshape``).

The pattern proves structure only; ``check`` proves meaning with
:func:`~._moe_analysis.analyse_layer` (axes, ``k``, Reshape targets, constants, indices, dtypes,
zero points, clamp limits, the routing form, the escapes of the router probabilities and the
dequantized weights) and returns a failed ``MatchResult`` with a plain-words reason otherwise.
``rewrite`` runs the same analysis again (nothing is kept on the rule between the two calls),
repacks the weights (:mod:`._moe_emit`) and emits one node with every attribute written and its
inputs at ORT's positions (``""`` for an absent optional input). The matched nodes are removed by
the rewriter; what becomes dead outside the pattern (the router Softmax, DequantizeLinear nodes,
Constants) is left to a dead-code pass (``onnx_moe_fuse.passes``).

Exports: the rule classes, :func:`moe_layer_rules`, :func:`moe_layer_rule_set` and the default
:data:`moe_layer_ruleset` (every target op).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from ._moe_analysis import LayerPlan, Refusal, analyse_layer
from ._moe_emit import fused_arrays

__all__ = [
    "COMBINES",
    "FUSED_OPS",
    "REPLACED_KEY",
    "RULE_CLASSES",
    "GatedSwiGLUMoELayer",
    "FusedSwiGLUMoELayer",
    "ElementwiseMoELayer",
    "moe_layer_rules",
    "moe_layer_rule_set",
    "moe_layer_ruleset",
]

#: The ops these rules emit (all in the ``com.microsoft`` domain).
FUSED_OPS = frozenset({"MoE", "QMoE"})
#: The combine spellings; one rule instance each.
COMBINES = ("reduce_sum", "matmul_squeeze", "matmul_reshape")
#: Node metadata key carrying the replaced node names (JSON list), read by the fusion pass.
REPLACED_KEY = "onnx_moe_fuse.replaced"
MS_DOMAIN = "com.microsoft"


def _v(name: str, optional: bool = False) -> pattern.Var:
    return pattern.Var(name, can_match_none=optional)


# -- pattern pieces ----------------------------------------------------------------------------


def _routing_weights(op) -> Any:
    """``TopK(scores, k)`` and the weights made from its values (renormalised, softmax, as is)."""
    values, _ = op.TopK(_v("router_scores"), _v("topk_k"), _outputs=["topk_values", "topk_indices"])
    total = op.ReduceSum(values, _v("renorm_axes", True), _outputs=["renorm_sum"])
    return pattern.OrValue(
        [
            op.Div(values, total),
            op.Mul(values, op.Reciprocal(total)),
            op.Mul(op.Reciprocal(total), values),
            op.Softmax(values),
            values,
        ],
        name="routing_weights",
        tag_var="weight_form",
        tag_values=["renorm_div", "renorm_reciprocal", "renorm_reciprocal", "softmax_k", "as_is"],
    )


def _selected_tail(op, lhs, tag: str, gmm_alternative) -> Any:
    """Gather/MatMul/unit-axis-drop (+ Gather/Add bias), or the GroupedMatMul alternative."""
    weight, idx = _v(f"{tag}_weight"), _v(f"{tag}_indices")
    selected = op.Gather(weight, idx, _outputs=[f"{tag}_gather"])
    mm = op.MatMul(lhs, selected, _outputs=[f"{tag}_matmul"])
    drop = pattern.OrValue(
        [op.Squeeze(mm, _v(f"{tag}_drop_axes", True)), op.Reshape(mm, _v(f"{tag}_drop_shape"))],
        name=f"{tag}_drop",
    )
    bias_sel = op.Gather(
        _v(f"{tag}_bias", True), _v(f"{tag}_bias_indices"), _outputs=[f"{tag}_bias_gather"]
    )
    return pattern.OrValue(
        [gmm_alternative, op.Add(drop, bias_sel), op.Add(bias_sel, drop), drop],
        name=f"{tag}_out",
    )


def _fc_tokens(op, tokens, tag: str) -> Any:
    """A projection of the tokens ``[*, K]`` by each token's k experts -> ``[*, k, N]``."""
    weight, idx, bias = _v(f"{tag}_weight"), _v(f"{tag}_indices"), _v(f"{tag}_bias", True)
    gmm = op.GroupedMatMul(tokens, weight, idx, bias, _outputs=[f"{tag}_gmm"])
    unsq = op.Unsqueeze(tokens, _v(f"{tag}_lhs_axes", True), _outputs=[f"{tag}_lhs_unsq"])
    lhs = pattern.OrValue(
        [op.Expand(unsq, _v(f"{tag}_expand_shape"), _outputs=[f"{tag}_expand"]), unsq]
    )
    return _selected_tail(op, lhs, tag, gmm)


def _fc_slots(op, inputs, tag: str) -> Any:
    """A projection of per-slot inputs ``[*, k, K]`` by the slot's expert -> ``[*, k, N]``."""
    weight, idx, bias = _v(f"{tag}_weight"), _v(f"{tag}_indices"), _v(f"{tag}_bias", True)
    rows = op.Reshape(inputs, _v(f"{tag}_rows_shape"), _outputs=[f"{tag}_rows"])
    row_idx = op.Reshape(idx, _v(f"{tag}_row_idx_shape"), _outputs=[f"{tag}_row_idx"])
    grouped = op.GroupedMatMul(rows, weight, row_idx, bias, _outputs=[f"{tag}_gmm"])
    gmm = op.Reshape(grouped, _v(f"{tag}_unflat_shape"), _outputs=[f"{tag}_unflat"])
    lhs = op.Unsqueeze(inputs, _v(f"{tag}_lhs_axes", True), _outputs=[f"{tag}_lhs_unsq"])
    return _selected_tail(op, lhs, tag, gmm)


def _swiglu(op, gate_src, linear_src) -> Any:
    """``gate * Sigmoid(alpha * gate) * (linear + beta)``, each operand optionally clipped."""
    gate = pattern.OrValue(
        [op.Clip(gate_src, _v("gate_clip_min", True), _v("gate_clip_max", True)), gate_src],
        name="swiglu_gate",
    )
    linear = pattern.OrValue(
        [op.Clip(linear_src, _v("linear_clip_min", True), _v("linear_clip_max", True)), linear_src],
        name="swiglu_linear",
    )
    alpha = _v("swiglu_alpha")
    sig = op.Sigmoid(
        pattern.OrValue(
            [op.Mul(gate, alpha), op.Mul(alpha, gate), gate],
            tag_var="alpha_form",
            tag_values=["scaled", "scaled", "plain"],
        )
    )
    glu = pattern.OrValue([op.Mul(gate, sig), op.Mul(sig, gate)])
    beta = _v("swiglu_beta")
    shifted = pattern.OrValue(
        [op.Add(linear, beta), op.Add(beta, linear), linear],
        tag_var="beta_form",
        tag_values=["shifted", "shifted", "plain"],
    )
    return pattern.OrValue([op.Mul(shifted, glu), op.Mul(glu, shifted)], name="act")


def _combine(op, expert_out, weights, combine: str) -> Any:
    if combine == "reduce_sum":
        w3 = op.Unsqueeze(weights, _v("combine_unsq_axes", True), _outputs=["routing_weights_unsq"])
        weighted = pattern.OrValue([op.Mul(expert_out, w3), op.Mul(w3, expert_out)])
        return op.ReduceSum(weighted, _v("combine_axes", True), _outputs=["layer_out"])
    row = op.Unsqueeze(weights, _v("combine_unsq_axes", True), _outputs=["routing_weights_unsq"])
    mixed = op.MatMul(row, expert_out)
    if combine == "matmul_squeeze":
        return op.Squeeze(mixed, _v("combine_axes", True), _outputs=["layer_out"])
    return op.Reshape(mixed, _v("combine_shape"), _outputs=["layer_out"])


# -- the rules ---------------------------------------------------------------------------------


def _layer_nodes(plan: LayerPlan) -> list[ir.Node]:
    """The nodes the fused node replaces, in graph order (walked back from the layer output)."""
    stop = {id(plan.tokens), id(plan.router_probs)}
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


class _MoELayerRule(pattern.RewriteRuleClassBase):
    """Shared pattern/check/rewrite of the layer rules; subclasses give the activation part."""

    family: ClassVar[str] = ""

    def __init__(
        self,
        name: str | None = None,
        *,
        combine: str = "reduce_sum",
        emit: Iterable[str] = FUSED_OPS,
        probe: bool = False,
    ) -> None:
        """Configure the rule: which combine spelling it matches, which ops it may emit.

        A ``probe`` rule checks like the real one but its rewrite builds only a placeholder: it
        serves dry runs with a tracer (which never apply a rewrite), to collect near misses
        without repacking weights.
        """
        if combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
        emit = frozenset(emit)
        if not emit <= FUSED_OPS:
            raise ValueError(f"emit must be a subset of {sorted(FUSED_OPS)}, got {sorted(emit)}")
        super().__init__(name or f"{type(self).__name__}[{combine}]")
        # configuration only: nothing about a match is ever stored on the rule
        self._combine_form = combine
        self._emit = emit
        self._probe = probe

    def _activation(self, op, tokens) -> Any:
        raise NotImplementedError

    def pattern(self, op, tokens):
        """The whole layer: routing, FC1, activation, FC2, combine."""
        act = self._activation(op, tokens)
        expert_out = _fc_slots(op, act, "fc2")
        return _combine(op, expert_out, _routing_weights(op), self._combine_form)

    def _plan(self, bindings: dict[str, Any], matched=None) -> LayerPlan:
        return analyse_layer(
            bindings,
            family=self.family,
            combine=self._combine_form,
            emit=self._emit,
            matched=matched,
        )

    def check(self, context, **bindings) -> pattern.MatchResult:
        """Prove the rewrite equivalent; a failure names the reason in plain words."""
        result = pattern.MatchResult()
        try:
            self._plan(bindings, matched=set(context.nodes))
        except Refusal as refusal:
            return result.fail(refusal.reason, list(refusal.failure_sources))
        return result

    def rewrite(self, op, **bindings):
        """Emit one ``com.microsoft.MoE``/``QMoE`` node (weights repacked, attributes explicit)."""
        if self._probe:
            return op.Identity(bindings["tokens"])
        plan = self._plan(bindings)
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
            return op.initializer(ir.tensor(np.ascontiguousarray(array), name=name), name=name)

        router = plan.router_probs
        if plan.rank != 2:
            shape = op.Constant(value=ir.tensor(np.array([-1, plan.num_experts], dtype=np.int64)))
            router = op.Reshape(router, shape)
        w1 = const("fc1_experts_weights", arrays.fc1)
        b1 = const("fc1_experts_bias", arrays.fc1_bias)
        w2 = const("fc2_experts_weights", arrays.fc2)
        b2 = const("fc2_experts_bias", arrays.fc2_bias)
        if plan.op == "MoE":
            inputs = [plan.tokens, router, w1, b1, w2, b2]
        else:
            s1 = const("fc1_scales", arrays.fc1_scales)
            s2 = const("fc2_scales", arrays.fc2_scales)
            inputs = [plan.tokens, router, w1, s1, b1, w2, s2, b2]
        while inputs[-1] is None:
            inputs.pop()
        out = op.op(
            plan.op,
            *inputs,
            _domain=MS_DOMAIN,
            _name=f"{base}/{plan.op}",
            **plan.attributes(),
        )
        replaced = [n.name or f"{n.op_type}({n.outputs[0].name})" for n in _layer_nodes(plan)]
        out.producer().metadata_props[REPLACED_KEY] = json.dumps(replaced)
        return out


class GatedSwiGLUMoELayer(_MoELayerRule):
    """SwiGLU from separate gate and up experts (Mixtral, Qwen): two FC1 projections."""

    family = "gated"

    def _activation(self, op, tokens) -> Any:
        gate = _fc_tokens(op, tokens, "fc1_gate")
        up = _fc_tokens(op, tokens, "fc1_up")
        return _swiglu(op, gate, up)


class FusedSwiGLUMoELayer(_MoELayerRule):
    """SwiGLU from one FC1 cut into gate and linear operands (halves, strided slices, Split)."""

    family = "fused_gated"

    def _activation(self, op, tokens) -> Any:
        fc1 = _fc_tokens(op, tokens, "fc1")  # bound as "fc1_out"
        first, second = op.Split(fc1, _v("split_sizes", True), _outputs=2)

        def operand(name: str, prefix: str) -> Any:
            cut = op.Slice(
                fc1,
                _v(f"{prefix}_starts"),
                _v(f"{prefix}_ends"),
                _v(f"{prefix}_axes", True),
                _v(f"{prefix}_steps", True),
            )
            return pattern.OrValue([cut, first, second], name=name)

        return _swiglu(
            op, operand("swiglu_gate_src", "gate_slice"), operand("swiglu_linear_src", "lin_slice")
        )


class ElementwiseMoELayer(_MoELayerRule):
    """One FC1 and an element-wise activation: Relu, tanh Gelu, SiLU, identity (Erf refused)."""

    family = "elementwise"

    def _activation(self, op, tokens) -> Any:
        h = _fc_tokens(op, tokens, "fc1")  # bound as "fc1_out"
        erf = op.Erf(pattern.OrValue([op.Div(h, _v("erf_div")), op.Mul(h, _v("erf_scale"))]))
        one_plus = pattern.OrValue([op.Add(erf, _v("erf_one")), op.Add(_v("erf_one"), erf)])
        half = _v("erf_half")
        alternatives = [
            (op.Relu(h), "relu"),
            (op.Gelu(h), "gelu"),
            (op.FastGelu(h, _domain=MS_DOMAIN), "fast_gelu"),
            (op.Gelu(h, _domain=MS_DOMAIN), "ms_gelu"),
            (op.Mul(h, op.Sigmoid(h)), "silu_mul"),
            (op.Mul(op.Sigmoid(h), h), "silu_mul_r"),
            (op.Swish(h), "swish"),
            (op.Mul(op.Mul(h, half), one_plus), "erf_gelu"),
            (op.Mul(one_plus, op.Mul(h, half)), "erf_gelu"),
            (op.Mul(op.Mul(h, one_plus), half), "erf_gelu"),
            (op.Mul(h, op.Mul(one_plus, half)), "erf_gelu"),
            (op.Mul(h, op.Mul(half, one_plus)), "erf_gelu"),
            (h, "identity"),
        ]
        return pattern.OrValue(
            [a for a, _ in alternatives],
            name="act",
            tag_var="activation",
            tag_values=[t for _, t in alternatives],
        )


RULE_CLASSES = (GatedSwiGLUMoELayer, FusedSwiGLUMoELayer, ElementwiseMoELayer)


def moe_layer_rules(
    emit: Iterable[str] = FUSED_OPS, *, probe: bool = False
) -> list[pattern.RewriteRule]:
    """Every layer rule (each family x each combine spelling), emitting only ops in ``emit``."""
    emit = frozenset(emit)
    return [cls.rule(combine=c, emit=emit, probe=probe) for cls in RULE_CLASSES for c in COMBINES]


def moe_layer_rule_set(
    emit: Iterable[str] = FUSED_OPS, *, probe: bool = False
) -> pattern.RewriteRuleSet:
    """A rule set of :func:`moe_layer_rules`; it never sweeps dead code by itself."""
    rule_set = pattern.RewriteRuleSet(moe_layer_rules(emit, probe=probe))
    rule_set.remove_unused_nodes = False
    return rule_set


moe_layer_ruleset = moe_layer_rule_set()
