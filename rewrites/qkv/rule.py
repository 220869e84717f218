"""RMS norm + Q/K/V projections -> one ``com.microsoft.MatMulNBitsQkv``.

What the rules match (one rule instance per norm spelling and per mix of projection kinds)::

    x      = A                      |  Add(A, skip)                (the residual)
    normed = SimplifiedLayerNormalization(x, scale)                (ORT, default domain)
           | RMSNormalization(x, scale)                            (opset 23)
           | decomposed: [Cast(x, float)] -> Pow(., 2) | Mul(., .) -> ReduceMean(last axis)
             -> Add(., eps) -> Sqrt -> Div(x, rms) | Mul(x, Reciprocal(rms) | Div(1, rms))
             -> [Cast] -> Mul(., [Cast](scale)) (either order) [-> Cast]
    normed, .., .., residual = com.microsoft.SkipSimplifiedLayerNormalization(A, skip, scale)
    P_i    = com.microsoft.MatMulNBits(normed, B_i, scales_i [, zero_points_i])
           | MatMul(normed, DequantizeLinear(W_i [K, N_i] int4/uint4, scale_i [, zp_i]))

for exactly three projections ``P_1..P_3`` of ``normed`` (input 0 of a MatMulNBits or MatMul).
The pattern proves the structure; ``check`` proves the meaning (plain-words failures feed
``--explain``): bits 4, block_size 32 along K, zero points absent or all 8 (MatMulNBits) or
symmetric (int4 without zero point or with 0, uint4 with 8), no bias or act-order ``g_idx``,
constant DQ weights, the same K everywhere, the norm over the last axis with a ``[K]`` scale and a
non-negative epsilon, every dtype float32 or float16 and never computed in less precision than
the fused node, a rank-2 or rank-3 input, and which projection is Q (below).

Q, K and V: K and V must have the same width (``Nkv``); a third, different width is Q. Where all
three widths are equal (or to pick K against V), the downstream use decides: the input of an
attention op (``GroupQueryAttention``/``MultiHeadAttention``/``Attention``...: 0 = Q, 1 = K,
2 = V) or of a decomposed attention (``MatMul`` feeding ``Softmax``: input 0 = Q, input 1 = K;
``MatMul`` after ``Softmax``: input 1 = V) reached through shape-only and element-wise ops,
``RotaryEmbedding`` (Q or K, never V), then the names of the projection, its weights and the
values it feeds (``q``/``query``/``q_proj``, ``k``/``key``, ``v``/``value`` tokens). Evidence that
contradicts the widths refuses the rewrite; with no evidence for Q the rule refuses ("cannot
tell"); with none for K against V it takes graph order (the earlier one is K): both slots have the
width Nkv and each output is rewired to the slot computed from its own weights, so the choice
cannot change a number.

What ``rewrite`` emits: one ``com.microsoft.MatMulNBitsQkv`` inserted right after the norm, its
inputs by name at ONNX Runtime's positions (``onnx_moe_fuse.contract.ops``): ``A, skip,
norm_scale, q_B, q_scales, "", k_B, k_scales, "", v_B, v_scales`` and every attribute written (``K, Nq, Nkv, bits=4, block_size=32, epsilon,
accuracy_level=0``). MatMulNBits weights pass through unchanged (flat scales reshaped to
``[N, k_blocks]``); DequantizeLinear weights are repacked into MatMulNBits layout (int4 codes
shifted by 8, low nibble first, a last partial block padded with 8). The three projection outputs
are rewired to Q, K, V. The fused node takes ``skip`` (and its output 3 replaces the residual for
every other reader) when the norm's nodes die with the rewrite; when the normalised value (or any
intermediate of the norm) has other readers, the norm stays for them, and the fused node reads
``A + skip`` from the kept residual instead of adding it again.

The rules never remove nodes themselves (``remove_nodes=False``): the replaced projections and
the dead norm are left for a dead-code pass (``onnxscript.rewriter.rewrite`` runs one; so does
the fuser's pipeline), and a graph that does not match is left exactly as it was.

Exports: :class:`MatMulNBitsQkvRule`, :func:`rules` (the rule set), :func:`rule_instances`,
:func:`near_misses` (why each candidate norm did not fuse, as
:class:`~onnx_moe_fuse.rewrites.graph.refusals.NearMiss` records), :data:`FUSED_OP`,
:data:`FUSED_ATTRIBUTES`, :data:`REPLACED_KEY`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import _basics, pattern

from onnx_moe_fuse.contract.ops import MATMUL_NBITS_QKV
from onnx_moe_fuse.rewrites.graph.refusals import NearMiss, Refusal, RefusalTracer, refusal_of
from onnx_moe_fuse.rewrites.graph.weight_sink import WeightSink, in_memory
from onnx_moe_fuse.rewrites.qkv.graph import (
    FUSED_ATTRIBUTES,
    FUSED_OP,
    MS_DOMAIN,
    NORM_FORMS,
    PROJECTION_MIXES,
    REPLACED_KEY,
    ROLES,
    item_label,
    pick,
    static_dims,
)
from onnx_moe_fuse.rewrites.qkv.norm import (
    decomposed_facts,
    fused_scale,
    norm_region_nodes,
    op_norm_facts,
    read_uses,
    same_shape,
)
from onnx_moe_fuse.rewrites.qkv.pattern import (
    PreludeMatcher,
    norm_pattern,
    projection,
)
from onnx_moe_fuse.rewrites.qkv.projections import (
    Plan,
    first_rank,
    read_projections,
)
from onnx_moe_fuse.rewrites.qkv.roles import (
    assign_roles,
)

__all__ = [
    "FUSED_ATTRIBUTES",
    "FUSED_OP",
    "MS_DOMAIN",
    "NORM_FORMS",
    "PROJECTION_MIXES",
    "REPLACED_KEY",
    "PRELUDE",
    "MatMulNBitsQkvRule",
    "near_misses",
    "rule_instances",
    "rules",
]

# -- the whole analysis ------------------------------------------------------------------------


def _analyse(b: dict[str, Any], form: str) -> Plan:
    """Prove the rewrite equivalent and plan it, or raise a refusal naming the reason."""
    normed = b["normed"]
    anchor = normed.producer()
    projections = read_projections(b)
    dtype = projections[0].dtype
    k = projections[0].k
    residual = b.get("residual")
    a_in = pick(b, "a", "x")
    skip_in = b.get("skip")
    rank = first_rank(a_in, skip_in, residual, normed, *[p.output for p in projections])
    if form.removeprefix("add_").startswith("decomposed"):
        facts = decomposed_facts(b, dtype, rank)
    else:
        facts = op_norm_facts(b, dtype, rank)
    if rank not in (2, 3):
        raise Refusal(
            f"the norm's input {item_label(facts.x)} has "
            + ("an unknown rank (run shape inference)" if rank is None else f"rank {rank}")
            + "; MatMulNBitsQkv takes [T, K] or [B, S, K]",
            facts.x,
        )
    last = static_dims(a_in)
    if last is not None and last[-1] != k:
        raise Refusal(
            f"the norm's input {item_label(a_in)} has last axis {last[-1]}, but the projections "
            f"have K={k}",
            a_in,
        )
    if not np.isfinite(facts.epsilon) or facts.epsilon < 0:
        raise Refusal(f"the norm's epsilon {facts.epsilon} is negative or not finite", anchor)
    scale = fused_scale(facts, dtype, k)

    # What dies with the rewrite, and where A + skip comes from.
    proj_nodes = [p.node for p in projections]
    norm_nodes = norm_region_nodes(normed, [a_in, skip_in, facts.scale])
    norm_ids = {id(n) for n in norm_nodes}
    proj_ids = {id(n) for n in proj_nodes}
    survives = read_uses(normed, proj_ids) or any(
        read_uses(v, norm_ids | proj_ids)
        for n in norm_nodes
        for v in n.outputs
        if v is not normed and v is not residual
    )
    a, skip, emit_residual = a_in, None, False
    if skip_in is not None:
        a, skip = b["a"], skip_in
        residual_read = residual is not None and read_uses(residual, norm_ids)
        if survives:
            if residual is not None and residual.name:
                a, skip = residual, None  # the kept norm computes A + skip anyway
        elif residual_read:
            graph = anchor.graph
            order = {id(n): i for i, n in enumerate(graph)} if graph is not None else {}
            here = order.get(id(anchor), -1)
            late = all(id(u) in norm_ids or order.get(id(u), -1) > here for u, _ in residual.uses())
            if late:
                emit_residual = True
            else:  # a reader sits before the norm: keep the Add for it, read its output
                a, skip = residual, None
        if skip is not None and not same_shape(b["a"], skip):
            if form.startswith("skip_sln"):
                raise Refusal(
                    f"{item_label(anchor)}: the skip {item_label(skip)} cannot be proven to have the "
                    f"input's shape (it may broadcast); MatMulNBitsQkv's skip must match A",
                    anchor,
                    skip,
                )
            a, skip, emit_residual = residual, None, False
    graph = anchor.graph
    position = {id(n): i for i, n in enumerate(graph)} if graph is not None else {}
    roles = assign_roles(projections, [position.get(id(n), 0) for n in proj_nodes])
    replaced = list(proj_nodes)
    if not survives:
        replaced = norm_nodes + replaced
    return Plan(
        anchor=anchor,
        normed=normed,
        a=a,
        skip=skip,
        scale=scale,
        epsilon=float(np.float32(facts.epsilon)),
        dtype=dtype,
        k=k,
        projections=projections,
        roles=roles,
        residual=residual,
        emit_residual=emit_residual,
        replaced=replaced,
    )


# -- the rule ----------------------------------------------------------------------------------


def _fresh_name(graph: ir.Graph | None, base: str, taken: set[str]) -> str:
    existing = graph.initializers if graph is not None else {}
    name, i = base, 1
    while name in existing or name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


class MatMulNBitsQkvRule(pattern.RewriteRuleClassBase):
    """One norm spelling and one mix of projection kinds -> ``com.microsoft.MatMulNBitsQkv``."""

    def __init__(
        self, form: str, mix: str, name: str | None = None, weight_sink: WeightSink | None = None
    ) -> None:
        """Configure the instance: the norm spelling (:data:`NORM_FORMS`) and projection kinds.

        ``weight_sink`` stores each repacked array as an initializer's tensor
        (:mod:`.weight_sink`; default in memory).
        """
        if form not in NORM_FORMS:
            raise ValueError(f"form must be one of {NORM_FORMS}, got {form!r}")
        if mix not in PROJECTION_MIXES:
            raise ValueError(f"mix must be one of {PROJECTION_MIXES}, got {mix!r}")
        super().__init__(name or f"MatMulNBitsQkv[{form},{mix}]", remove_nodes=False)
        # configuration only: nothing about a match is ever stored on the rule
        self._form = form
        self._mix = mix
        self._weight_sink = in_memory if weight_sink is None else weight_sink

    @classmethod
    def rule(cls, *args, **kwargs) -> pattern.RewriteRule:
        """A RewriteRule using the readers-of-the-norm matcher (see :class:`_PreludeMatcher`)."""
        instance = cls(*args, **kwargs)
        return pattern.RewriteRule(
            instance.pattern,
            instance.rewrite,
            instance.check,
            PreludeMatcher,
            name=instance.name,
            remove_nodes=False,
            graph_pre_visitor=instance.setup,
            graph_post_visitor=instance.cleanup,
        )

    def pattern(self, op):
        """The norm (first output: its anchor) and its three projections (+ the residual)."""
        normed, residual = norm_pattern(op, self._form)
        outs = [normed] + [projection(op, normed, s + 1, k) for s, k in enumerate(self._mix)]
        if residual is not None:
            outs.append(residual)
        return outs

    def check(self, context, **bindings) -> pattern.MatchResult:
        """Prove the rewrite equivalent; a failure names the reason in plain words."""
        del context
        try:
            _analyse(bindings, self._form)
        except _basics.MatchFailureError as error:
            return Refusal.of(error).fail()  # carries the refusal for near_misses' tracer
        return pattern.MatchResult()

    def rewrite(self, op, **bindings):
        """Emit one MatMulNBitsQkv after the norm; rewire Q, K, V (and the residual)."""
        plan = _analyse(bindings, self._form)
        graph = plan.anchor.graph
        base = re.sub(r"[^A-Za-z0-9_.]+", "_", plan.anchor.name or plan.normed.name or "norm")
        base = f"{base}.qkv"
        taken: set[str] = set()

        def value(item: ir.Value | np.ndarray, suffix: str) -> ir.Value:
            if isinstance(item, ir.Value):
                return item
            name = _fresh_name(graph, f"{base}.{suffix}", taken)
            return op.initializer(self._weight_sink(item, name), name=name)

        values: dict[str, ir.Value | None] = {
            "A": plan.a,
            "skip": plan.skip,
            "norm_scale": value(plan.scale, "norm_scale"),
        }
        for role in ROLES:  # no biases: the rule refuses projections with one
            p = plan.projections[plan.roles[role]]
            values[f"{role}_B"] = value(p.b, f"{role}_B")
            values[f"{role}_scales"] = value(p.scales, f"{role}_scales")
        outs = op.op(
            MATMUL_NBITS_QKV.name,
            # every slot: the rule has always emitted all twelve (a dead-code pass drops the
            # trailing empty one, which ONNX reads the same way)
            *MATMUL_NBITS_QKV.input_list(values, every_slot=True),
            _domain=MATMUL_NBITS_QKV.domain,
            _outputs=4 if plan.emit_residual else 3,
            _name=f"{base}/{FUSED_OP}",
            **plan.attributes(),
        )
        fused = outs[0].producer()
        fused.metadata_props[REPLACED_KEY] = json.dumps([item_label(n) for n in plan.replaced])
        by_slot = {plan.roles[role]: outs[i] for i, role in enumerate(ROLES)}
        result = [plan.normed] + [by_slot[i] for i in range(3)]
        if plan.residual is not None:
            result.append(outs[3] if plan.emit_residual else plan.residual)
        return result


def rule_instances(weight_sink: WeightSink | None = None) -> list[pattern.RewriteRule]:
    """Every instance: each norm spelling times each projection mix."""
    return [
        MatMulNBitsQkvRule.rule(form, mix, weight_sink=weight_sink)
        for form in NORM_FORMS
        for mix in PROJECTION_MIXES
    ]


def rules(weight_sink: WeightSink | None = None) -> pattern.RewriteRuleSet:
    """The rule set. It never sweeps dead code itself: run a dead-code pass after it.

    To merge these rules into another ``RewriteRuleSet``, set its ``remove_unused_nodes`` to
    False as here: onnxscript turns it on for any set holding a ``remove_nodes=False`` rule, and
    then sweeps dead code even from graphs where nothing fused.
    """
    rule_set = pattern.RewriteRuleSet(rule_instances(weight_sink))
    rule_set.remove_unused_nodes = False
    return rule_set


# -- explanations ------------------------------------------------------------------------------

#: The part every near miss of these rules names: the prelude as a whole.
PRELUDE = "attention prelude"


def near_misses(model: onnx.ModelProto | ir.Model) -> list[NearMiss]:
    """Why each candidate norm did not fuse (a dry run: the model is not changed).

    A candidate is a norm whose match failed a check, or one read by other than three
    projections (at least one): the matcher's one typed refusal. Norms that some rule instance
    would fuse are not reported. One record per norm and reason, of part :data:`PRELUDE`.
    """
    if isinstance(model, onnx.ModelProto):
        model = ir.serde.deserialize_model(model)
    tracer = RefusalTracer()
    rules().apply_to_model(model, tracer=tracer)
    fused = tracer.matched()
    found: dict[tuple[int, str], NearMiss] = {}
    for rule, node, match, status in tracer.logged:
        if id(node) in fused:
            continue
        refusal = refusal_of(match)
        if status == _basics.MatchStatus.CONDITION_FAILED or (
            status == _basics.MatchStatus.NO_MATCH and refusal is not None
        ):
            if refusal is None:  # onnxscript's own check failure
                refusal = Refusal(match.reason or "", *match.failure_nodes_and_values)
            values = tuple(item_label(v) for v in match.failure_nodes_and_values)
            miss = NearMiss.of(
                refusal,
                rule=rule,
                values=values,
                node=item_label(node),
                root=item_label(node),
                part=PRELUDE,
            )
            found.setdefault((id(node), match.reason or ""), miss)
    return list(found.values())
