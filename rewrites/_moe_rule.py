"""What every MoE layer rule shares: the routing and activation pattern pieces, the base rule.

The layer rules come in two layouts, one module each, and differ only in how the experts'
projections and the combine are spelled (and so in the pattern around the activation and in the
proofs of those parts):

* :mod:`.moe_layer`: projections per slot, ``[*, k, N]`` (GroupedMatMul or Gather + MatMul);
* :mod:`.moe_layer_batched`: projections on flattened ``[T*k, N]`` rows (torch.onnx exports of
  transformers' ``batched_mm`` experts: GatherND of stacked weights by flattened top-k ids).

Everything else is here, once: the routing TopK and its weight forms (:func:`routing_pattern`),
the activation of each family (:func:`activation_pattern`: separate gate/up experts, one FC1 cut
into gate and linear operands, or an element-wise activation), and :class:`MoELayerRule`, whose
``check`` turns the layout's proof (a :class:`~._moe_analysis.LayerPlan` or a refusal) into a
``MatchResult`` and whose ``rewrite`` emits the fused node from the plan.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from ._moe_analysis import LayerPlan, Refusal, refusal_part
from ._moe_emit import fused_arrays

__all__ = [
    "FAMILIES",
    "FUSED_OPS",
    "MS_DOMAIN",
    "LAYER_OUT_KEY",
    "REPLACED_KEY",
    "TOPK_KEY",
    "MoELayerRule",
    "activation_pattern",
    "routing_pattern",
    "var",
]

#: The ops the layer rules emit (all in the ``com.microsoft`` domain).
FUSED_OPS = frozenset({"MoE", "QMoE"})
#: Node metadata key carrying the replaced node names (JSON list), read by the fusion pass.
REPLACED_KEY = "onnx_moe_fuse.replaced"
#: Node metadata keys naming the value a fused node replaces and its routing TopK's first output.
LAYER_OUT_KEY = "onnx_moe_fuse.layer_out"
TOPK_KEY = "onnx_moe_fuse.topk"
MS_DOMAIN = "com.microsoft"
#: The activation families (see :func:`activation_pattern`).
FAMILIES = ("gated", "fused_gated", "elementwise")


def var(name: str, optional: bool = False) -> pattern.Var:
    """A pattern variable; ``optional`` ones also match an absent (empty) input."""
    return pattern.Var(name, can_match_none=optional)


def routing_pattern(op) -> tuple[Any, Any]:
    """``TopK(scores, k)``: (the routing weights made from its values, its indices).

    The weights are renormalised (``Div(v, ReduceSum(v))``, ``Mul(v, Reciprocal(ReduceSum(v)))``),
    a ``Softmax`` over the k values, or the values as they are; whether ``scores`` is a
    ``Softmax`` of the logits is decided in ``check``.
    """
    values, indices = op.TopK(
        var("router_scores"), var("topk_k"), _outputs=["topk_values", "topk_indices"]
    )
    total = op.ReduceSum(values, var("renorm_axes", True), _outputs=["renorm_sum"])
    weights = pattern.OrValue(
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
    return weights, indices


def _swiglu(op, gate_src, linear_src) -> Any:
    """``gate * Sigmoid(alpha * gate) * (linear + beta)``, each operand optionally clipped."""
    gate = pattern.OrValue(
        [op.Clip(gate_src, var("gate_clip_min", True), var("gate_clip_max", True)), gate_src],
        name="swiglu_gate",
    )
    linear = pattern.OrValue(
        [
            op.Clip(linear_src, var("linear_clip_min", True), var("linear_clip_max", True)),
            linear_src,
        ],
        name="swiglu_linear",
    )
    alpha = var("swiglu_alpha")
    sig = op.Sigmoid(
        pattern.OrValue(
            [op.Mul(gate, alpha), op.Mul(alpha, gate), gate],
            tag_var="alpha_form",
            tag_values=["scaled", "scaled", "plain"],
        )
    )
    glu = pattern.OrValue([op.Mul(gate, sig), op.Mul(sig, gate)])
    beta = var("swiglu_beta")
    shifted = pattern.OrValue(
        [op.Add(linear, beta), op.Add(beta, linear), linear],
        tag_var="beta_form",
        tag_values=["shifted", "shifted", "plain"],
    )
    return pattern.OrValue([op.Mul(shifted, glu), op.Mul(glu, shifted)], name="act")


def _cut_swiglu(op, fc1) -> Any:
    """SwiGLU of one FC1 cut into gate and linear operands (Slice halves/strided, or Split)."""
    h = fc1("fc1")  # bound as "fc1_out"
    first, second = op.Split(h, var("split_sizes", True), _outputs=2)

    def operand(name: str, prefix: str) -> Any:
        cut = op.Slice(
            h,
            var(f"{prefix}_starts"),
            var(f"{prefix}_ends"),
            var(f"{prefix}_axes", True),
            var(f"{prefix}_steps", True),
        )
        return pattern.OrValue([cut, first, second], name=name)

    return _swiglu(
        op, operand("swiglu_gate_src", "gate_slice"), operand("swiglu_linear_src", "lin_slice")
    )


def _elementwise(op, fc1) -> Any:
    """Relu, tanh Gelu, SiLU, identity, and the exact-GELU spellings ``check`` must refuse."""
    h = fc1("fc1")  # bound as "fc1_out"
    erf = op.Erf(pattern.OrValue([op.Div(h, var("erf_div")), op.Mul(h, var("erf_scale"))]))
    one_plus = pattern.OrValue([op.Add(erf, var("erf_one")), op.Add(var("erf_one"), erf)])
    half = var("erf_half")
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


def activation_pattern(op, family: str, fc1: Callable[[str], Any]) -> Any:
    """The activation part of a layer of ``family``, the FC1 projections built by ``fc1(tag)``.

    * ``"gated"``: SwiGLU of two projections, ``fc1("fc1_gate")`` and ``fc1("fc1_up")``;
    * ``"fused_gated"``: SwiGLU of one projection ``fc1("fc1")`` cut by ``Slice`` (halves or
      strided) or ``Split``;
    * ``"elementwise"``: an element-wise activation of ``fc1("fc1")``.

    SwiGLU: ``gate * Sigmoid(alpha * gate) * (linear + beta)``, each operand optionally
    ``Clip``-ped, alpha and beta optional.
    """
    if family == "gated":
        return _swiglu(op, fc1("fc1_gate"), fc1("fc1_up"))
    if family == "fused_gated":
        return _cut_swiglu(op, fc1)
    if family == "elementwise":
        return _elementwise(op, fc1)
    raise ValueError(f"unknown activation family {family!r}; choose among {FAMILIES}")


# -- the rule ----------------------------------------------------------------------------------


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


class MoELayerRule(pattern.RewriteRuleClassBase):
    """A whole-layer rule: ``check`` proves, ``rewrite`` emits one MoE/QMoE node.

    A concrete rule gives its activation ``family`` (a class attribute) and its layout: the
    combine spellings it takes (``combines``), the whole-layer ``pattern`` and ``_analyse``, the
    layout's proof (a pure function of the graph and the bindings, returning a
    :class:`~._moe_analysis.LayerPlan` or raising :class:`~._moe_analysis.Refusal`).
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
    ) -> None:
        """Configure the rule: which combine spelling it matches, which ops it may emit.

        ``combine`` defaults to the layout's first spelling. A ``probe`` rule checks like the
        real one but its rewrite builds only a placeholder: it serves dry runs with a tracer
        (which never apply a rewrite), to collect near misses without repacking weights.

        A ``splice`` rule runs on a canonicalised working copy whose fused nodes are spliced
        into the original graph afterwards (``onnx_moe_fuse.passes``): the splice proves the
        layer's region in the original, keeps what escapes upstream of the experts (a router
        Softmax that is also a graph output) and refuses the rest. So a splice rule neither
        checks escapes nor removes the matched nodes; used alone (the default), a rule does both.
        """
        combine = self.combines[0] if combine is None else combine
        if combine not in self.combines:
            raise ValueError(f"combine must be one of {self.combines}, got {combine!r}")
        emit = frozenset(emit)
        if not emit <= FUSED_OPS:
            raise ValueError(f"emit must be a subset of {sorted(FUSED_OPS)}, got {sorted(emit)}")
        super().__init__(name or f"{type(self).__name__}[{combine}]", remove_nodes=not splice)
        # configuration only: nothing about a match is ever stored on the rule
        self._combine_form = combine
        self._emit = emit
        self._probe = probe
        self._splice = splice

    def _activation(self, op, fc1: Callable[[str], Any]) -> Any:
        return activation_pattern(op, self.family, fc1)

    def _analyse(self, bindings: dict[str, Any], matched=None) -> LayerPlan:
        raise NotImplementedError

    def check(self, context, **bindings) -> pattern.MatchResult:
        """Prove the rewrite equivalent; a failure names the reason in plain words."""
        result = pattern.MatchResult()
        try:
            self._analyse(bindings, matched=None if self._splice else set(context.nodes))
        except Refusal as refusal:
            part = refusal_part(refusal)
            reason = f"{part}: {refusal.reason}" if part else refusal.reason
            return result.fail(reason, list(refusal.failure_sources))
        return result

    def rewrite(self, op, **bindings):
        """Emit one ``com.microsoft.MoE``/``QMoE`` node (weights repacked, attributes explicit)."""
        if self._probe:
            return op.Identity(bindings["tokens"])
        plan = self._analyse(bindings)
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
        meta = out.producer().metadata_props
        meta[REPLACED_KEY] = json.dumps(replaced)
        # for the pipeline's splice: a splice rule keeps the matched nodes, so the rewriter
        # gives the fused output a fresh name; these name what it replaces and its router
        meta[LAYER_OUT_KEY] = plan.root.outputs[0].name or ""
        meta[TOPK_KEY] = plan.topk.outputs[0].name or ""
        return out
